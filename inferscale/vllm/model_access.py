"""The engine's own model, handed to the connector's worker half (a vLLM worker extension).

A plan that recomputes positions inside the memory (`heads:N`) needs the model vLLM loaded: the
connector computes those positions with it before the forward pass (`inferscale.vllm.recompute`),
with no second copy of the weights. vLLM's documented way to run code of ours on its workers is
`worker_extension_cls`: the class is mixed into every worker, and `collective_rpc(name)` calls
its method there. `MemoryLLM` and `inferscale serve` start vLLM with

    worker_extension_cls="inferscale.vllm.model_access.ModelAccess"

and call `collective_rpc("inferscale_attach_model")` once the engine is up. A stock `vllm serve`
pod started with `--worker-extension-cls inferscale.vllm.model_access.ModelAccess` is attached the
same way through its `/collective_rpc` route, which vLLM serves in its development mode only
(`VLLM_SERVER_DEV_MODE=1`); without it such a pod injects recompute plans plainly and logs why.
"""

from __future__ import annotations

EXTENSION = "inferscale.vllm.model_access.ModelAccess"
ATTACH = "inferscale_attach_model"


class ModelAccess:
    """Mixed into vLLM's worker class (`self` is the worker)."""

    def inferscale_attach_model(self) -> str:
        """Hand this worker's model to its InferScale connector. Returns "" when recompute plans
        will be computed, else the reason they will be injected plainly."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return "the engine runs no KV connector"
        attach = getattr(get_kv_transfer_group(), "attach_model", None)
        if attach is None:
            return "the engine's KV connector is not InferScale's"
        return attach(self.model_runner.get_model())


def attach_reasons(results) -> str:
    """One line from `collective_rpc`'s per-worker answers: "" when every worker computes
    recompute plans."""
    return "; ".join(sorted({r for r in results or () if r}))
