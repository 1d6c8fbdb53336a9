"""What the connector's scheduler half hands its worker half each step (picklable), and a load
as the worker half stages it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale.common.prompt.plan import MemoryPlan

if TYPE_CHECKING:
    from inferscale.vllm.kernels.load_pipeline import LoadPipeline, StagedPart


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
    write; the load pipeline chosen for it (`kernels/load_pipeline.py`: the CPU kernel straight
    into the paged cache, or the backend's write) and its write set up once by that pipeline
    (`pipeline.prepare`; `pipeline.write(prepared, ids)` writes layers `ids`). `failed` is set (on
    the forward pass's thread) once the load has failed: the writer thread then skips its
    remaining layers."""

    load: Load
    layers: dict
    parts: list[StagedPart]
    device: Any
    todo: set[int]
    pipeline: LoadPipeline
    prepared: Any  # what pipeline.prepare returned
    failed: bool = False
