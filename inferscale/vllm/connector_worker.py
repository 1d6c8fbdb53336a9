"""The connector's worker half: tiers, reads, rotation and writes into vLLM's paged KV cache.

Built by `InferScaleConnector` in each worker process (role WORKER); the hooks it serves and their
contracts are listed in `inferscale.vllm.connector`. A load's KV comes from the device tier, else
the host tier (`HostTier`: both keep KV as stored, int8 / fp8 codes with their scales), else the
user's store (`PlanStores`); it is dequantised and rotated to its serving positions and written
into the request's slots by one of two load pipelines, chosen per load (`kernels/load_pipeline.py`):
straight into the paged cache in the layout learned from the backend's own write on CPU
(`kernels/cpu_pipeline.py`), else through the backend's write (`kernels/backend_pipeline.py`).
A plan with `recompute` runs is loaded in `start_load_kv` whatever the load mode: injected, then
its recomputed positions computed with the engine's model and written over (`recompute.py`);
without an attached model (`attach_model`) it is injected plainly and the reason logged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale.common.model.spec import ModelSpec
from inferscale.common.storage.format import StoreError
from inferscale.common.storage.tiers import HostTier
from inferscale.config import ConnectorConfig
from inferscale.vllm.connector_metadata import InferScaleMetadata, Load, Staged
from inferscale.vllm.connector_stats import InferScaleStats, StatsDelta
from inferscale.vllm.kernels import cpu_kernels
from inferscale.vllm.kernels.backend_pipeline import BackendPipeline
from inferscale.vllm.kernels.chunked_rope import RopeTable
from inferscale.vllm.kernels.compact import LoadPart, gather, on_device
from inferscale.vllm.kernels.cpu_pipeline import CpuPagedPipeline
from inferscale.vllm.kernels.load_pipeline import LoadPipeline, StagedPart
from inferscale.vllm.cache_layouts import CacheLayouts, attention_layers, layer_index
from inferscale.vllm.kernels.cache_layout import PagedLayout, read_paged
from inferscale.vllm.kernels.paged_write import warm_up as warm_up_paged_write
from inferscale.vllm.write_threads import LayerWriter, free_cpus
from inferscale.common.prompt.plan import MemoryPlan
from inferscale.vllm.plan_stores import PlanStores
from inferscale.vllm.recompute import ModelRecompute, Unsupported, paged_writer, plan_kv

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

log = logging.getLogger("inferscale.connector")


class ConnectorWorker:
    """The worker role: KV caches registered, loads staged and written, counters for vLLM."""

    SWEEP_INTERVAL_S = 1.0

    def __init__(self, cfg: ConnectorConfig, spec: ModelSpec, stores: PlanStores, block_size: int,
                 max_model_len: int, vllm_config: "VllmConfig | None" = None) -> None:
        self.spec, self.stores, self.vllm_config = spec, stores, vllm_config
        self.block_size, self.max_model_len = block_size, max_model_len
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.host = HostTier(cfg.host_cache_bytes)
        # the hot tier in the cache's own memory (GPU): fact KV kept there as torch tensors, so a
        # hit is a device-to-device copy; default 2 GiB on CUDA. On CPU the host tier is that memory
        # already: off unless asked for (then it only keeps a torch copy of what the host tier holds)
        self._device_budget = cfg.device_cache_bytes
        self.device_tier: HostTier | None = None
        self._last_sweep = 0.0
        self._tables: list[RopeTable] | None = None  # per distinct RoPE setting, built on first load
        self._failed_blocks: set[int] = set()
        # "sync": every layer written in start_load_kv (the reference); "layerwise": the KV is read in
        # start_load_kv and each layer written in wait_for_layer_load, right before that layer's
        # attention; "background" (CPU caches): every layer's write handed to a writer thread in
        # start_load_kv, on the CPUs kv_load_cpus names ("auto": those the forward pass is not bound to)
        self.load_mode = cfg.kv_load
        self._load_cpus = cfg.kv_load_cpus
        self._writer: LayerWriter | None = None  # background: built at the first load
        self._staged: list[Staged] = []  # layerwise, background: loads read, with layers not written yet
        # CPU: write memory straight into the paged cache (`kernels/cpu_pipeline.py`) in the layout the
        # backend's own write gives ("auto": learned once per kind of layer, full blocks in streaming
        # stores; "plain": plain stores), or always through the backend's write ("backend")
        self.paged_write = cfg.kv_write
        self.layouts = CacheLayouts(spec, block_size)  # each kind of layer's, learned once
        # the two load pipelines (`_pipeline` picks one per load); the CPU kernel's writes of several
        # layers are split over kv_write_threads threads (None: torch's intra-op threads, the cores
        # vLLM's worker computes on, idle while the connector writes)
        self._paged = CpuPagedPipeline(spec, self.layouts, cfg.kv_write == "auto", cfg.kv_write_threads)
        self._backend = BackendPipeline(spec)
        self.stats = {"injected_tokens": 0, "failed_loads": 0, "store_reads": 0,
                      "paged_write_tokens": 0,  # of injected_tokens: written by the CPU kernel
                      "recomputed_tokens": 0,  # of injected_tokens: computed with the engine's model
                      "cached_prefix_tokens": 0,  # read from vLLM's prefix cache for a recompute, not computed
                      "plain_recompute_plans": 0}  # recompute plans injected plainly (no model attached)
        self.recompute: ModelRecompute | None = None
        self.recompute_off = ("no model attached: the engine was started without the worker extension "
                              "inferscale.vllm.model_access.ModelAccess, or it was not called")
        self._delta = StatsDelta()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if any(t.device.type == "cpu" for t in kv_caches.values()) and cpu_kernels.available():
            cpu_kernels.warm_up()
            warm_up_paged_write()
            # learn the caches' layouts now (25-100 ms per kind of layer) rather than in the first
            # request; layers whose caches are not bound yet are learned at their first load
            layers = attention_layers(self.vllm_config.compilation_config.static_forward_context)
            if layers and all(isinstance(getattr(x, "kv_cache", None), torch.Tensor) for x in layers.values()):
                self._paged_layouts(layers)

    def attach_model(self, model) -> str:
        """vLLM's loaded model (`model_access.ModelAccess`): recompute plans are computed with it.
        Returns "" or why they are injected plainly."""
        try:
            self.recompute = ModelRecompute(model, self.spec, self.max_model_len)
            self.recompute_off = ""
        except Unsupported as e:
            self.recompute, self.recompute_off = None, f"this model's recompute path is not supported: {e}"
            log.warning("recompute plans are injected plainly: %s", self.recompute_off)
        return self.recompute_off

    def _sweep_host_tier(self) -> None:
        """Drop cached KV whose key its store no longer holds (a fact deleted or re-encoded, a user
        deleted), so deleted memory does not stay in this process. Keys never repeat (they carry
        the user's incarnation and memory version), so this is hygiene, not correctness."""
        now = time.monotonic()
        if now - self._last_sweep < self.SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        tiers = [t for t in (self.host, self.device_tier) if t is not None]
        owners: dict[str, set[str]] = {}
        for tier in tiers:
            for owner, key in tier.keys():
                owners.setdefault(owner, set()).add(key)
        for owner, keys in owners.items():
            try:
                store = self.stores.open(owner)
                gone = store.missing(sorted(keys))  # one round trip for the shared tier
            except (FileNotFoundError, StoreError):
                gone = sorted(keys)
            for tier in tiers:
                tier.drop([(owner, k) for k in gone])

    def _device_tier(self, device) -> HostTier | None:
        if self.device_tier is None:
            budget = self._device_budget
            if budget is None:
                budget = 2 << 30 if device.type == "cuda" else 0
            if int(budget) > 0:
                self.device_tier = HostTier(int(budget))
        return self.device_tier

    def _kv(self, plan: MemoryPlan, first: int, end: int, device) -> list[LoadPart]:
        """Pre-RoPE K, V of plan positions [first, end) as their stores keep them, one part per
        stored dtype: from the device tier, else the host tier (both cache the compact form: int8 /
        fp8 codes with their scales), else the store."""
        pieces = []
        opened: dict[str, Any] = {}  # each store opened and checked once per load
        dev_tier = self._device_tier(device)
        for seg in plan.segments:
            if seg.end <= first or seg.start >= end:
                continue
            owner = plan.user if seg.store == "user" else "<shared>"
            f = dev_tier.get((owner, seg.key)) if dev_tier is not None else None
            if f is None:
                f = self.host.get((owner, seg.key))
                if f is None:
                    if seg.store not in opened:
                        opened[seg.store] = self.stores.checked(plan, seg.store)
                    (f,) = opened[seg.store].get_compact([seg.key])
                    self.stats["store_reads"] += 1
                    self.host.put((owner, seg.key), f)
                if dev_tier is not None:
                    f = on_device(f, device)
                    dev_tier.put((owner, seg.key), f)
            a, b = max(first, seg.start) - seg.start, min(end, seg.end) - seg.start
            pieces.append((f, a, b, seg.start + a))
        return gather(pieces)

    def start_load_kv(self, meta: KVConnectorMetadata | None, forward_context: "ForwardContext") -> None:
        if not isinstance(meta, InferScaleMetadata) or not meta.loads:
            return
        self._sweep_host_tier()
        layers = attention_layers(forward_context.no_compile_layers)
        for load in meta.loads:
            try:
                staged = self._stage(load, layers)
                if load.plan.recompute:  # injected, then the recomputed positions written over
                    self._write(staged, sorted(layers))
                    self._recompute(staged)
                    self._written(staged, list(staged.todo))
                elif self.load_mode == "sync":
                    self._write(staged, sorted(layers))
                    self._written(staged, list(staged.todo))
                else:
                    self._staged.append(staged)
            except Exception as e:  # noqa: BLE001 - any failure: let vLLM recompute these blocks
                self._fail(load, e)
        if self.load_mode == "background" and self._staged and self._staged[0].device.type == "cpu":
            if self._writer is None:
                self._writer = LayerWriter(free_cpus(self._load_cpus))
            staged = list(self._staged)
            for i in sorted(layers):  # in the order the forward pass asks for them
                self._writer.submit(i, lambda i=i: self._write_each(staged, i))

    def _recompute(self, staged: "Staged") -> None:
        """The plan's recomputed positions, computed with the engine's model over the plan's KV and
        written at their slots; without a model, the load stays plainly injected (a plan with gaps
        fails instead: vLLM computes its blocks). Below `load.first` vLLM's prefix cache holds the
        prompt already: where this cache's layout is known, its K / V are read from there and only
        the positions from `load.first` on are computed (a chat's conversation found in the cache
        is not computed again); else every recomputed position is computed, over the stored KV."""
        load, device = staged.load, staged.device
        if self.recompute is None:
            if load.plan.gaps():  # positions with no stored KV: vLLM computes the load's blocks instead
                raise RuntimeError(f"the plan recomputes positions with no stored KV: {self.recompute_off}")
            self.stats["plain_recompute_plans"] += 1
            log.warning("request %s: memory injected plainly, nothing recomputed: %s", load.req_id, self.recompute_off)
            return
        plan = load.plan
        every = plan.positions_to_recompute()
        cached = self.layouts.of(staged.layers) if load.first > 0 else None
        if load.first == 0 or cached is not None:  # the KV below load.first from the cache, the rest staged
            parts = [(part, tables) for part, _, tables in staged.parts]
            mine = [i for i, p in enumerate(every) if p >= load.first]
            every, tokens = [every[i] for i in mine], [load.recompute_tokens[i] for i in mine]
        else:
            parts, tokens = [], load.recompute_tokens
            for part in self._kv(plan, 0, plan.end, device):
                pos = torch.from_numpy(part.positions).to(device)
                parts.append((part, [t(pos) for t in self._tables]))
        if not every:
            return
        memory_kv = plan_kv(parts, self.spec, plan.end, device)
        if cached is not None:
            def memory_kv(i: int, stored=memory_kv):  # noqa: E306 - layer i: the cached prefix, then the plan's KV
                K, V = stored(i)
                K[: load.first], V[: load.first] = read_paged(staged.layers[i].kv_cache, cached[i], load.block_ids,
                                                              load.first)
                return K, V
            self.stats["cached_prefix_tokens"] += load.first
        positions = torch.tensor(every, dtype=torch.int64, device=device)
        write = paged_writer(staged.layers, load.block_ids, self.block_size, load.first, device)
        self.recompute.run(positions, torch.tensor(tokens, dtype=torch.int64), memory_kv, write)
        self.stats["recomputed_tokens"] += int((positions >= load.first).sum())

    def _fail(self, load: Load, e: BaseException) -> None:
        self.stats["failed_loads"] += 1
        self._failed_blocks.update(load.block_ids[p // self.block_size] for p in range(load.first, load.end))
        log.error("request %s: memory load failed, vLLM recomputes it: %s", load.req_id, e)

    def _stage(self, load: Load, layers: dict[int, torch.nn.Module]) -> "Staged":
        """Read one load's KV (host tier, else the store) and its slots and RoPE tables, and set up
        its write with the pipeline that fits it; no writes."""
        if len(layers) != self.spec.num_layers:
            raise RuntimeError(f"found {len(layers)} attention layers, the model has {self.spec.num_layers}")
        device = next(iter(layers.values())).kv_cache.device
        parts = self._kv(load.plan, load.first, load.end, device)
        if self._tables is None:  # one per distinct RoPE setting (sliding layers have their own base)
            self._tables = [RopeTable(r, self.max_model_len, device) for r in self.spec.ropes]
        blocks = torch.tensor(load.block_ids, dtype=torch.int64, device=device)
        staged_parts: list[StagedPart] = []
        for part in parts:  # one per stored dtype (the header's store and the user's may differ)
            pos = torch.from_numpy(part.positions).to(device)
            slots = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            staged_parts.append((part, slots, [t(pos) for t in self._tables]))
        pipeline = self._pipeline(parts, layers, device)
        return Staged(load, layers, staged_parts, device, set(layers), pipeline,
                      pipeline.prepare(staged_parts, layers))

    def _pipeline(self, parts: list[LoadPart], layers: dict[int, torch.nn.Module], device) -> LoadPipeline:
        """The CPU kernel's pipeline where the caches are on CPU, the kernels read every stored
        dtype and every layer's layout is known (the config not asking for the backend's write);
        else the backend's write."""
        if device.type != "cpu" or not all(cpu_kernels.supports(p.dtype) for p in parts):
            return self._backend
        return self._paged if self._paged_layouts(layers) is not None else self._backend

    def _paged_layouts(self, layers: dict[int, torch.nn.Module]) -> dict[int, PagedLayout] | None:
        """Each layer's cache layout for the CPU pipeline, or None where the config asks for the
        backend's write or some layer's layout could not be learned."""
        if self.paged_write == "backend":
            return None
        return self.layouts.of(layers)

    def _write(self, staged: "Staged", ids: list[int]) -> None:
        """Dequantise, rotate and write layers `ids` of a staged load into the paged cache, by its
        pipeline (no bookkeeping: the background writer calls this from its thread)."""
        staged.pipeline.write(staged.prepared, ids)

    def _written(self, staged: "Staged", ids) -> None:
        """Layers `ids` of `staged` are in the cache; the load is counted once all are."""
        staged.todo.difference_update(ids)
        if not staged.todo:
            n = staged.load.end - staged.load.first
            self.stats["injected_tokens"] += n
            if staged.pipeline.paged:
                self.stats["paged_write_tokens"] += n

    def _write_each(self, staged: list["Staged"], i: int) -> dict[int, BaseException]:
        """The background writer's task: layer `i` of every staged load not failed yet; what
        failed, by id of its load, rather than raising."""
        failed = {}
        for st in staged:
            if st.failed:
                continue
            try:
                self._write(st, [i])
            except Exception as e:  # noqa: BLE001 - reported to the forward pass's thread, which fails the load
                failed[id(st)] = e
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: write this layer of every staged load, just before its attention runs.
        Background: wait for the writer thread to have written it."""
        if not self._staged:
            return
        i = layer_index(layer_name)
        if i is None:
            return
        failed = None
        if self._writer is not None and self._writer.has(i):
            try:
                failed = self._writer.wait(i)
            except Exception as e:  # noqa: BLE001 - the task itself broke: every staged load fails
                failed = {id(st): e for st in self._staged}
        for staged in list(self._staged):
            if i not in staged.todo:
                continue
            try:
                if failed is None:
                    self._write(staged, [i])
                elif id(staged) in failed:
                    raise failed[id(staged)]
            except Exception as e:  # noqa: BLE001 - the whole load is recomputed
                staged.failed = True
                self._staged.remove(staged)
                self._fail(staged.load, e)
                continue
            self._written(staged, [i])
            if not staged.todo:
                self._staged.remove(staged)

    def wait_for_save(self) -> None:
        """After the forward pass: the background writer's tasks are all finished (none may write
        into blocks once the step is over), and a staged load whose layers were not all waited for
        (the backend never asked for them: its attention may have read them unwritten) fails, so
        vLLM recomputes its blocks rather than use partial memory."""
        if self._writer is not None:
            self._writer.drain()  # what it reports is moot: the loads still staged fail just below
        for staged in self._staged:
            staged.failed = True
            self._fail(staged.load, RuntimeError(f"layers {sorted(staged.todo)} were never loaded"))
        self._staged = []

    def shutdown(self) -> None:
        """Worker shutdown: the writer threads finish what they have and stop."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._paged.close()

    # -- stats (-> vLLM's stat loggers) -------------------------------------------------------
    def get_kv_connector_stats(self) -> InferScaleStats | None:
        """What this worker did since the last call (called by vLLM after each model step)."""
        h, d = self.host, self.device_tier
        ds = d.stats if d is not None else None
        return self._delta.take({"injected_tokens": self.stats["injected_tokens"],
                                 "failed_loads": self.stats["failed_loads"], "host_hits": h.stats.hits,
                                 "host_misses": h.stats.misses, "host_evictions": h.stats.evictions,
                                 "device_hits": ds.hits if ds else 0, "device_misses": ds.misses if ds else 0,
                                 "device_evictions": ds.evictions if ds else 0,
                                 "store_reads": self.stats["store_reads"],
                                 "recomputed_tokens": self.stats["recomputed_tokens"],
                                 "cached_prefix_tokens": self.stats["cached_prefix_tokens"],
                                 "plain_recompute_plans": self.stats["plain_recompute_plans"]},
                                {"host_bytes": h.used, "host_budget": h.budget,
                                 "device_bytes": d.used if d else 0, "device_budget": d.budget if d else 0})

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
