"""The memory plan a request carries to the connector, and its validation.

A plan travels in `SamplingParams.extra_args["kv_transfer_params"]["inferscale"]` as plain JSON:

    {"user": "alice", "version": 7, "incarnation": "9f2c...", "end": 412,
     "segments": [{"store": "shared", "key": "header~ab12...", "start": 0, "n": 38},
                  {"store": "user",   "key": "f3~7",          "start": 38, "n": 21}, ...]}

Segments are ascending and cover the prompt tokens up to `end` whose KV is injected; every prompt
token after `end` is computed by vLLM. A plan may also name runs of positions inside `[0, end)`
whose KV the connector computes with the engine's own model instead of injecting it
(`"recompute": [[start, n], ...]`, a recovery policy such as `heads:4`; `inferscale.vllm.recompute`).
Positions no segment covers (the gaps: a history-first chat's conversation before its memory) have
no stored KV, so they must be recomputed: a plan whose gaps are not all in its recompute runs is
refused, and a plan with gaps is never injected without its recompute runs.
"user" segments are read only from the plan user's
own store, so a plan cannot name another user's KV. Plain Python: used by the scheduler side of
the connector, by `MemoryLLM` before submitting, and by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferscale.common.facts import validate_id

PLAN_KEY = "inferscale"


class PlanError(ValueError):
    """A memory plan that must not be injected (the reason is the message)."""


@dataclass(frozen=True)
class PlanSegment:
    """A run of stored KV a plan injects (what `layout.Segment`, a run of the prompt, becomes
    once its KV is stored)."""

    store: str  # "shared" (model-level KV, e.g. the prompt header) or "user"
    key: str  # kv key inside that store
    start: int  # serving position of its first token
    n: int

    @property
    def end(self) -> int:
        return self.start + self.n


@dataclass(frozen=True)
class MemoryPlan:
    user: str
    version: int
    segments: tuple[PlanSegment, ...]
    incarnation: str = ""  # the user's incarnation (a re-created user id gets a new one)
    recompute: tuple[tuple[int, int], ...] = ()  # (start, n) runs inside [0, end) the connector computes

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def to_params(self) -> dict:
        raw = {"user": self.user, "version": self.version, "incarnation": self.incarnation, "end": self.end,
               "segments": [vars(s) for s in self.segments]}
        if self.recompute:
            raw["recompute"] = [list(r) for r in self.recompute]
        return {PLAN_KEY: raw}

    @property
    def num_injected(self) -> int:
        """Positions whose stored KV is injected (the plan's, less those it recomputes)."""
        return self.end - sum(n for _, n in self.recompute)

    def gaps(self) -> tuple[tuple[int, int], ...]:
        """(start, n) of each run of positions below `end` that no segment covers."""
        out, pos = [], 0
        for s in self.segments:
            if s.start > pos:
                out.append((pos, s.start - pos))
            pos = s.end
        return tuple(out)

    def positions_to_recompute(self) -> list[int]:
        """The positions the connector computes, ascending."""
        return [p for start, n in self.recompute for p in range(start, start + n)]

    def check_recompute(self) -> None:
        """Runs inside [0, end), ascending, non-overlapping, non-empty (else PlanError)."""
        pos = 0
        for start, n in self.recompute:
            if n < 1 or start < pos or start + n > self.end:
                raise PlanError(f"recompute run ({start}, {n}) must be non-empty, ascending, non-overlapping and "
                                f"inside the plan's {self.end} positions")
            pos = start + n

    @classmethod
    def from_params(cls, params: dict | None) -> "MemoryPlan | None":
        """Parse and check a plan's shape; None if the request carries none."""
        raw = (params or {}).get(PLAN_KEY)
        if raw is None:
            return None
        try:
            user = validate_id("user", raw["user"])
            segs = tuple(PlanSegment(str(s["store"]), str(s["key"]), int(s["start"]), int(s["n"])) for s in raw["segments"])
            runs = tuple((int(a), int(n)) for a, n in raw.get("recompute", ()))
            plan = cls(user, int(raw["version"]), segs, str(raw.get("incarnation", "")), runs)
            declared_end = int(raw["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed memory plan: {e}") from None
        plan.check_shape()
        if declared_end != plan.end:
            raise PlanError(f"plan end {declared_end} != end of its segments {plan.end}")
        return plan

    def check_shape(self) -> None:
        """Segments non-empty, ascending and apart; every gap between them inside a recompute run."""
        if not self.segments:
            raise PlanError("memory plan has no segments")
        pos = 0
        for s in self.segments:
            if s.store not in ("shared", "user"):
                raise PlanError(f"segment store must be 'shared' or 'user', got {s.store!r}")
            if s.start < pos or s.n < 1:
                raise PlanError(f"segments must be non-empty and ascending from 0; segment {s.key!r} starts at "
                                f"{s.start}, before {pos}")
            pos = s.end
        runs = sorted(self.recompute)
        for start, n in self.gaps():
            covered = start  # how far from `start` the runs reach without a hole
            for a, m in runs:
                if a <= covered:
                    covered = max(covered, a + m)
            if covered < start + n:
                raise PlanError(f"positions {start}..{start + n} have no stored KV and are not all recomputed")

    def check_prompt(self, prompt_len: int, max_model_len: int) -> None:
        if self.end >= prompt_len:
            raise PlanError(f"plan injects {self.end} tokens of a {prompt_len}-token prompt; at least one "
                            "prompt token must be computed")
        if prompt_len > max_model_len:
            raise PlanError(f"prompt of {prompt_len} tokens is beyond the model's context of {max_model_len}")
