"""No import cycle between modules of ``adahop`` (module-level imports, read with ``ast``).

A cycle makes the import order decide what works. Imports inside functions (deferred on purpose,
to keep Triton or the trainer out of a light import) are left out. A name a package's
``__init__`` only re-exports counts as imported from where it is defined: ``from .kernels import
fold_to_fp8`` is an edge to ``adahop.kernels.fold``, not through ``adahop.kernels``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import adahop

ROOT = Path(adahop.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: top level, and inside top-level ``if``/``try``
    blocks, but not under ``if TYPE_CHECKING:``."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the adahop modules it imports at module level."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    imports = {m: _module_level_imports(ast.parse(p.read_text(), str(p))) for m, p in paths.items()}
    # Per package, the names its __init__ re-exports -> the module that defines them.
    reexports: dict[str, dict[str, str]] = {}
    for module, nodes in imports.items():
        if paths[module].name == "__init__.py":
            reexports[module] = {
                alias.asname or alias.name: _resolve(module, True, node.level, node.module)
                for node in nodes
                if isinstance(node, ast.ImportFrom) and node.level > 0
                for alias in node.names
            }
    graph = {}
    for module, nodes in imports.items():
        edges = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(module, paths[module].name == "__init__.py", node.level, node.module)
                # ``from package import submodule`` imports the submodule; a re-exported name, the
                # module that defines it; any other name is the package's own.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else reexports.get(base, {}).get(a.name, base)
                    for a in node.names
                ]
            edges |= {t for t in targets if t in paths and t != module}
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_resolve_relative_imports():
    assert _resolve("adahop.kernels.quantize", False, 1, "launch") == "adahop.kernels.launch"
    assert _resolve("adahop.kernels.quantize", False, 2, "formats.mx") == "adahop.formats.mx"
    assert _resolve("adahop.kernels", True, 1, "fold") == "adahop.kernels.fold"
    assert _resolve("adahop.kernels", True, 2, None) == "adahop"


def test_graph_sees_the_package():
    graph = import_graph()
    assert "adahop.kernels.launch" in graph["adahop.kernels.quantize"]
    assert "adahop.kernels.quantize" in graph["adahop.kernels"]  # the __init__'s own imports
    # adahop.kernels.fold imports MXTensor from adahop.formats, which re-exports it from formats.mx.
    assert "adahop.formats.mx" in graph["adahop.kernels.fold"]
    assert "adahop.formats" not in graph["adahop.kernels.fold"]


def test_adahop_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
