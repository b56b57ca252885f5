"""A throwaway PostgreSQL server for tests and benchmarks: Debian's `postgresql` package (which
`make setup` installs), initdb + pg_ctl in a temporary directory, loopback only, password auth
over TCP. PostgreSQL refuses to run as root, so as root it runs as the `postgres` user."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional

PASSWORD = "orchestrator-test"


def pg_bin() -> Optional[Path]:
    """The folder of initdb / pg_ctl: Debian's versioned one, else PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, databases: List[str]) -> None:
        bin_dir = pg_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql; make setup does it)")
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="orchestrator-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres")
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.as_root:
            shutil.chown(pwfile, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", f"--pwfile={pwfile}", "--auth-local=trust",
                  "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        self.start()
        for db in databases:
            self.psql(f"CREATE DATABASE {db}")

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start")

    def restart(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-m", "fast", "-w",
                  "restart")

    def psql(self, sql: str, db: str = "postgres") -> str:
        return self._run("psql", "-h", str(self.root), "-p", str(self.port), "-U", "postgres", "-d", db,
                         "-tAc", sql).stdout

    def url(self, db: str, password: str = PASSWORD) -> str:
        return f"postgresql+psycopg://postgres:{password}@127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
