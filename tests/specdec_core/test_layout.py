"""The import rules of specdec_core/__init__.py, read from the source with `ast` (imports inside
functions count too): no import cycle among specdec_core's modules; the top-level modules import
only each other; the engine imports neither serving nor the generated protos; serving imports the
engine only in `wire` and `kvstore`; specdec_core imports no service; and the workers import
neither each other nor the coordinator."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "draft_service", "target_service", "openai_gateway")
SERVING_INTO_ENGINE = {"specdec_core.serving.wire", "specdec_core.serving.kvstore"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the module `module`) imports, anywhere in it: `from a.b import c`
    counts as a.b.c when that is a module of this repository, else as a.b."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if _is_module(full) else base)
    return names


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph(package: str) -> dict[str, set[str]]:
    """module -> the modules it imports, for every module under `package`."""
    return {module_name(p): imported(p.read_text(), module_name(p), p.name == "__init__.py")
            for p in sorted((ROOT / package).rglob("*.py"))}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle among the keys of `edges` (as the path that closes it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, set()) & edges.keys()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_specdec_core_has_no_import_cycle():
    assert find_cycle(graph("specdec_core")) is None


def test_the_cycle_check_sees_imports_inside_functions():
    """The circle the kernels once closed (cpu_kernels importing the models module inside a function)
    is found again if it comes back."""
    late = imported("def library():\n    from specdec_core.engine.models import load_causal_lm\n",
                    "specdec_core.engine.cpu_kernels")
    assert late == {"specdec_core.engine.models"}
    edges = graph("specdec_core")
    edges["specdec_core.engine.cpu_kernels"] |= late
    assert find_cycle(edges) is not None


def test_the_top_level_modules_import_only_each_other():
    for module, names in graph("specdec_core").items():
        if module.count(".") == 1:
            assert not {n for n in names if under(n, "specdec_core.engine", "specdec_core.serving")}, module


def test_the_engine_imports_neither_serving_nor_the_protos():
    for module, names in graph("specdec_core").items():
        if under(module, "specdec_core.engine"):
            assert not {n for n in names if under(n, "specdec_core.serving", "specdec")}, module


def test_serving_imports_the_engine_only_to_carry_its_data_out():
    for module, names in graph("specdec_core").items():
        if under(module, "specdec_core.serving") and module not in SERVING_INTO_ENGINE:
            assert not {n for n in names if under(n, "specdec_core.engine")}, module


def test_specdec_core_imports_no_service():
    for module, names in graph("specdec_core").items():
        assert not {n for n in names if under(n, *SERVICES)}, module


def test_the_workers_import_neither_each_other_nor_the_coordinator():
    for worker, others in (("draft_service", ("target_service", "coordinator")),
                           ("target_service", ("draft_service", "coordinator"))):
        for module, names in graph(worker).items():
            assert not {n for n in names if under(n, *others)}, module
