"""`import inferscale` (and its common package) works where jax, torch and vllm cannot be imported."""

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"jax", "jaxlib", "flax", "torch", "vllm", "transformers", "orbax"}:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import inferscale, inferscale.common.spec, inferscale.common.rope_tables, inferscale.common.layout
import inferscale.common.storage.format, inferscale.common.facts, inferscale.evaluation.datasets, inferscale.retrieval.vector_index
import inferscale.memory.service, inferscale.common.storage.tiers, inferscale.common.plan, inferscale.encoders
import inferscale.common.storage.backends, inferscale.common.storage.redis_store, inferscale.common.storage.paths, inferscale.common.storage.catalog
import inferscale.jax, inferscale.vllm, inferscale.default_model, inferscale.cli
assert not any(m.split(".")[0] in {"jax", "torch", "vllm"} for m in sys.modules), sorted(sys.modules)
print("ok", inferscale.__version__)
"""


def test_import_without_engines():
    out = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def _imports(path, prefix="inferscale."):
    """Every module under `prefix` a source file imports (at any level: lazy imports count)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith(prefix)}


def test_packages_do_not_import_each_other_in_a_cycle():
    """common imports no other inferscale package (and no engine: see test_import_without_engines);
    the encoders build on common only; memory never imports vllm (vllm builds on memory); the
    connector reads storage through common only."""
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / "inferscale"
    for sub, banned in (("common", ("inferscale.memory", "inferscale.vllm", "inferscale.jax", "inferscale.server",
                                    "inferscale.encoders")),
                        ("encoders", ("inferscale.memory", "inferscale.vllm", "inferscale.jax", "inferscale.server")),
                        ("memory", ("inferscale.vllm", "inferscale.jax", "inferscale.server"))):
        for f in (pkg / sub).rglob("*.py"):
            bad = [m for m in _imports(f) if m.startswith(banned)]
            assert not bad, f"{f.relative_to(pkg)} imports {bad}"
    assert not [m for m in _imports(pkg / "vllm" / "connector.py") if m.startswith("inferscale.memory")]
    for f in (pkg / "common").rglob("*.py"):  # common is what every side imports: no engine in it
        engines = [m for m in _imports(f, prefix="") if m.split(".")[0] in {"torch", "jax", "flax", "vllm"}]
        assert not engines, f"{f.relative_to(pkg)} imports {engines}"
