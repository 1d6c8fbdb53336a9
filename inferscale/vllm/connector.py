"""InferScale's vLLM V1 KV connector: inject each request's memory KV, rotated at injection time.

Configured through `kv_transfer_config`:

    {"kv_connector": "InferScaleConnector",
     "kv_connector_module_path": "inferscale.vllm.connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"memory_root": "/path/to/memory",
                                   "model_fingerprint": "<optional: skips hashing the weights>",
                                   "kv_store": "<optional: redis://... the shared KV tier>"}}

Users' KV (and the prompt header's) is read from `<memory_root>` or, with `kv_store`, from the
Redis tier every replica shares (`inferscale.common.storage.redis_store`), so a stock `vllm serve` loaded
with this connector serves what any InferScale gateway or replica wrote.

vLLM builds one instance per role. Hook contracts, as this connector keeps them:

Scheduler side (EngineCore process, called by the scheduler once per scheduling step):
- `get_num_new_matched_tokens(request, num_computed_tokens)`: reads the request's `MemoryPlan`
  from `kv_transfer_params`, checks it against the prompt (every segment's stored tokens must
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
  with scales, or floats), dequantised and rotated to their serving positions layer by layer (`compact.py`:
  Triton on CUDA, Numba on CPU, `rope.py`, `cpu_kernels.py`), written with
  the attention backend's own `do_kv_cache_update` into the request's slots. On CPU the
  connector learns, once per kind of layer, where the backend's write puts each element of a
  block (`paged_write.learn_layout`: numbered K/V written into a scratch cache, then a random write
  both ways compared bit for bit; float32 and bfloat16 caches), and a Numba kernel reads the facts
  as the host tier keeps them and writes every layer's slots directly in that layout, whole blocks
  in streaming stores (`compact.prepare_paged`; extra config `"paged_write"`: `"plain"` for plain
  stores, `"backend"` keeps the backend's write). A load that fails
  reports its blocks through `get_block_ids_with_load_errors`, so vLLM recomputes them
  (`kv_load_failure_policy="recompute"`); nothing partial is served as memory.
- `get_kv_connector_stats()`: the worker's counters since the last call (injected tokens, failed
  loads, host-tier hits / misses / evictions / bytes, store reads), which vLLM hands to the stat
  loggers (`connector_stats.py`); the server's `/metrics` shows them.
- with `"load": "layerwise"` in the extra config, `start_load_kv` only reads each load's KV (and
  builds its slots and RoPE tables), and `wait_for_layer_load(layer)`, which vLLM calls before each
  attention layer runs, writes that layer: on a GPU the copies of later layers can then overlap the
  earlier layers' compute. With `"load": "background"` (CPU caches; elsewhere it acts as
  layerwise), `start_load_kv` also hands every layer's write, in layer order, to a writer thread
  bound to the CPUs the forward pass does not use (`"load_cpus"`: "auto" or a list of CPU ids;
  `writers.py`), and `wait_for_layer_load(layer)` waits for that layer's. `wait_for_save`
  (after the forward pass) waits for the writer to finish and fails any load with layers left
  unwritten or not waited for, so vLLM recomputes it. The default, `"sync"`, writes every layer
  in `start_load_kv` and is the reference the other two are tested against (same tokens and
  logprobs).
- A write of several layers straight into the paged cache is split over `"write_threads"`
  threads (default: torch's intra-op threads, the cores vLLM's CPU worker computes on, idle while
  the connector writes; the helpers bound to the team's other cores; `writers.py`): disjoint
  layers, the same bytes.
- `shutdown()`: stops the writer threads.
- `save_kv_layer`: a no-op (this connector never saves vLLM's KV).

Injected KV is approximate and per user, so it must never be served as exact prefix-cache content
to someone else: `MemoryLLM` salts every memory request's prefix cache with (user, memory version)
(`cache_salt`), and vLLM's block hashes include the salt.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inferscale.common.modes import LOAD_MODES, WRITE_WAYS
from inferscale.common.plan import MemoryPlan, PlanError
from inferscale.common.spec import ModelSpec, model_fingerprint
from inferscale.common.storage.backends import open_kv
from inferscale.common.storage.format import StoreError
from inferscale.common.storage.local_store import Store
from inferscale.common.storage.paths import shared_store_dir, user_store_dir
from inferscale.common.storage.tiers import HostTier
from inferscale.vllm.connector_stats import InferScaleStats, StatsDelta
from inferscale.vllm.kernels import cpu_kernels
from inferscale.vllm.kernels.chunked_rope import RopeTable
from inferscale.vllm.kernels.compact import (
    LoadPart,
    gather,
    layer_kv,
    on_device,
    prepare_paged,
)
from inferscale.vllm.kernels.paged_write import PagedLayout, learn_layout
from inferscale.vllm.kernels.paged_write import warm_up as warm_up_paged_write
from inferscale.vllm.kernels.writers import (
    LayerWriter,
    WritePool,
    check_threads,
    free_cpus,
    split_write,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("inferscale.connector")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _attention_layers(named: dict[str, Any]) -> dict[int, Any]:
    """Layer index -> attention layer, of vLLM's named modules (`model.layers.{i}.self_attn.attn`)."""
    out = {}
    for name, layer in named.items():
        m = _LAYER.search(name)
        if m and hasattr(layer, "impl") and hasattr(layer.impl, "do_kv_cache_update"):
            out[int(m.group(1))] = layer
    return out


@dataclass
class Load:
    """KV to write for one request: plan positions [first, end) into its blocks."""

    req_id: str
    plan: MemoryPlan
    first: int
    end: int
    block_ids: list[int]


@dataclass(eq=False)
class _Staged:
    """A load read and ready: per stored dtype (part, slots, RoPE tables); the layers still to
    write; where they go straight into the paged cache, the kernel's writes set up once
    (`compact.prepare_paged`: one per stored dtype and group of layers sharing a learned layout).
    `failed` is set (on the forward pass's thread) once the load has failed: the writer thread
    then skips its remaining layers."""

    load: Load
    layers: dict
    parts: list
    device: Any
    todo: set[int]
    writes: list[tuple[Any, set[int]]] | None = None  # (PreparedWrite, its layers)
    failed: bool = False


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class StoreCache:
    """Opened stores by path, reopened when the manifest changes (another process wrote)."""

    def __init__(self) -> None:
        self._stores: dict[Path, tuple[tuple[int, int, int], Store]] = {}

    def get(self, path: Path) -> Store:
        try:
            st = (path / Store.MANIFEST).stat()
        except FileNotFoundError:
            self._stores.pop(path, None)  # the user was deleted
            raise
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # the manifest is replaced (new inode) on every write
        hit = self._stores.get(path)
        if hit is None or hit[0] != stamp:
            hit = (stamp, Store.open(path))
            self._stores[path] = hit
        return hit[1]


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        from inferscale.vllm.lifetime import (
            die_with_parent,  # built in the engine-core and worker processes:
        )

        die_with_parent(extra.get("parent_pid"))  # they must not outlive a killed server
        if "memory_root" not in extra:
            raise ValueError("InferScaleConnector needs kv_connector_extra_config['memory_root']")
        self.root = Path(extra["memory_root"])
        model_dir = vllm_config.model_config.model
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.fingerprint = extra.get("model_fingerprint") or model_fingerprint(model_dir, self.spec)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.stores = StoreCache()
        # users' KV in the shared Redis tier (every replica reads what any wrote), else under memory_root
        self.shared_kv = open_kv(extra["kv_store"], self.root) if extra.get("kv_store") else None
        # scheduler side
        self._matched: dict[str, tuple[MemoryPlan, int]] = {}
        self._loads: dict[str, Load] = {}
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.host = HostTier(int(extra.get("host_cache_bytes", 1 << 30)))
        # the hot tier in the cache's own memory (GPU): fact KV kept there as torch tensors, so a
        # hit is a device-to-device copy; default 2 GiB on CUDA. On CPU the host tier is that memory
        # already: off unless asked for (then it only keeps a torch copy of what the host tier holds)
        self._device_budget = extra.get("device_cache_bytes")
        self.device_tier: HostTier | None = None
        self._last_sweep = 0.0
        self._tables: list[RopeTable] | None = None  # per distinct RoPE setting, built on first load
        self._failed_blocks: set[int] = set()
        # "sync": every layer written in start_load_kv (the reference); "layerwise": the KV is read in
        # start_load_kv and each layer written in wait_for_layer_load, right before that layer's
        # attention; "background" (CPU caches): every layer's write handed to a writer thread in
        # start_load_kv, on the CPUs "load_cpus" names ("auto": those the forward pass is not bound to)
        self.load_mode = extra.get("load", "sync")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config['load'] must be one of {', '.join(LOAD_MODES)}, "
                             f"got {self.load_mode!r}")
        self._load_cpus = extra.get("load_cpus", "auto")
        if self._load_cpus != "auto":
            free_cpus(self._load_cpus)  # checked here, where a bad config should fail
        self._writer: LayerWriter | None = None  # background: built at the first load (in the worker)
        # CPU kernel writes of several layers split over this many threads (None: torch's intra-op
        # threads, the cores vLLM's worker computes on, idle while the connector writes)
        self._write_threads = check_threads(extra.get("write_threads"), "kv_connector_extra_config['write_threads']")
        self._pool: WritePool | None = None  # the helpers, built at the first write (in the worker)
        self._staged: list[_Staged] = []  # layerwise, background: loads read, with layers not written yet
        # CPU: write memory straight into the paged cache (`compact.prepare_paged`) in the layout the
        # backend's own write gives ("auto": learned once per kind of layer, full blocks in streaming
        # stores; "plain": plain stores), or always through the backend's write ("backend")
        self.paged_write = extra.get("paged_write", "auto")
        if self.paged_write not in WRITE_WAYS:
            raise ValueError(f"kv_connector_extra_config['paged_write'] must be one of {', '.join(WRITE_WAYS)}, "
                             f"got {self.paged_write!r}")
        # (isa, dtype, cache shape past blocks) -> the layout learned for such caches (None: the backend's write)
        self._layouts: dict[tuple, PagedLayout | None] = {}
        self.stats = {"injected_tokens": 0, "refused_plans": 0, "failed_loads": 0, "store_reads": 0,
                      "paged_write_tokens": 0}  # of injected_tokens: written by the CPU kernel
        self._delta = StatsDelta()

    # -- shared ------------------------------------------------------------------------------
    def _open(self, owner: str):
        """The store of `owner` (a user id, or "<shared>" for the model-level store)."""
        if self.shared_kv is not None:
            if owner == "<shared>":
                return self.shared_kv.open_shared(self.fingerprint)
            return self.shared_kv.open(owner)
        if owner == "<shared>":
            return self.stores.get(shared_store_dir(self.root))
        return self.stores.get(user_store_dir(self.root, owner))

    def _store(self, plan: MemoryPlan, which: str) -> Store:
        try:
            store = self._open(plan.user if which == "user" else "<shared>")
        except FileNotFoundError:
            raise PlanError(f"no {which} store for user {plan.user!r}") from None
        try:
            store.meta.check_model(self.spec, self.fingerprint)
        except StoreError as e:
            raise PlanError(f"{which} store of user {plan.user!r}: {e}") from None
        return store

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            plan = MemoryPlan.from_params(request.kv_transfer_params)
            if plan is None:
                return 0, False
            prompt = request.prompt_token_ids or []
            plan.check_prompt(len(prompt), self.max_model_len)
            stores: dict[str, Store] = {}  # each store opened and checked once per plan, not per fact
            for seg in plan.segments:
                if seg.store not in stores:
                    stores[seg.store] = self._store(plan, seg.store)
                info = stores[seg.store].info(seg.key)
                if info["tokens"] != list(prompt[seg.start : seg.end]):
                    raise PlanError(f"prompt tokens at {seg.start}..{seg.end} differ from the stored tokens "
                                    f"of {seg.key!r}")
        except (PlanError, StoreError, KeyError) as e:
            self.stats["refused_plans"] += 1
            log.warning("request %s: injecting nothing (prefilling normally): %s", request.request_id, e)
            return 0, False
        n = plan.end - num_computed_tokens
        if n <= 0:
            return 0, False
        self._matched[request.request_id] = (plan, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or matched is None:
            return
        plan, computed = matched
        self._loads[request.request_id] = Load(request.request_id, plan, computed, computed + num_external_tokens,
                                               list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = InferScaleMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def pending_requests(self) -> int:
        """Requests with connector state (0 after every request has finished)."""
        return len(self._matched) + len(self._loads)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if any(t.device.type == "cpu" for t in kv_caches.values()) and cpu_kernels.available():
            cpu_kernels.warm_up()
            warm_up_paged_write()
            # learn the caches' layouts now (25-100 ms per kind of layer) rather than in the first
            # request; layers whose caches are not bound yet are learned at their first load
            layers = _attention_layers(self._vllm_config.compilation_config.static_forward_context)
            if layers and all(isinstance(getattr(x, "kv_cache", None), torch.Tensor) for x in layers.values()):
                self._paged_layouts(layers)

    SWEEP_INTERVAL_S = 1.0

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
                store = self._open(owner)
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
        dev_tier = self._device_tier(device)
        for seg in plan.segments:
            if seg.end <= first or seg.start >= end:
                continue
            owner = plan.user if seg.store == "user" else "<shared>"
            f = dev_tier.get((owner, seg.key)) if dev_tier is not None else None
            if f is None:
                f = self.host.get((owner, seg.key))
                if f is None:
                    (f,) = self._store(plan, seg.store).get_compact([seg.key])
                    self.stats["store_reads"] += 1
                    self.host.put((owner, seg.key), f)
                if dev_tier is not None:
                    f = on_device(f, device)
                    dev_tier.put((owner, seg.key), f)
            a, b = max(first, seg.start) - seg.start, min(end, seg.end) - seg.start
            pieces.append((f, a, b, seg.start + a))
        return gather(pieces)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleMetadata) or not meta.loads:
            return
        self._sweep_host_tier()
        layers = _attention_layers(forward_context.no_compile_layers)
        for load in meta.loads:
            try:
                staged = self._stage(load, layers)
                if self.load_mode == "sync":
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

    def _fail(self, load: Load, e: BaseException) -> None:
        self.stats["failed_loads"] += 1
        self._failed_blocks.update(load.block_ids[p // self.block_size] for p in range(load.first, load.end))
        log.error("request %s: memory load failed, vLLM recomputes it: %s", load.req_id, e)

    def _stage(self, load: Load, layers: dict[int, torch.nn.Module]) -> "_Staged":
        """Read one load's KV (host tier, else the store) and its slots and RoPE tables; no writes."""
        if len(layers) != self.spec.num_layers:
            raise RuntimeError(f"found {len(layers)} attention layers, the model has {self.spec.num_layers}")
        device = next(iter(layers.values())).kv_cache.device
        parts = self._kv(load.plan, load.first, load.end, device)
        if self._tables is None:  # one per distinct RoPE setting (sliding layers have their own base)
            self._tables = [RopeTable(r, self.max_model_len, device) for r in self.spec.ropes]
        blocks = torch.tensor(load.block_ids, dtype=torch.int64, device=device)
        prepared = []
        for part in parts:  # one per stored dtype (the header's store and the user's may differ)
            pos = torch.from_numpy(part.positions).to(device)
            slots = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            prepared.append((part, slots, [t(pos) for t in self._tables]))
        staged = _Staged(load, layers, prepared, device, set(layers))
        layouts = self._paged_layouts(layers) if device.type == "cpu" and all(
            cpu_kernels.supports(p.dtype) for p in parts) else None
        if layouts is not None:  # straight into the paged cache: the kernel's arguments set up once
            layer_rope = [self.spec.layer_rope_index(i) for i in range(self.spec.num_layers)]
            groups: dict[int, set[int]] = {}  # layers that share a layout
            for i in layers:
                groups.setdefault(id(layouts[i]), set()).add(i)
            streaming = self.paged_write == "auto"
            staged.writes = [(prepare_paged(part, slots, tables, self.spec.ropes, layer_rope, layouts[min(group)],
                                            streaming), group)
                             for group in groups.values() for part, slots, tables in prepared]
        return staged

    def _paged_layouts(self, layers: dict[int, torch.nn.Module]) -> dict[int, PagedLayout] | None:
        """Each layer's cache layout for `compact.prepare_paged`, or None where the config asks for
        the backend's write or some layer's layout could not be learned (learned once per kind of
        layer, on scratch caches)."""
        if self.paged_write == "backend" or not cpu_kernels.available():
            return None
        out = {}
        for i, layer in layers.items():
            cache = layer.kv_cache
            key = (getattr(layer, "isa", None), cache.dtype, tuple(cache.shape[1:]))
            if key not in self._layouts:
                write = lambda k, v, c, s, layer=layer: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
                self._layouts[key] = learn_layout(write, cache, self.block_size, self.spec.num_kv_heads,
                                                  self.spec.head_dim)
                log.info("memory KV into %s caches of %s (%s): %s", cache.dtype, tuple(cache.shape[1:]), key[0],
                         "written directly" if self._layouts[key] else "through the backend's write")
            if self._layouts[key] is None:
                return None
            out[i] = self._layouts[key]
        return out

    def _write(self, staged: "_Staged", ids: list[int]) -> None:
        """Dequantise, rotate and write layers `ids` of a staged load into the paged cache (no
        bookkeeping: the background writer calls this from its thread)."""
        if staged.writes is not None:
            threads = self._threads() if len(ids) > 1 else 1  # (one layer: also the background writer's call)
            pool = self._pool.pool if threads > 1 else None
            for write, group in staged.writes:
                mine = [i for i in ids if i in group]
                if mine:
                    split_write(write, mine, [staged.layers[i].kv_cache for i in mine], pool, threads)
            return
        for i in ids:
            layer = staged.layers[i]
            dtype = layer.kv_cache.dtype if layer.kv_cache.is_floating_point() else torch.float32
            r = self.spec.layer_rope_index(i)
            for part, slots, tables in staged.parts:
                k_rot, v_i = layer_kv(part, i, *tables[r], self.spec.ropes[r], dtype, staged.device)
                layer.impl.do_kv_cache_update(layer, k_rot, v_i, layer.kv_cache, slots)

    def _threads(self) -> int:
        """How many threads a write of several layers is split over (the helpers built once)."""
        if self._pool is None:
            self._pool = WritePool(self._write_threads or torch.get_num_threads())
        return self._pool.threads

    def _written(self, staged: "_Staged", ids) -> None:
        """Layers `ids` of `staged` are in the cache; the load is counted once all are."""
        staged.todo.difference_update(ids)
        if not staged.todo:
            n = staged.load.end - staged.load.first
            self.stats["injected_tokens"] += n
            if staged.writes is not None:
                self.stats["paged_write_tokens"] += n

    def _write_each(self, staged: list["_Staged"], i: int) -> dict[int, BaseException]:
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
        m = _LAYER.search(layer_name + ".")
        if m is None:
            return
        i = int(m.group(1))
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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

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
        """Worker shutdown: the writer thread finishes what it has and stops."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- stats (worker side -> vLLM's stat loggers) -------------------------------------------
    def get_kv_connector_stats(self) -> InferScaleStats | None:
        """What this worker did since the last call (called by vLLM after each model step)."""
        h, d = self.host, self.device_tier
        ds = d.stats if d is not None else None
        return self._delta.take({"injected_tokens": self.stats["injected_tokens"],
                                 "failed_loads": self.stats["failed_loads"], "host_hits": h.stats.hits,
                                 "host_misses": h.stats.misses, "host_evictions": h.stats.evictions,
                                 "device_hits": ds.hits if ds else 0, "device_misses": ds.misses if ds else 0,
                                 "device_evictions": ds.evictions if ds else 0,
                                 "store_reads": self.stats["store_reads"]},
                                {"host_bytes": h.used, "host_budget": h.budget,
                                 "device_bytes": d.used if d else 0, "device_budget": d.budget if d else 0})

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> InferScaleStats:
        return InferScaleStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
