"""Database URLs shared by MLflow and Optuna, and the locks that make their shared use safe when
several processes, on one machine or many, start together or share a study.

SQLite has no server to arbitrate schema creation: two processes opening a fresh file both try
to create the tables and one fails ("table ... already exists"). A lock file beside the database
serializes that first use, and the tuner's "count trials, then ask", between the processes of
one machine. On PostgreSQL the same sections take an advisory lock, which the database holds
for processes on any machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional

SQLITE = "sqlite:///"
JOURNAL = "journal:///"
# The project: the checkout that holds conf/ (Hydra's config_path) and outputs/, whose
# outputs/mlflow.db `make ui` (scripts/ui.sh) serves
PROJECT = Path(__file__).resolve().parents[1]


def resolve_uri(uri: str, base: Optional[Path] = None) -> str:
    """A relative SQLite (or journal) path made absolute, relative to `base` (default: the working
    directory), so that ranks, subprocesses and the UI agree. The tracking store passes PROJECT:
    its default, sqlite:///outputs/mlflow.db, is the project's wherever the command runs."""
    for scheme in (SQLITE, JOURNAL):  # journal:///path: an Optuna journal file (tune/storage.py)
        if uri.startswith(scheme) and not uri.startswith(scheme + "/"):
            return scheme + str(((base or Path.cwd()) / uri[len(scheme):]).resolve())
    return uri


# `scheme://user:password@` in any text, the colons possibly escaped as Hydra logs overrides; an
# OmegaConf `${oc.env:VAR}` in the password's place is no secret and is kept (it says where it comes from)
_PASSWORD = re.compile(r"(\\?://[^/@:\s'\"\\]*\\?:)(?!\$\{)([^/@\s'\"]+)(@)")


def redact(text: str) -> str:
    """`text` (a URL, a message, a command line, a file's content) with the password of every URL
    in it masked as `***`: for messages, logs, MLflow params and every file written."""
    return _PASSWORD.sub(r"\1***\3", text)


def redact_files(paths: Iterable[Path]) -> None:
    """Mask URL passwords in files someone else wrote (Hydra's .hydra/*.yaml, multirun.yaml)."""
    from .rundir import write_atomic

    for path in paths:
        if path.is_file():
            text = path.read_text()
            if redact(text) != text:
                write_atomic(path, redact(text))


# what a database driver says when the server is gone (not "database is locked": SQLite is no server)
_UNREACHABLE = re.compile(r"connect|server closed|terminating connection|network|could not translate host", re.I)


def store_error(exc: BaseException, uri: str, what: str = "tracking store") -> str:
    """One line for a failure of an MLflow or Optuna store. A lost connection (an OperationalError
    of psycopg or SQLAlchemy in the cause chain, or MLflow's message saying so) is said as such,
    with the driver's own words, never the wrapper's guess (Optuna: "invalid data in the commit,
    e.g. exceeding max length")."""
    chain, seen = [], exc  # type: ignore[var-annotated]
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in reversed(chain):  # the driver's error is the deepest
        text = str(e).strip()
        operational = type(e).__name__ == "OperationalError"
        mlflow = type(e).__name__ == "MlflowException" and "connection" in text.lower()
        if (operational and _UNREACHABLE.search(text)) or mlflow:
            return f"{what} {redact(uri)} unreachable: {redact(text.splitlines()[0][:300])}"
    text = str(exc).strip()
    return redact(text.splitlines()[0][:300] if text else type(exc).__name__)


class RedactPasswords(logging.Filter):
    """A logging filter masking URL passwords (Hydra logs a sweep's overrides; conf/config.yaml)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        return True


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a `sqlite:///` URL; None for any other URL."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created if missing), released on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def store_lock(uri: str, name: str = "") -> Iterator[None]:
    """Serializes a critical section between the processes that share the store `uri`: a lock
    file beside a SQLite database (`<db>.lock`, or `<db>.<name>.lock`; processes of one machine),
    a PostgreSQL advisory lock keyed by `name` (processes on any machine); other stores: none."""
    db = sqlite_path(uri)
    if db is not None:
        with file_lock(db.with_name(db.name + (f".{name}" if name else "") + ".lock")):
            yield
    elif uri.startswith(("postgresql://", "postgresql+")):
        with advisory_lock(uri, name or "store"):
            yield
    else:
        yield


def lock_key(name: str) -> int:
    """A stable signed 64-bit key for pg_advisory_lock (the same on every machine)."""
    return int.from_bytes(hashlib.blake2b(f"orchestrator:{name}".encode(), digest_size=8).digest(), "big",
                          signed=True)


@contextlib.contextmanager
def advisory_lock(uri: str, name: str) -> Iterator[None]:
    """A PostgreSQL session-level advisory lock held on its own connection (released by the server
    if that connection dies, e.g. when the database restarts)."""
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    engine = sa.create_engine(uri, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    key = lock_key(name)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                try:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                except Exception:  # the connection is gone, and the lock with it
                    pass
    finally:
        engine.dispose()
