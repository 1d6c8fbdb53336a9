"""The connector's scheduler half: plans read, checked against the prompt and the stores, and
handed to the workers as loads. Side-effect free where vLLM asks (`get_num_new_matched_tokens`
only records what it matched); it never touches KV.

Built by `InferScaleConnector` in the engine-core process (role SCHEDULER); the hooks it serves
and their contracts are listed in `inferscale.vllm.connector`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from inferscale.common.prompt.plan import MemoryPlan, PlanError
from inferscale.common.prompt.plan_signing import verify
from inferscale.common.storage.format import StoreError
from inferscale.common.storage.protocols import FactStore
from inferscale.vllm.connector_metadata import InferScaleMetadata, Load
from inferscale.vllm.plan_stores import PlanStores

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("inferscale.connector")


class ConnectorScheduler:
    def __init__(self, stores: PlanStores, max_model_len: int, secret: bytes) -> None:
        self.stores, self.max_model_len, self._secret = stores, max_model_len, secret
        self._matched: dict[str, tuple[MemoryPlan, int, list[int]]] = {}
        self._loads: dict[str, Load] = {}
        self.stats = {"refused_plans": 0, "refused_recompute": 0}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            plan = MemoryPlan.from_params(request.kv_transfer_params)
            if plan is None:
                return 0, False
            prompt = request.prompt_token_ids or []
            verify(request.kv_transfer_params, prompt, self._secret)
            plan.check_prompt(len(prompt), self.max_model_len)
            stores: dict[str, FactStore] = {}  # each store opened and checked once per plan, not per fact
            for seg in plan.segments:
                if seg.store not in stores:
                    stores[seg.store] = self.stores.checked(plan, seg.store)
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
        tokens: list[int] = []
        if plan.recompute:
            try:
                plan.check_recompute()
                tokens = [int(prompt[p]) for p in plan.positions_to_recompute()]
            except PlanError as e:  # the memory is still right to inject: plainly, as stored
                self.stats["refused_recompute"] += 1
                if plan.gaps():  # ... unless the plan leaves positions with no stored KV
                    self.stats["refused_plans"] += 1
                    log.warning("request %s: injecting nothing (prefilling normally): %s", request.request_id, e)
                    return 0, False
                log.warning("request %s: injecting the memory plainly (nothing recomputed): %s", request.request_id, e)
                plan = dataclasses.replace(plan, recompute=())
        self._matched[request.request_id] = (plan, num_computed_tokens, tokens)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or matched is None:
            return
        plan, computed, tokens = matched
        self._loads[request.request_id] = Load(request.request_id, plan, computed, computed + num_external_tokens,
                                               list(blocks.get_block_ids()[0]), tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> InferScaleMetadata:
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
