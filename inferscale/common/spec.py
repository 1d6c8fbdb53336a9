"""Model spec read from a Hugging Face `config.json`, and the model fingerprint.

One `ModelSpec` describes everything both engines need to build the network and to place KV:
family, shapes, GQA grouping, normalisation and the RoPE convention. What differs per family is
read by the family's module (`inferscale.common.families`); the README's family table lists them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .families import SUPPORTED_FAMILIES, UnsupportedModelError, family

__all__ = ["ModelSpec", "RopeSpec", "SUPPORTED_FAMILIES", "UnsupportedModelError", "model_fingerprint",
           "weight_files"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding convention.

    style: "split" rotates (x[i], x[i + rotary_dim/2]) pairs (HF Llama/Qwen/Mistral, GPT-NeoX);
    "interleaved" rotates (x[2i], x[2i+1]) pairs (GPT-J, Meta's original Llama code).
    Only the first `rotary_dim` channels of a head rotate (partial rotary); the rest pass through.
    """

    theta: float
    rotary_dim: int
    style: str = "split"
    scaling: str | None = None  # None or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.style not in ("split", "interleaved"):
            raise ValueError(f"RoPE style must be 'split' or 'interleaved', got {self.style!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.scaling not in (None, "llama3"):
            raise ValueError(f"unsupported rope scaling {self.scaling!r} (supported: llama3)")

    def to_dict(self) -> dict:
        return asdict(self)


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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        """Build a spec from a parsed Hugging Face `config.json`."""
        fam = family(cfg.get("model_type"))
        fam.check_config(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            partial = float(cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
            rope_type = rope_params.get("rope_type", rope_params.get("type"))
            if rope_type in (None, "default"):
                scaling = None
            elif rope_type == "llama3":
                scaling = "llama3"
            else:
                raise UnsupportedModelError(
                    f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)"
                )
            rope = RopeSpec(
                theta=theta,
                rotary_dim=int(head_dim * partial),
                style="interleaved" if cfg.get("rope_interleaved") else "split",
                scaling=scaling,
                factor=float(rope_params.get("factor", 1.0)),
                low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
                original_max_position=int(rope_params.get("original_max_position_embeddings", 8192)),
            )
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
            return cls(**fields)
        except KeyError as e:
            raise ValueError(f"config.json of a {fam.name} model lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))


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


def model_fingerprint(model_dir: str | Path, spec: ModelSpec | None = None) -> str:
    """sha256 over the architecture spec and every byte of the weights.

    Two folders with the same architecture and identical weights get the same fingerprint, so a
    store written by one engine is accepted by the other; any change of weights is refused.
    """
    spec = spec or ModelSpec.from_pretrained(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    for f in weight_files(model_dir):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
