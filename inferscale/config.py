"""The typed configuration shared by the entry points, the server and the connector.

One tree, each knob defined once under one name:

    EngineSettings     memory encoding, storage, retrieval, the vLLM engine and the connector
      MemoryLLMConfig  (inferscale.serving.memory_llm)   + model, memory_root
      ServerConfig     (inferscale.server.settings)        + network, tenancy, limits, request defaults
    ConnectorConfig    what MemoryLLMConfig hands the connector (kv_connector_extra_config)
    DemoConfig         (inferscale.demo)                   the demo's own knobs + `settings: EngineSettings`
    CalibrateConfig    (inferscale.evaluation.calibrate)   what to measure + `settings: EngineSettings`

`inferscale serve` builds a `ServerConfig` from flags and YAML (every `EngineSettings` field is a
YAML key and a flag of the same name: `kv_write` is `--kv-write`); the server derives its
`MemoryLLMConfig` from it, which derives the `ConnectorConfig`; no field is copied by hand. Each
field is a `knob`: its default, help and enum in one place, from which `add_flags` makes the flags
of `serve`, `calibrate`, `demo`, `memory` and the benchmarks.

    cfg = ConnectorConfig(memory_root="mem", kv_load="background")
    extra = cfg.to_extra()                      # -> kv_transfer_config.kv_connector_extra_config
    ConnectorConfig.from_extra(extra) == cfg    # the connector decodes it (one codec, both ways)

Every value is validated once, when its dataclass is built, with a `ValueError` naming the field;
the names of modes and dtypes come from `inferscale.common.modes`. Plain Python: importing this
module imports no engine.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable

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


def parse_cpus(text: str) -> str | list[int]:
    """A CPU selection flag: "auto", or CPU ids separated by commas."""
    if text == "auto":
        return text
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'auto' or CPU ids separated by commas, got {text!r}") from None


@dataclass(frozen=True)
class Flag:
    """A settings field's command-line flag (`add_flags`): `--<field-name>` (`switch`: a boolean's
    one flag, which sets the other value), its help and metavar (default: its `choices`, joined by
    "|"); argparse's type is `parse`, else the default's type. The help ends with the field's
    default unless the help gives it."""

    help: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    switch: str | None = None
    choices: tuple[str, ...] | None = None  # an enum of common.modes: argparse refuses anything else


def knob(default: Any, help: str, metavar: str | None = None, **flag: Any):
    """A settings field with its flag: one place for its name, default and help."""
    return field(default=default, metadata={"flag": Flag(help, metavar, **flag)})


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Iterable[str] | None = None,
              defaults: dict[str, Any] | None = None) -> None:
    """Add `cls`'s fields that have a `Flag` (all, or those named) to `parser`, in field order.
    Flags not given are not set (`argparse.SUPPRESS`): the dataclass's defaults decide them, unless
    `defaults` gives the value they take (a script's own, e.g. a benchmark's float32 stores)."""
    wanted = None if names is None and not defaults else set(names or ()) | set(defaults or ())
    defaults = defaults or {}
    for f in fields(cls):
        spec = f.metadata.get("flag")
        if spec is None or (wanted is not None and f.name not in wanted):
            continue
        default = defaults.get(f.name, f.default)
        text = spec.help if default in ("", None) else f"{spec.help} (default: {default})"
        if spec.switch is not None or isinstance(f.default, bool):
            parser.add_argument(spec.switch or "--" + f.name.replace("_", "-"), dest=f.name,
                                action="store_false" if f.default else "store_true",
                                default=defaults.get(f.name, argparse.SUPPRESS), help=spec.help)
            continue
        parse = spec.parse or (type(f.default) if isinstance(f.default, (int, float, str)) else str)
        metavar = spec.metavar or ("|".join(spec.choices) if spec.choices else None)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=parse, metavar=metavar,
                            choices=spec.choices, default=defaults.get(f.name, argparse.SUPPRESS),
                            help=text.replace("%", "%%"))
    if wanted is not None:
        unknown = wanted - {f.name for f in fields(cls) if "flag" in f.metadata}
        if unknown:
            raise ValueError(f"{cls.__name__} has no flag for {', '.join(sorted(unknown))}")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Memory encoding, storage, retrieval, the vLLM engine and the connector: the settings the
    server and `MemoryLLM` share (validated here, once). Each is a YAML key of `serve --config`
    and a flag of the same name (`kv_write` is `--kv-write`), made from its `knob` (`add_flags`)."""

    # -- memory: how facts are encoded and kept
    w: int = knob(5, "context-window turns (or facts, see --context) each fact is encoded after", "N")
    context: str = knob("turns", "what each fact is encoded after (common.modes.ENCODING_CONTEXTS): its w preceding "
                        "turns, the w facts added before it, rendered as served, or its w turns read from one pass "
                        "over the conversation", choices=ENCODING_CONTEXTS)
    kv_dtype: str = knob("bfloat16", "how new memory stores keep KV: bfloat16, float32, float16, int8 or float8_e4m3 "
                         "(per-channel scales; float8_e4m3's 3 mantissa bits lose the answers of models whose keys "
                         "have large outlier channels, as Qwen2.5's: int8 keeps them at the same size)", "DTYPE",
                         choices=KV_DTYPES)
    encode_mode: str = knob("one-pass", "how an ingest's facts are encoded: packed as prefix trees (one-pass) or one "
                            "by one (per-fact)", choices=ENCODE_MODES)
    encoder_device: str = knob("cpu", "where facts are encoded: cpu, cuda[:N], or auto (CUDA when torch sees a GPU; "
                               "the encoder's float32 weights then sit beside vLLM's)", "auto|cpu|cuda[:N]")
    # -- storage: "" keeps each in the memory root; URLs share them between replicas
    catalog: str = knob("", "postgresql://... catalog shared by replicas (default: SQLite in the memory directory)",
                        "URL")
    kv_store: str = knob("", "redis://... KV tier shared by replicas (default: files in the memory directory)", "URL")
    plan_secret_file: str = knob("", "the secret memory plans are signed with (common.prompt.plan_signing; default: "
                                 "plan-secret in the memory directory, made at first start); a gateway (--engine-url) "
                                 "and its vLLM pods name the same file", "FILE")
    # -- retrieval
    index: str = knob("auto", "the per-user vector index: auto (faiss where installed), faiss or exact",
                      choices=INDEX_KINDS)
    query_weights: str = knob("auto", "the search query's embedding network: int8 weights (ONNX Runtime on the CPU: "
                              "about 2x faster per query, vectors a median 0.005 off in cosine, the same evidence "
                              "recall on LoCoMo) or float32; auto: int8 where the embedder runs in ONNX Runtime. "
                              "Facts are always embedded in float32", choices=QUERY_WEIGHTS)
    # -- the prompt
    memory_boundary: bool = knob(False, "end the memory block with an explicit boundary and instruction "
                                 "(common.prompt.layout.BOUNDARY: computed, after the facts)")
    chat_layout: str = knob("auto", "where a chat's memory goes: inside the new user turn, after the system prompt "
                            "and the earlier turns, which vLLM's prefix cache then reuses from turn to turn "
                            "(history-first), or before the whole chat (memory-first); auto: history-first served "
                            "as text, memory-first injected", choices=CHAT_LAYOUTS)
    # -- the memory chain (`memory.chain`: the whole memory, k "all", under mode "auto" or "chain")
    chain_budget: int = knob(3072, "the most fact tokens a user's memory chain holds (the whole memory, k all, "
                             "served exactly from KV encoded jointly); beyond them, the most relevant facts are "
                             "retrieved", "TOKENS")
    chain_rest_k: int = knob(10, "facts retrieved beyond the chain's budget, served as text after it", "N")
    chain_repeat: int = knob(0, "the N facts most relevant to the new message repeated as text after the whole "
                             "memory (k all), next to the message: still exact, a few dozen tokens prefilled", "N")
    # -- the quality gate (mode "auto")
    tolerance: float | None = knob(None, "memory.mode auto: decide the calibration's kept answers within this "
                                   "tolerance of text, in points of its correctness measure as a fraction (0.05: 5 "
                                   "points; default: the calibration's own)", "FRACTION", parse=float)
    # -- the engine (vLLM)
    max_model_len: int = knob(4096, "context length of the engine", "N")
    block_size: int = knob(32, "vLLM's KV block size in tokens", "N")
    dtype: str = knob("float32", "the engine's compute dtype", choices=ENGINE_DTYPES)
    enable_prefix_caching: bool = knob(True, "turn vLLM's prefix cache off", switch="--no-prefix-caching")
    enable_chunked_prefill: bool = knob(False, "let vLLM split long prefills over steps")
    max_num_batched_tokens: int | None = knob(None, "vLLM's token budget per step (default: vLLM's)", "N", parse=int)
    cpu_kv_cache_gib: int = knob(1, "vLLM CPU's KV cache size (VLLM_CPU_KVCACHE_SPACE; ignored on GPU)", "GIB")
    # -- the connector (ConnectorConfig's fields of the same names)
    kv_load: str = knob("sync", "how the connector writes memory KV: every layer before the forward pass (sync), "
                        "each layer right before its attention (layerwise: copies overlap compute on a GPU), or on "
                        "a writer thread beside the forward pass, on the CPUs it does not use (background, CPU)",
                        choices=LOAD_MODES)
    kv_load_cpus: list[int] | str | None = knob("auto", "background loads: the writer thread's CPUs (auto: those the "
                                                "forward pass is not bound to)", "auto|ID,ID,...", parse=parse_cpus)
    kv_write_threads: int | None = knob(None, "threads a load's layers are written on (default: torch's intra-op "
                                        "threads)", "N", parse=int)
    kv_write: str = knob("auto", "how memory KV goes into the paged cache: straight in the layout learned from the "
                         "backend's write, full blocks in streaming stores (auto), the same with plain stores "
                         "(plain), or through the attention backend's own write (backend); all three write the same "
                         "bits", choices=WRITE_WAYS)
    device_cache_bytes: int | None = knob(None, "the connector's device tier of fact KV (default: 2 GiB on CUDA, off "
                                          "on CPU)", "N", parse=int)
    host_cache_bytes: int = knob(1 << 30, "the connector's host-memory tier of fact KV in front of the stores", "N")

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
