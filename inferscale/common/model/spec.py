"""Model spec read from a Hugging Face `config.json`, and the model fingerprint.

One `ModelSpec` describes everything both engines need to build the network and to place KV:
family, shapes, GQA grouping, normalisation and the RoPE convention. What differs per family is
read by the family's module (`inferscale.common.model.families`); the README's family table lists them.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from inferscale.common.model.families import SUPPORTED_FAMILIES, UnsupportedModelError, family

__all__ = ["ModelSpec", "RopeSpec", "SUPPORTED_FAMILIES", "UnsupportedModelError", "model_fingerprint",
           "rope_from_config", "weight_files"]

LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding convention.

    style: "split" rotates (x[i], x[i + rotary_dim/2]) pairs (HF Llama/Qwen/Mistral, GPT-NeoX);
    "interleaved" rotates (x[2i], x[2i+1]) pairs (GPT-J, Meta's original Llama code).
    Only the first `rotary_dim` channels of a head rotate (partial rotary); the rest pass through.
    LongRoPE ("longrope", Phi-3 128k, Phi-4-mini) is served within its original context: the
    frequencies divided by `short_factor` (one per rotated pair), cos and sin times
    `attention_factor`; the spec's `max_position` is capped there, as vLLM and transformers both
    switch to the long factors only past it.
    """

    theta: float
    rotary_dim: int
    style: str = "split"
    scaling: str | None = None  # None, "llama3", "linear" (positions divided by `factor`) or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] | None = None  # longrope only
    attention_factor: float = 1.0  # cos/sin scale (longrope)

    def __post_init__(self) -> None:
        if self.short_factor is not None:
            object.__setattr__(self, "short_factor", tuple(float(x) for x in self.short_factor))
        if self.style not in ("split", "interleaved"):
            raise ValueError(f"RoPE style must be 'split' or 'interleaved', got {self.style!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.scaling not in (None, "llama3", "linear", "longrope"):
            raise ValueError(f"unsupported rope scaling {self.scaling!r} (supported: llama3, linear, longrope)")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if (self.scaling == "longrope") != (self.short_factor is not None):
            raise ValueError("short_factor is given exactly when the scaling is longrope")
        if self.short_factor is not None and len(self.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"longrope short_factor has {len(self.short_factor)} entries, "
                             f"rotary_dim {self.rotary_dim} needs {self.rotary_dim // 2}")

    def to_dict(self) -> dict:
        """LongRoPE's fields are left out when unused (the dicts of other RoPEs stay as they were)."""
        d = asdict(self)
        if self.short_factor is None:
            del d["short_factor"], d["attention_factor"]
        else:
            d["short_factor"] = list(self.short_factor)
        return d


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Per-layer attention (Gemma 3): layer_types[i] is "full_attention" or "sliding_attention";
    # sliding layers attend to the last `sliding_window` positions (the query's own included) and
    # rotate with `local_rope`. None: every layer is full attention with `rope`.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    local_rope: RopeSpec | None = None
    # Block details of the Gemma layout (their defaults are the Llama layout).
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    sandwich_norm: bool = False  # post-attention and pre/post-feedforward norms around each block
    hidden_act: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    embed_scale: bool = False  # token embeddings multiplied by sqrt(hidden_size)
    attn_scale: float | None = None  # query scale (None: head_dim ** -0.5)
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rope.rotary_dim} exceeds head_dim {self.head_dim}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise UnsupportedModelError(f"unsupported layer types {bad} (supported: {', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ValueError(f"sliding-window layers need sliding_window > 0, got {self.sliding_window}")
        if self.local_rope is not None and (self.local_rope.rotary_dim, self.local_rope.style) != (
                self.rope.rotary_dim, self.rope.style):
            raise ValueError("local_rope must rotate the same channels (rotary_dim, style) as rope")
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(HIDDEN_ACTS)})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    # -- per-layer attention -------------------------------------------------------------------
    @property
    def ropes(self) -> tuple[RopeSpec, ...]:
        """The distinct RoPE settings, global first: `layer_rope_index(i)` indexes this tuple."""
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def layer_rope_index(self, layer: int) -> int:
        return 1 if self.local_rope is not None and self.is_sliding(layer) else 0

    def layer_rope(self, layer: int) -> RopeSpec:
        return self.ropes[self.layer_rope_index(layer)]

    def layer_window(self, layer: int) -> int | None:
        """How many positions (the query's own included) a layer's queries attend to; None: all."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_settings(self) -> list[dict] | None:
        """Per-layer RoPE and attention window when layers differ (the store meta records it)."""
        if self.layer_types is None and self.local_rope is None:
            return None
        return [{"rope": self.layer_rope(i).to_dict(), "window": self.layer_window(i)} for i in range(self.num_layers)]

    @property
    def query_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def to_dict(self) -> dict:
        """Fields at their Llama-layout defaults are left out, so the specs (and fingerprints) of
        families that do not use them are what they were before the fields existed."""
        d = asdict(self)
        for name, default in _LAYOUT_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        if d.get("layer_types") is not None:
            d["layer_types"] = list(d["layer_types"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)  # (RopeSpec turns a JSON list short_factor back into a tuple)
        d["rope"] = RopeSpec(**d["rope"])
        if d.get("local_rope") is not None:
            d["local_rope"] = RopeSpec(**d["local_rope"])
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        """Build a spec from a parsed Hugging Face `config.json`."""
        fam = family(cfg.get("model_type"))
        cfg = fam.text_config(cfg)
        fam.check_config(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            rope = rope_from_config(cfg, rope_params, head_dim)
            fields = dict(
                family=fam.name,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
            fields.update(fam.spec_fields(cfg))
            if fields["rope"].scaling == "longrope":  # served within the original context (short factors)
                fields["max_position"] = min(fields["max_position"], fields["rope"].original_max_position)
            return cls(**fields)
        except KeyError as e:
            raise ValueError(f"config.json of a {fam.name} model lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))


_LAYOUT_DEFAULTS = {"layer_types": None, "sliding_window": None, "local_rope": None, "norm_offset": 0.0,
                    "sandwich_norm": False, "hidden_act": "silu", "embed_scale": False, "attn_scale": None,
                    "final_logit_softcap": None}


def rope_from_config(cfg: dict, rope_params: dict, head_dim: int, theta: float | None = None) -> RopeSpec:
    """A `RopeSpec` from config.json's top-level RoPE fields and one rope_scaling/rope_parameters
    dict; `theta` (a family's per-layer base) overrides both."""
    theta = float(theta or cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    partial = float(cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
    rope_type = rope_params.get("rope_type", rope_params.get("type"))
    longrope = {}
    if rope_type in (None, "default"):
        scaling = None
    elif rope_type in ("llama3", "linear"):
        scaling = rope_type
    elif rope_type in ("longrope", "su"):  # "su": its name in the first Phi-3 128k configs
        scaling = "longrope"
        original = int(rope_params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        factor = float(rope_params.get("factor") or int(cfg["max_position_embeddings"]) / original)
        attn = rope_params.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        longrope = dict(short_factor=rope_params["short_factor"], attention_factor=float(attn), factor=factor,
                        original_max_position=original)
    else:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r} (supported: default, llama3, linear, longrope)")
    kw = dict(factor=float(rope_params.get("factor", 1.0)),
              original_max_position=int(rope_params.get("original_max_position_embeddings", 8192)))
    kw.update(longrope)
    return RopeSpec(
        theta=theta,
        rotary_dim=int(head_dim * partial),
        style="interleaved" if cfg.get("rope_interleaved") else "split",
        scaling=scaling,
        low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
        **kw,
    )


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a HF model folder (sharded or single), in index order."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in model folder {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"model folder {model_dir} lacks weight shards: {missing}")
    return files


# (spec, each weight file's path, inode, size and modification time) -> its fingerprint, in this process
_FINGERPRINTS: dict[tuple, str] = {}
_SETTLED_NS = 2_000_000_000  # a file written this recently may be written again within its clock's tick


def model_fingerprint(model_dir: str | Path, spec: ModelSpec | None = None) -> str:
    """sha256 over the architecture spec and every byte of the weights.

    Two folders with the same architecture and identical weights get the same fingerprint, so a
    store written by one engine is accepted by the other; any change of weights is refused.
    The weights are read once per process: asked again while no weight file was replaced or
    written (same inode, size and modification time), the fingerprint is the one computed before.
    Files written in the last two seconds are read every time (as git treats "racily clean"
    files), since a second write within one tick of the file system's clock keeps the time.
    """
    spec = spec or ModelSpec.from_pretrained(model_dir)
    described = json.dumps(spec.to_dict(), sort_keys=True)
    files = weight_files(model_dir)
    stats = [(f.resolve(), f.stat()) for f in files]
    key = (described, tuple((str(p), st.st_ino, st.st_size, st.st_mtime_ns) for p, st in stats))
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    started = time.time_ns()
    h = hashlib.sha256()
    h.update(described.encode())
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    if all(st.st_mtime_ns < started - _SETTLED_NS for _, st in stats):
        _FINGERPRINTS[key] = h.hexdigest()
    return h.hexdigest()
