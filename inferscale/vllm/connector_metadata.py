"""What the connector's scheduler half hands its worker half each step (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale.common.plan import MemoryPlan


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
