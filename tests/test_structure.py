"""The house's shape: packages import each other in one direction (no cycle between rooms or
between modules), `common` stays engine-free, and the deprecated aliases point where they say."""

import ast
import importlib
import warnings
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "inferscale"
# deprecated aliases of moved modules, kept for one release: each re-exports its new home
ALIASES = {"inferscale.common.store": "inferscale.common.storage.local_store",
           "inferscale.common.memory": "inferscale.common.facts",
           "inferscale.common.datasets": "inferscale.evaluation.datasets",
           "inferscale.memory.embedding": "inferscale.retrieval.embedders",
           "inferscale.vllm.llm": "inferscale.serving.memory_llm"}


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """The package a module lives in (`inferscale.common.storage.x` -> `common`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _runtime_imports(path: Path) -> set[str]:
    """Modules of the project a file imports when it runs (lazy imports count; imports under
    `if TYPE_CHECKING:` do not)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    modules = {_module(f) for f in PKG.rglob("*.py")}
    return {m for m in out if m in modules}


def _graph() -> dict[str, set[str]]:
    return {_module(f): _runtime_imports(f) for f in PKG.rglob("*.py") if _module(f) not in ALIASES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_between_modules():
    graph = _graph()
    for n in graph:  # a package's __init__ importing its own submodules is not a cycle of rooms
        graph[n] = {m for m in graph[n] if not n.startswith(m + ".") and not m.startswith(n + ".")}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_no_import_cycle_between_packages():
    rooms: dict[str, set[str]] = {}
    for n, deps in _graph().items():
        rooms.setdefault(_room(n), set()).update(_room(m) for m in deps if _room(m) != _room(n))
    assert _cycle(rooms) is None, f"packages import each other: {' -> '.join(_cycle(rooms))}"


@pytest.mark.parametrize("room, banned", [
    ("common", {"memory", "vllm", "jax", "server", "encoders", "retrieval", "evaluation", "serving", "config"}),
    ("encoders", {"memory", "vllm", "jax", "server", "serving"}),
    ("retrieval", {"memory", "vllm", "jax", "server", "serving", "encoders"}),
    ("memory", {"vllm", "jax", "server", "serving"}),
    ("vllm", {"memory", "jax", "server", "serving", "retrieval", "evaluation"}),
    ("config", {"vllm", "jax", "server", "serving", "memory"}),
])
def test_packages_build_on_lower_ones_only(room, banned):
    """common is what every side imports; the connector (vllm) reads storage through common only."""
    for n, deps in _graph().items():
        if _room(n) == room:
            bad = sorted(m for m in deps if _room(m) in banned)
            assert not bad, f"{n} imports {bad}"


def test_common_imports_no_engine():
    for f in (PKG / "common").rglob("*.py"):
        tree = ast.parse(f.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        engines = sorted(m for m in names if m.split(".")[0] in {"torch", "jax", "flax", "vllm"})
        assert not engines, f"{f.relative_to(PKG)} imports {engines}"


def test_no_two_modules_share_a_name():
    """Outside `__init__`, the deprecated aliases and the family modules, a file name says what
    it holds once."""
    seen: dict[str, Path] = {}
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "__init__.py" or _module(f) in ALIASES:
            continue
        assert f.name not in seen, f"{f.relative_to(PKG)} and {seen[f.name].relative_to(PKG)}"
        seen[f.name] = f


@pytest.mark.parametrize("old, new", sorted(ALIASES.items()))
def test_deprecated_aliases_reexport_the_moved_names(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import sys

        sys.modules.pop(old, None)
        alias = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught)
    moved = importlib.import_module(new)
    public = [n for n in vars(moved) if not n.startswith("_") and getattr(vars(moved)[n], "__module__", None) == new]
    public = getattr(moved, "__all__", public)
    assert public
    for name in public:
        assert getattr(alias, name) is getattr(moved, name), name
