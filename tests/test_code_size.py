"""The house rule on size (issue 55): no class in orchestrator/ over 300 lines, no function over 60.
A class that outgrows it holds two jobs; split it by meaning (runtime/meter.py's samplers, window
figures and summary live in their own modules)."""

from __future__ import annotations

import ast
from typing import List

from .conftest import ROOT

MAX_CLASS, MAX_FUNCTION = 300, 60


def _too_long(kinds: tuple, limit: int) -> List[str]:
    out = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_class_in_orchestrator_is_over_300_lines():
    assert not _too_long((ast.ClassDef,), MAX_CLASS)


def test_no_function_in_orchestrator_is_over_60_lines():
    assert not _too_long((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION)
