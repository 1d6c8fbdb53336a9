"""The research engine's settings (`EngineConfig`) and what it answers with (`Answer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp

from inferscale.common.modes import ENCODE_MODES
from inferscale.jax.model import KERNELS

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    max_context: int | None = None  # default: min(model's max positions, 4096)
    block_size: int = 32
    kernels: str = "auto"  # "auto" = Pallas on GPU, jax.numpy reference on CPU
    dtype: str = "float32"
    encode_batch_size: int = 8
    encode_mode: str = "one-pass"  # or "per-fact", the reference (ENCODE_MODES)
    checkpoint_dir: str | None = None  # orbax cache of converted weights

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kernels not in ("auto", *KERNELS):
            raise ValueError(f"kernels must be 'auto', 'reference' or 'pallas', got {self.kernels!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.encode_batch_size < 1:
            raise ValueError(f"encode_batch_size must be >= 1, got {self.encode_batch_size}")
        if self.encode_mode not in ENCODE_MODES:
            raise ValueError(f"encode_mode must be one of {', '.join(ENCODE_MODES)}, got {self.encode_mode!r}")


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # of each generated token
    ttft_s: float  # request in -> first token out (includes composition and injection)
    timings: dict[str, float] = field(default_factory=dict)  # compose / inject / prefill, seconds
    num_injected: int = 0  # prompt tokens whose KV was injected
    num_prefilled: int = 0  # prompt tokens the engine computed
