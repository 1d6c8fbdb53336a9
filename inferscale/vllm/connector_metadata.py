"""What the connector's scheduler half hands its worker half each step (picklable), and a load
as the worker half stages it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale.common.prompt.plan import MemoryPlan


@dataclass
class Load:
    """KV to write for one request: plan positions [first, end) into its blocks; the prompt's
    tokens at the plan's recomputed positions (`plan.positions_to_recompute()`), in that order."""

    req_id: str
    plan: MemoryPlan
    first: int
    end: int
    block_ids: list[int]
    recompute_tokens: list[int] = field(default_factory=list)


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


@dataclass(eq=False)
class Staged:
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
