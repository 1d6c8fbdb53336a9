"""InferScale's vLLM V1 KV connector: inject each request's memory KV, rotated at injection time.

Configured through `kv_transfer_config`:

    {"kv_connector": "InferScaleConnector",
     "kv_connector_module_path": "inferscale.vllm.connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"memory_root": "/path/to/memory",
                                   "model_fingerprint": "<optional: skips hashing the weights>",
                                   "kv_store": "<optional: redis://... the shared KV tier>"}}

The extra config is `inferscale.config.ConnectorConfig` (`to_extra` / `from_extra`): every key
is validated when the connector is built, an unknown one is refused by name. The names are those
of `MemoryLLMConfig` and `inferscale serve` (`kv_load`, `kv_load_cpus`, `kv_write_threads`,
`kv_write`, `device_cache_bytes`); earlier releases' `load`, `load_cpus`, `write_threads` and
`paged_write` are still read.

Users' KV (and the prompt header's) is read from `<memory_root>` or, with `kv_store`, from the
Redis tier every replica shares (`inferscale.common.storage.redis_store`), so a stock `vllm serve` loaded
with this connector serves what any InferScale gateway or replica wrote.

vLLM builds one instance per role, and this class is a role switch, as vLLM's own offloading
connector is: the scheduler role's hooks run in `ConnectorScheduler` (`connector_scheduler.py`), the
worker role's in `ConnectorWorker` (`connector_worker.py`). Hook contracts, as this connector keeps them:

Scheduler side (EngineCore process, called by the scheduler once per scheduling step):
- `get_num_new_matched_tokens(request, num_computed_tokens)`: reads the request's `MemoryPlan`
  from `kv_transfer_params`, checks its signature (an HMAC over the plan and the prompt's token
  ids with the secret the composer signs with, `common.prompt.plan_signing`: an unsigned, forged or
  replayed plan injects nothing), checks it against the prompt (every segment's stored tokens must
  equal the prompt's tokens at its positions, >= 1 prompt token left to compute, positions inside
  the model's context, the store written for this model) and returns the plan's tokens beyond
  `num_computed_tokens` (whatever vLLM's own prefix cache already holds is never reloaded). Any
  failed check returns 0: the request is prefilled normally, and the reason is logged. Loads are
  synchronous (`False`), so `start_load_kv` runs before the forward pass that needs them.
- `update_state_after_alloc(request, blocks, n)`: records the request's block ids for the load.
- `build_connector_meta(scheduler_output)`: hands the loads recorded since the last step to the
  workers (picklable) and forgets them.
- `request_finished(request, block_ids)`: drops any state of the request; blocks are freed by
  vLLM as usual (returns `(False, None)`).

Worker side (each worker process, called by the model runner around every forward pass):
- `register_kv_caches(kv_caches)`: keeps the per-layer cache tensors (layout left to the backend);
  on CPU compiles the Numba kernels (`cpu_kernels.warm_up`: a few seconds once, then Numba's disk
  cache), so the first request does not pay for it.
- `start_load_kv(forward_context)`: for each load: pre-RoPE K and V from the device tier (fact KV
  kept as tensors in the GPU's memory, `device_cache_bytes`, 2 GiB by default on CUDA, off on
  CPU), else a host-memory LRU (`host_cache_bytes`) in front of the user's store (local or shared), kept as the store keeps them (int8 / fp8 codes
  with scales, or floats), and written into the request's slots by one of two load pipelines
  (`kernels/load_pipeline.py`, one per backend, each dequantise -> rotate -> write): on a GPU
  `kernels/backend_pipeline.py`, dequantised and rotated to their serving positions layer by layer
  (`compact.layer_kv`: Triton on CUDA, Numba on CPU, `cpu_kernels.py`), then written with the
  attention backend's own `do_kv_cache_update`. On CPU the
  connector learns, once per kind of layer, where the backend's write puts each element of a
  block (`paged_write.learn_layout`: numbered K/V written into a scratch cache, then a random write
  both ways compared bit for bit; float32 and bfloat16 caches), and a Numba kernel reads the facts
  as the host tier keeps them and writes every layer's slots directly in that layout, whole blocks
  in streaming stores (`kernels/cpu_pipeline.py`; extra config `"kv_write"`: `"plain"` for plain
  stores, `"backend"` keeps the backend's write). A load that fails
  reports its blocks through `get_block_ids_with_load_errors`, so vLLM recomputes them
  (`kv_load_failure_policy="recompute"`); nothing partial is served as memory.
- `get_kv_connector_stats()`: the worker's counters since the last call (injected tokens, failed
  loads, host-tier hits / misses / evictions / bytes, store reads), which vLLM hands to the stat
  loggers (`connector_stats.py`); the server's `/metrics` shows them.
- with `"kv_load": "layerwise"` in the extra config, `start_load_kv` only reads each load's KV (and
  builds its slots and RoPE tables), and `wait_for_layer_load(layer)`, which vLLM calls before each
  attention layer runs, writes that layer: on a GPU the copies of later layers can then overlap the
  earlier layers' compute. With `"kv_load": "background"` (CPU caches; elsewhere it acts as
  layerwise), `start_load_kv` also hands every layer's write, in layer order, to a writer thread
  bound to the CPUs the forward pass does not use (`"kv_load_cpus"`: "auto" or a list of CPU ids;
  `write_threads.py`), and `wait_for_layer_load(layer)` waits for that layer's. `wait_for_save`
  (after the forward pass) waits for the writer to finish and fails any load with layers left
  unwritten or not waited for, so vLLM recomputes it. The default, `"sync"`, writes every layer
  in `start_load_kv` and is the reference the other two are tested against (same tokens and
  logprobs).
- A write of several layers straight into the paged cache is split over `"kv_write_threads"`
  threads (default: torch's intra-op threads, the cores vLLM's CPU worker computes on, idle while
  the connector writes; the helpers bound to the team's other cores; `write_threads.py`): disjoint
  layers, the same bytes.
- a plan with `recompute` runs (`heads:N`) is loaded in `start_load_kv` whatever the load mode:
  injected, then its recomputed positions are computed with the engine's own model, layer by
  layer, each attending to everything before it, and written over the injected ones
  (`recompute.py`; the model is handed over by the worker extension `model_access.ModelAccess`,
  `attach_model`). Without it, or for a model the path does not cover, the memory is injected
  plainly and the reason logged; a plan whose runs are malformed is injected plainly by the
  scheduler half.
- `shutdown()`: stops the writer threads.
- `save_kv_layer`: a no-op (this connector never saves vLLM's KV).

Injected KV is approximate and per user, so it must never be served as exact prefix-cache content
to someone else: `MemoryLLM` salts every memory request's prefix cache with (user, memory version)
(`cache_salt`), and vLLM's block hashes include the salt.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inferscale.common.model.spec import ModelSpec, model_fingerprint
from inferscale.common.storage.backends import open_kv
from inferscale.config import ConnectorConfig
from inferscale.vllm.connector_metadata import InferScaleMetadata, Load
from inferscale.common.prompt.plan_signing import load_secret, secret_path
from inferscale.vllm.connector_scheduler import ConnectorScheduler
from inferscale.vllm.connector_stats import InferScaleStats
from inferscale.vllm.connector_worker import ConnectorWorker
from inferscale.vllm.plan_stores import PlanStores

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["InferScaleConnector", "InferScaleMetadata", "Load"]


class InferScaleConnector(KVConnectorBase_V1):
    """vLLM's entry point (`kv_connector_module_path`): a role switch over the two halves."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        from inferscale.vllm.lifetime import die_with_parent  # built in the engine-core and worker processes:

        die_with_parent(self.config.parent_pid)  # they must not outlive a killed server
        self.root = Path(self.config.memory_root)
        model_dir = vllm_config.model_config.model
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.fingerprint = self.config.model_fingerprint or model_fingerprint(model_dir, self.spec)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        # users' KV in the shared Redis tier (every replica reads what any wrote), else under memory_root
        self.stores = PlanStores(open_kv(self.config.kv_store, self.root), self.spec, self.fingerprint)
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:  # only plans signed with the gateway's secret are injected
            secret = load_secret(secret_path(self.config.memory_root, self.config.plan_secret_file))
            self.scheduler = ConnectorScheduler(self.stores, self.max_model_len, secret)
        else:
            self.worker = ConnectorWorker(self.config, self.spec, self.stores, self.block_size, self.max_model_len,
                                          vllm_config)

    @property
    def stats(self) -> dict[str, int]:
        """This role's counters (scheduler: refused plans; worker: injected tokens, loads, reads)."""
        return (self.scheduler or self.worker).stats

    # -- scheduler role --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def pending_requests(self) -> int:
        """Requests with connector state (0 after every request has finished)."""
        return self.scheduler.pending_requests() if self.scheduler is not None else 0

    # -- worker role -----------------------------------------------------------------------------
    def attach_model(self, model: torch.nn.Module) -> str:
        """vLLM's loaded model, for plans that recompute inside the memory (`model_access`):
        "" when they are computed, else why they are injected plainly."""
        return self.worker.attach_model(model) if self.worker is not None else "not the worker's connector"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # this connector never saves vLLM's KV

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> InferScaleStats | None:
        return self.worker.get_kv_connector_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> InferScaleStats:
        return InferScaleStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
