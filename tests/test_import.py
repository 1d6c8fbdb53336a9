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
import inferscale, inferscale.common.model.spec, inferscale.common.model.rope_tables, inferscale.common.prompt.layout
import inferscale.common.storage.format, inferscale.common.facts, inferscale.evaluation.datasets, inferscale.retrieval.vector_index
import inferscale.memory.service, inferscale.common.storage.tiers, inferscale.common.prompt.plan, inferscale.encoders
import inferscale.common.storage.backends, inferscale.common.storage.redis_store, inferscale.common.storage.paths, inferscale.common.storage.catalog
import inferscale.common.storage.protocols
import inferscale.jax, inferscale.vllm, inferscale.default_model, inferscale.cli
assert not any(m.split(".")[0] in {"jax", "torch", "vllm"} for m in sys.modules), sorted(sys.modules)
print("ok", inferscale.__version__)
"""


def test_import_without_engines():
    out = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
