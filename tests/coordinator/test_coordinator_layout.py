"""The coordinator's shape, checked: no per-request state in hidden channels (contextvars, mutable
module globals) and no function too long to read at once."""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import logging
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "coordinator"
MODULES = sorted(ROOT.rglob("*.py"))
MAX_FUNCTION_LINES = 50


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_contextvars_and_no_long_functions(path: Path):
    tree = ast.parse(path.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "contextvars" not in imported, "per-request state travels in RequestContext, not in contextvars"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def is_immutable(value) -> bool:
    if isinstance(value, (int, float, str, bytes, bool, type(None), range, re.Pattern, frozenset,
                          types.MappingProxyType, types.GenericAlias, types.UnionType, enum.Enum)):
        return True
    if isinstance(value, tuple):
        return all(is_immutable(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__dataclass_params__.frozen
    return isinstance(value, logging.Logger)  # a module's logger: configuration, not request state


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_mutable_module_state(path: Path):
    """What a module defines at its top level is code or a constant: nothing that one request could
    change and another read."""
    module = importlib.import_module(module_name(path))
    tree = ast.parse(path.read_text())
    names = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name)}
    mutable = sorted(n for n in names - {"__all__"} if not is_immutable(getattr(module, n)))
    assert not mutable, f"mutable module-level state: {mutable}"
