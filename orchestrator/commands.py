"""Command lines the product prints for the user to run next (rerun the best, resume a run).

They start with the interpreter that is running now (the venv's), not a bare `python` that may
lack the project's dependencies, and are quoted for a POSIX shell.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Iterable

from .stores import redact


def python() -> str:
    """This interpreter, relative to the working directory when it lives below it (.venv/bin/python)."""
    exe = sys.executable or "python"
    try:
        rel = os.path.relpath(exe)
    except ValueError:
        return exe
    return rel if not rel.startswith("..") else exe


def orchestrator_command(args: Iterable[str]) -> str:
    """`<python> -m orchestrator ARGS`, shell-quoted, URL passwords masked (docs/distributed.md, "Passwords": pass
    them through the environment, and the line runs as printed)."""
    return redact(" ".join([shlex.quote(python()), "-m", "orchestrator", *map(shlex.quote, args)]))
