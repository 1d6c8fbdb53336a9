"""The typed configuration shared by the entry points, the server and the connector.

One tree, each knob defined once under one name:

    EngineSettings     memory encoding, storage, retrieval, the vLLM engine and the connector
      MemoryLLMConfig  (inferscale.serving.memory_llm)   + model, memory_root
      ServerConfig     (inferscale.server.settings)        + network, tenancy, limits, request defaults
    ConnectorConfig    what MemoryLLMConfig hands the connector (kv_connector_extra_config)

`inferscale serve` builds a `ServerConfig` from flags and YAML (every `EngineSettings` field is a
YAML key and a flag of the same name: `kv_write` is `--kv-write`); the server derives its
`MemoryLLMConfig` from it, which derives the `ConnectorConfig`; no field is copied by hand.

    cfg = ConnectorConfig(memory_root="mem", kv_load="background")
    extra = cfg.to_extra()                      # -> kv_transfer_config.kv_connector_extra_config
    ConnectorConfig.from_extra(extra) == cfg    # the connector decodes it (one codec, both ways)

Every value is validated once, when its dataclass is built, with a `ValueError` naming the field;
the names of modes and dtypes come from `inferscale.common.modes`. Plain Python: importing this
module imports no engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from inferscale.common.modes import (
    CHAT_LAYOUTS,
    ENCODE_MODES,
    ENCODING_CONTEXTS,
    ENGINE_DTYPES,
    INDEX_KINDS,
    KV_DTYPES,
    LOAD_MODES,
    QUERY_WEIGHTS,
    WRITE_WAYS,
)
from inferscale.common.storage.backends import validate_kv_url
from inferscale.common.storage.catalogs import validate_catalog_url


def section(cls: type, settings: object, **values: Any):
    """The dataclass `cls` (a lower layer's config: the memory service's, the connector's) built
    from the fields of `settings` that it shares by name, plus `values` for those it names
    otherwise or that only the caller knows. No field is copied by hand between layers: a field
    added to both is passed on by itself."""
    shared = {f.name for f in fields(cls)} & {f.name for f in fields(settings)}
    return cls(**{name: getattr(settings, name) for name in shared - values.keys()}, **values)


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}" if hi is not None
                         else f"{name} must be >= {lo}, got {value}")


def check_float(name: str, value: object, lo_exclusive: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value <= lo_exclusive:
        raise ValueError(f"{name} must be > {lo_exclusive}, got {value}")


def check_str(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_kv_url(url: object, name: str = "kv_store") -> str:
    if not isinstance(url, str):
        raise ValueError(f"{name} must be a string (a redis:// URL, or empty), got {url!r}")
    return validate_kv_url(url, name)


def check_catalog_url(url: object, name: str = "catalog") -> str:
    if not isinstance(url, str):
        raise ValueError(f"{name} must be a string (a postgresql:// URL, or empty), got {url!r}")
    return validate_catalog_url(url, name)


def check_threads(value: Any, name: str) -> int | None:
    """`value` as a thread count (None: the default), or ValueError naming `name`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
    return value


def check_cpus(value: Any, name: str) -> list[int] | str | None:
    """`value` as a CPU selection: "auto", None (unbound) or a non-empty list of CPU ids."""
    if value is None or value == "auto":
        return value
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        raise ValueError(f"{name} must be 'auto' or a non-empty list of CPU ids, got {value!r}")
    return list(value)


def check_optional_bytes(value: Any, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
    return value


def check_choice(value: Any, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Memory encoding, storage, retrieval, the vLLM engine and the connector: the settings the
    server and `MemoryLLM` share (validated here, once)."""

    # -- memory: how facts are encoded and kept
    w: int = 5  # context-window turns (or facts, see `context`) each fact is encoded after
    # what facts are encoded after (common.modes.ENCODING_CONTEXTS): their w turns, the w facts before
    # them, or their w turns read from one pass over the conversation
    context: str = "turns"
    kv_dtype: str = "bfloat16"  # how new stores keep KV (common.modes.KV_DTYPES)
    encode_mode: str = "one-pass"  # the encoder runs an ingest's items as prefix trees, or "per-fact"
    # where facts are encoded: "cpu", "cuda[:N]", or "auto" (CUDA when torch sees a GPU). On a GPU the
    # encoder's weights (float32) sit beside vLLM's, which reserves gpu_memory_utilization of the memory
    encoder_device: str = "cpu"
    # -- storage: "" keeps each in the memory root; URLs share them between replicas
    catalog: str = ""  # "" (SQLite in memory_root) or a postgresql:// URL
    kv_store: str = ""  # "" (files in memory_root) or a redis:// URL
    # the secret memory plans are signed with (common.prompt.plan_signing): "" keeps it in memory_root
    # (made at first start); a gateway and its vLLM pods name the same file
    plan_secret_file: str = ""
    # -- retrieval
    index: str = "auto"  # the per-user vector index (common.modes.INDEX_KINDS)
    # the default embedder's search-query network: "int8" or "float32" weights, "auto": int8 where it runs
    # in ONNX Runtime, on the CPU (MiniLMEmbedder.query_weights)
    query_weights: str = "auto"
    # -- the prompt: end the memory block with `common.prompt.layout.BOUNDARY` (computed, after the last fact)
    memory_boundary: bool = False
    # where a chat's memory goes (common.modes.CHAT_LAYOUTS): after the system prompt and the earlier
    # turns, which then stay a prefix vLLM's prefix cache reuses across turns, or before all of them;
    # "auto": history-first when served as text, memory-first when injected
    chat_layout: str = "auto"
    # -- the memory chain (`memory.chain`: the whole memory, k "all", under mode "auto" or "chain"): the
    # most fact tokens a user's chain holds; beyond them, the chain_rest_k facts most relevant to the
    # new message are retrieved and served as text after the chain; chain_repeat: the facts most
    # relevant to the new message repeated as text after the whole memory, next to it (0: none)
    chain_budget: int = 3072
    chain_rest_k: int = 10
    chain_repeat: int = 0
    # -- the quality gate (mode "auto"): decide the calibration's kept measurements within this
    # tolerance, in points of its correctness measures as a fraction (None: the calibration's own)
    tolerance: float | None = None
    # -- the engine (vLLM)
    max_model_len: int = 4096
    block_size: int = 32
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None
    cpu_kv_cache_gib: int = 1  # vLLM CPU's KV cache size (VLLM_CPU_KVCACHE_SPACE), ignored on GPU
    # -- the connector (ConnectorConfig's fields of the same names)
    kv_load: str = "sync"
    kv_load_cpus: list[int] | str | None = "auto"
    kv_write_threads: int | None = None
    kv_write: str = "auto"
    device_cache_bytes: int | None = None
    host_cache_bytes: int = 1 << 30  # the connector's host-memory tier in front of the stores

    def __post_init__(self) -> None:
        check_int("w", self.w, 0)
        check_choice(self.context, ENCODING_CONTEXTS, "context")
        check_choice(self.kv_dtype, KV_DTYPES, "kv_dtype")
        check_choice(self.encode_mode, ENCODE_MODES, "encode_mode")
        if not isinstance(self.encoder_device, str) or (
                self.encoder_device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", self.encoder_device)):
            raise ValueError(f"encoder_device must be auto, cpu or cuda[:N], got {self.encoder_device!r}")
        check_catalog_url(self.catalog)
        check_kv_url(self.kv_store)
        check_choice(self.index, INDEX_KINDS, "index")
        check_choice(self.query_weights, QUERY_WEIGHTS, "query_weights")
        check_bool("memory_boundary", self.memory_boundary)
        check_choice(self.chat_layout, CHAT_LAYOUTS, "chat_layout")
        check_int("chain_budget", self.chain_budget, 1)
        check_int("chain_rest_k", self.chain_rest_k, 0)
        check_int("chain_repeat", self.chain_repeat, 0)
        if self.tolerance is not None and (isinstance(self.tolerance, bool) or not isinstance(
                self.tolerance, (int, float)) or not 0 <= self.tolerance < 1):
            raise ValueError(f"tolerance must be a fraction in [0, 1) (0.05: 5 points), got {self.tolerance!r}")
        check_int("max_model_len", self.max_model_len, 16)
        check_int("block_size", self.block_size, 1)
        check_choice(self.dtype, ENGINE_DTYPES, "dtype")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("cpu_kv_cache_gib", self.cpu_kv_cache_gib, 1)
        check_choice(self.kv_load, LOAD_MODES, "kv_load")
        object.__setattr__(self, "kv_load_cpus", check_cpus(self.kv_load_cpus, "kv_load_cpus"))
        check_threads(self.kv_write_threads, "kv_write_threads")
        check_choice(self.kv_write, WRITE_WAYS, "kv_write")
        check_optional_bytes(self.device_cache_bytes, "device_cache_bytes")
        check_int("host_cache_bytes", self.host_cache_bytes, 0)

    def engine_settings(self) -> dict[str, Any]:
        """This config's `EngineSettings` fields, to build another config of the tree from."""
        return {f.name: getattr(self, f.name) for f in fields(EngineSettings)}


@dataclass(frozen=True)
class ConnectorConfig:
    """What the vLLM connector reads from `kv_connector_extra_config` (one name per knob, the same
    as `MemoryLLMConfig`'s and `inferscale serve`'s: `kv_load` is `--kv-load`)."""

    memory_root: str
    model_fingerprint: str = ""  # "": hashed from the model's weights when the connector starts
    kv_store: str = ""  # "" (files in memory_root) or a redis:// URL shared by replicas
    plan_secret_file: str = ""  # the plans' HMAC secret ("": memory_root/plan-secret; common.prompt.plan_signing)
    # how memory KV is loaded: "sync" (every layer before the forward pass), "layerwise" (each layer
    # right before its attention) or "background" (CPU: on a writer thread beside the forward pass)
    kv_load: str = "sync"
    kv_load_cpus: list[int] | str | None = "auto"  # background: the writer's CPUs ("auto": those free)
    kv_write_threads: int | None = None  # a load's layers written on this many threads (None: torch's)
    kv_write: str = "auto"  # common.modes.WRITE_WAYS
    device_cache_bytes: int | None = None  # the device tier (None: 2 GiB on CUDA, off on CPU)
    host_cache_bytes: int = 1 << 30  # the host-memory tier in front of the stores
    parent_pid: int | None = None  # the engine's processes die with this one (None: they don't watch)

    # names earlier releases wrote into the extra config, still read
    LEGACY = {"load": "kv_load", "load_cpus": "kv_load_cpus", "write_threads": "kv_write_threads",
              "paged_write": "kv_write"}

    def __post_init__(self) -> None:
        if not isinstance(self.memory_root, str) or not self.memory_root:
            raise ValueError(f"memory_root must be a non-empty path, got {self.memory_root!r}")
        if not isinstance(self.model_fingerprint, str):
            raise ValueError(f"model_fingerprint must be a string, got {self.model_fingerprint!r}")
        check_kv_url(self.kv_store)
        check_choice(self.kv_load, LOAD_MODES, "kv_load")
        object.__setattr__(self, "kv_load_cpus", check_cpus(self.kv_load_cpus, "kv_load_cpus"))
        check_threads(self.kv_write_threads, "kv_write_threads")
        check_choice(self.kv_write, WRITE_WAYS, "kv_write")
        check_optional_bytes(self.device_cache_bytes, "device_cache_bytes")
        if check_optional_bytes(self.host_cache_bytes, "host_cache_bytes") is None:
            raise ValueError("host_cache_bytes must be an integer >= 0, got None")
        if self.parent_pid is not None and (isinstance(self.parent_pid, bool) or not isinstance(self.parent_pid, int)):
            raise ValueError(f"parent_pid must be None or a process id, got {self.parent_pid!r}")

    def to_extra(self) -> dict[str, Any]:
        """The JSON-able `kv_connector_extra_config` (fields at their default are left out)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "memory_root" or value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        """Decode `kv_connector_extra_config`; an unknown key is refused by name."""
        extra = dict(extra or {})
        if "memory_root" not in extra:
            raise ValueError("InferScaleConnector needs kv_connector_extra_config['memory_root']")
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in extra.items():
            name = cls.LEGACY.get(key, key)
            if name not in names:
                raise ValueError(f"kv_connector_extra_config: unknown key {key!r} "
                                 f"(known: {', '.join(sorted(names))})")
            if name in kwargs:
                raise ValueError(f"kv_connector_extra_config: {key!r} and {name!r} name the same setting")
            kwargs[name] = value
        if kwargs.get("model_fingerprint") is None:
            kwargs.pop("model_fingerprint", None)
        if kwargs.get("kv_store") is None:
            kwargs.pop("kv_store", None)
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: {e}") from None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
