"""The house's shape: packages import each other in one direction (no cycle between rooms or
between modules), `common` stays engine-free, no module is an alias of another, and every Python
name the README and docs/ show is where they say."""

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "inferscale"


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
    return {_module(f): _runtime_imports(f) for f in PKG.rglob("*.py")}


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
    ("common", {"memory", "vllm", "jax", "server", "encoders", "retrieval", "evaluation", "serving", "config", "gate"}),
    ("encoders", {"memory", "vllm", "jax", "server", "serving"}),
    ("retrieval", {"memory", "vllm", "jax", "server", "serving", "encoders"}),
    ("memory", {"vllm", "jax", "server", "serving"}),
    ("vllm", {"memory", "jax", "server", "serving", "retrieval", "evaluation", "gate"}),
    ("config", {"vllm", "jax", "server", "serving", "memory"}),
    ("gate", {"memory", "vllm", "jax", "server", "encoders", "retrieval", "evaluation", "serving"}),
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
    """Outside `__init__`, a file name says what it holds once."""
    seen: dict[str, Path] = {}
    for f in sorted(PKG.rglob("*.py")):
        if f.name == "__init__.py":
            continue
        assert f.name not in seen, f"{f.relative_to(PKG)} and {seen[f.name].relative_to(PKG)}"
        seen[f.name] = f


def _is_alias(tree: ast.Module) -> bool:
    """A module that only re-exports others: besides its docstring, nothing but imports (a star
    import among them) and a warning, or any module that warns it is deprecated."""
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    warns = [n for n in body if isinstance(n, ast.Expr) and "warn" in ast.unparse(n.value)]
    if any("DeprecationWarning" in ast.unparse(n) for n in warns):
        return True
    rest = [n for n in body if n not in warns]
    return bool(rest) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in rest) and any(
        isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in rest)


def test_no_alias_modules():
    """Every module is the one home of what it holds: no deprecated alias re-exports a moved one
    (the public paths are the ones the docs show, `test_documented_python_names_exist`)."""
    aliases = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
                     if f.name != "__init__.py" and _is_alias(ast.parse(f.read_text())))
    assert not aliases, f"alias modules: {aliases}"


def test_alias_detector():
    assert _is_alias(ast.parse('"""x"""\nimport warnings\nfrom a import *\nwarnings.warn("moved", DeprecationWarning)\n'))
    assert _is_alias(ast.parse("from a.b import *  # noqa\n"))
    assert not _is_alias(ast.parse("from a import b\n\ndef f():\n    return b\n"))


def _defines(path: Path, dotted: list[str]) -> bool:
    """Whether the module at `path` binds `dotted[0]` at its top level (a def, class, assignment or
    import) and, for `Class.attr`, the class binds `attr`."""
    body = ast.parse(path.read_text()).body
    for name in dotted:
        found = None
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
                found = n
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = n
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name.split(".")[0]) == name for a in n.names):
                    found = n
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def _resolves(dotted: str) -> bool:
    """`inferscale.a.b[.Name[.attr]]`: the longest prefix that is a module of the package, and the
    rest bound in it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if path.exists():
            return i == len(parts) or _defines(path, parts[i:])
    return False


def _documented_names() -> list[tuple[str, str]]:
    """(file, dotted name) for every `from inferscale.x import A, B` and `inferscale.x.y` the README
    and docs/ show."""
    out = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = md.read_text(encoding="utf-8")
        where = str(md.relative_to(ROOT))
        for module, names in re.findall(r"from (inferscale[\w.]*) import ([\w, ]+)", text):
            out += [(where, f"{module}.{n.strip()}") for n in names.split(",") if n.strip()]
        out += [(where, m.rstrip(".")) for m in re.findall(r"(?<![\w/])inferscale(?:\.\w+)+", text)]
    return sorted(set(out))


def test_documented_python_names_exist():
    """The public Python paths are the documented ones; each still imports (read from the source,
    so no engine is started)."""
    names = _documented_names()
    assert ("README.md", "inferscale.serving.memory_llm.MemoryLLM") in names
    assert any(n == "inferscale.vllm.connector" for _, n in names)  # the --kv-transfer-config module path
    missing = [f"{where}: {name}" for where, name in names if not _resolves(name)]
    assert not missing, f"documented names that do not exist: {missing}"
    assert not _resolves("inferscale.serving.memory_llm.NoSuchName")


# Classes that share a name but not a meaning, each in its own room (module -> what it is). Any
# other repeated class name fails: one meaning has one class (one `UnknownFactError`, defined in
# common.storage.format; the plan's `PlanSegment` beside the layout's `Segment`).
SAME_NAME_OTHER_MEANING = {
    "Turn": {"inferscale.common.facts": "one utterance of a conversation",
             "inferscale.chat_demo": "one answered turn of the demo's chat, with its timings"},
    "Decision": {"inferscale.gate.calibration": "the quality gate's choice of mode and recovery policy at a k",
                 "inferscale.memory.extraction": "what extraction does with one candidate fact (ADD, UPDATE, ...)"},
    "Verdict": {"inferscale.gate.noninferiority": "a non-inferiority test's outcome for one method",
                "inferscale.evaluation.judge": "an LLM judge's label for one answer"},
}


def _classes() -> dict[str, set[str]]:
    """class name -> the modules that define a class of that name (nested classes included)."""
    out: dict[str, set[str]] = {}
    for f in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ClassDef):
                out.setdefault(n.name, set()).add(_module(f))
    return out


def test_no_two_classes_share_a_name():
    classes = _classes()
    repeated = {name: sorted(mods) for name, mods in classes.items() if len(mods) > 1}
    unexplained = {name: mods for name, mods in repeated.items() if set(mods) != set(SAME_NAME_OTHER_MEANING.get(name, ()))}
    assert not unexplained, f"one class name per meaning: {unexplained}"
    stale = sorted(set(SAME_NAME_OTHER_MEANING) - set(repeated))
    assert not stale, f"no longer repeated, drop from SAME_NAME_OTHER_MEANING: {stale}"
    # nor is a class known by another's name: the plan's segment is PlanSegment only
    assert _resolves("inferscale.common.prompt.plan.PlanSegment") and not _resolves("inferscale.common.prompt.plan.Segment")


def test_one_unknown_fact_error():
    """The store's and the memory service's are one class, so a caller catching either catches both."""
    from inferscale.common.storage.format import StoreError, UnknownFactError
    from inferscale.memory.service_types import UnknownFactError as ServiceUnknownFactError

    assert ServiceUnknownFactError is UnknownFactError
    assert issubclass(UnknownFactError, KeyError) and issubclass(UnknownFactError, StoreError)
    assert str(UnknownFactError("user 'a' has no fact 'x'")) == "user 'a' has no fact 'x'"


def test_no_module_over_400_lines():
    """One concept per file: a module a newcomer reads in one sitting."""
    long = {str(f.relative_to(ROOT)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > 400}
    assert not long, f"split these by concept: {long}"


def test_one_request_type():
    """The server and `MemoryLLM` build the same `MemoryRequest` and run the same `prepare`."""
    from inferscale.serving import memory_llm, prepare, request

    assert memory_llm.MemoryRequest is request.MemoryRequest and memory_llm.Prepared is request.Prepared
    names = {n.name for f in (PKG / "serving").glob("*.py") for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.ClassDef) and n.name.endswith("Request")}
    assert names == {"MemoryRequest"}, names
    assert "def prepare(" in (PKG / "serving" / "prepare.py").read_text() and prepare.prepare
    server = "".join(f.read_text() for f in (PKG / "server").glob("*.py"))
    assert "MemoryRequest(" in server and "build_request" not in server


def test_the_memory_service_and_the_catalog_are_composed_of_parts():
    """No size mixins: the memory service and the catalog inherit from nothing of ours; each part
    takes what it uses in its constructor (a part never reads an attribute it was not given)."""
    from inferscale.common.storage import catalog, catalog_facts, catalog_rows
    from inferscale.memory import encoding, portability, reads, service, turn_edits, writes

    assert service.MemoryService.__bases__ == (object,) and catalog.Catalog.__bases__ == (object,)
    parts = [reads.MemoryReads, writes.MemoryWrites, turn_edits.TurnEdits, portability.Portability,
             encoding.FactEncoding, catalog_rows.UserTable, catalog_rows.JobTable, catalog_rows.TurnTable,
             catalog_facts.FactTable, catalog_facts.HistoryTable]
    for part in parts:
        assert part.__bases__ == (object,), part
        tree = ast.parse(inspect.getsource(part))
        given = {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in _targets(n)}
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        own |= {t.id for n in tree.body[0].body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in ([n.target] if isinstance(n, ast.AnnAssign) else n.targets) if isinstance(t, ast.Name)}
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        assert used <= given | own, f"{part.__name__} uses {sorted(used - given - own)} it was never given"


def _targets(assign: ast.Assign):
    """The `self.x` attributes an assignment sets (tuples included)."""
    for t in assign.targets:
        for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                yield e
