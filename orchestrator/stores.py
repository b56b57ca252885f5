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
from typing import Iterable, Iterator, Optional, Tuple

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


# a URL in any text: a scheme, `://` (its colon possibly escaped, as Hydra logs overrides), and
# everything up to a space or a quote
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\\?://[^\s'\"]*")
# a password given in the query (`?password=...`: SQLAlchemy hands it to the driver as a keyword)
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd)=)([^&\s'\"]*)", re.I)


def _password_span(rest: str) -> Optional[Tuple[int, int]]:
    """Where the password lies in `rest` (a URL after its `://`): from the first colon of the
    userinfo to the LAST `@`. Wider than any driver reads it (SQLAlchemy's make_url ends it at the
    first `@`, urllib at the first `/`), so that a password holding `@` or `/` is masked whole.
    None: no password, or an OmegaConf `${oc.env:VAR}` in its place (no secret; it says where the
    password comes from)."""
    at = rest.rfind("@")
    if at <= 0:
        return None
    userinfo = rest[:at]
    colon = userinfo.find(":", userinfo.find("}") + 1 if userinfo.startswith("${") else 0)
    if colon < 0 or userinfo.startswith("${", colon + 1):
        return None
    return colon + 1, at


def mask_url(url: str) -> str:
    """`url` with its password masked as `***`, wherever a driver would take one: the userinfo
    (percent-encoded or not, holding `/` or `@` or not) and a `password=` in the query."""
    head, sep, rest = url.partition("://")
    span = _password_span(rest)
    if span is not None:
        rest = rest[:span[0]] + "***" + rest[span[1]:]
    return head + sep + _QUERY_PASSWORD.sub(r"\1***", rest)


def redact(text: str) -> str:
    """`text` (a URL, a message, a command line, a file's content) with the password of every URL
    in it masked as `***`: for messages, logs, MLflow params and every file written. The one
    place passwords are masked."""
    return _URL.sub(lambda m: mask_url(m.group(0)), text)


def misread_password(uri: str) -> Optional[str]:
    """Why the driver of `uri` would read a password other than the one written in it (a `@` or
    `/` left unescaped: SQLAlchemy's make_url, as every RDB store parses it, ends the password at
    its first `@`; urllib, as the MLflow client parses http URLs, ends the host at the first `/`);
    None when it reads it as written. The answer names the characters, never the password."""
    from urllib.parse import unquote, urlsplit

    span = _password_span(uri.partition("://")[2])
    if span is None or uri.startswith((SQLITE, JOURNAL)):
        return None
    written = uri.partition("://")[2][span[0]:span[1]]
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        if uri.startswith(("http://", "https://")):
            parts = urlsplit(uri)
            if parts.password is None and parts.netloc.rpartition(":")[2].isdigit():
                return None  # host:port/path@...: an `@` in the path, no password
            read = parts.password
        else:
            read, written = make_url(uri).password, unquote(written)
    except (ValueError, ArgumentError):  # no URL the driver takes at all: its own check says so
        return None
    if read == written:
        return None
    odd = [c for c in "@/?#" if c in written]
    said = " and ".join(repr(c) for c in odd) or "a character"
    encoded = f" ({', '.join(f'{c} as %{ord(c):02X}' for c in odd)})" if odd else ""
    return (f"the password in {redact(uri)} holds {said}, where the driver ends the password; allowed: "
            f"the password percent-encoded{encoded}, or given through the environment (docs/distributed.md, Passwords)")


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
