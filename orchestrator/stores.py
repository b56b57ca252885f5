"""Database URLs shared by MLflow and Optuna, and the file locks that make their first use safe
when several processes start together.

SQLite has no server to arbitrate schema creation: two processes opening a fresh file both try
to create the tables and one fails ("table ... already exists"). A lock file beside the
database serializes that first use (and the tuner's "count trials, then ask") between the
processes of one machine; server databases arbitrate themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator, Optional

SQLITE = "sqlite:///"


def resolve_uri(uri: str) -> str:
    """Relative SQLite paths are relative to the working directory; make them absolute so ranks,
    subprocesses and the UI agree."""
    if uri.startswith(SQLITE) and not uri.startswith(SQLITE + "/"):
        return SQLITE + str(Path(uri[len(SQLITE):]).resolve())
    return uri


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
def sqlite_lock(uri: str, name: str = "") -> Iterator[None]:
    """Lock `<db>.lock` (or `<db>.<name>.lock`) for a SQLite URL; a no-op for other URLs."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    with file_lock(db.with_name(db.name + (f".{name}" if name else "") + ".lock")):
        yield
