"""Recovery policies: which memory positions are injected and which the engine recomputes.

Independently encoded facts miss each other (a fact's KV never attended to the facts before it in
the served prompt), which costs answer quality. A policy trades some prefill back for it by marking
memory positions "recompute": the engine computes them at their serving positions, attending to
everything before them (injected or recomputed), exactly as joint prefill would. Plain Python; the
engines execute the mask.

    policy = RecoveryPolicy.parse("last:2")     # recompute the last 2 facts of the memory
    facts = policy.arrange(facts)                # the order to lay the facts out in (`top:n` moves some)
    mask = policy.mask(layout)                   # [len(layout)] bool, True = inject
    n = injected_prefix(mask)                    # what a prefix-only engine (vLLM's connector) injects

Policies (`name[:n]`):
- `none`: inject every memory token (plain injection).
- `all`: recompute every memory token (= joint prefill of the text).
- `last:n`: recompute the last n facts. Prefix-compatible: the injected positions are a prefix of
  the prompt, so vLLM's connector serves it (the recomputed facts attend to every injected one).
- `top:n`: recompute the n most relevant facts, moved next to the question. The facts come in
  retrieval's order (most relevant first, the server's); `arrange` moves the first n to the end of
  the memory, the most relevant last, right before the question, and the mask recomputes them as
  `last:n` does. Prefix-compatible. In retrieval's order `last:n` recomputes the *least* relevant
  facts; `top:n` spends the same budget on the facts the answer most likely needs.
- `near:n`: the same order as `top:n` (the n most relevant facts next to the question), nothing
  recomputed: `top:n` is `near:n+last:n`. On SmolLM2 most of `top:n`'s gain is this order
  (docs/quality.md).
- `heads:n`: recompute the first n tokens of every fact (EPIC-style: a fact's first tokens carry
  most of what it misses about its neighbours). Not prefix-compatible: vLLM's connector computes
  those positions itself with the engine's own model (`inferscale.vllm.recompute`).
- `keys:s`: inject everything, with the memory's keys scaled by s/100 (an attention temperature on
  memory, as APE uses: s < 100 flattens attention over the facts, s > 100 sharpens it). The JAX
  engine only (the connector does not scale keys).
- `ape:t:s`: inject everything, with APE's attention temperature t/100 and scaling factor s/100
  on the memory (arXiv 2502.05431): the memory's keys are divided by the temperature, and the
  memory's share of attention is rescaled (its log-sum-exp times s/100 * t/100,
  `inferscale.jax.paged_attention.paged_attention_grouped`). `ape:100:100` is plain injection.
  The JAX engine only.
- `blend:r`: recompute the r% of memory tokens whose injected KV deviates most from joint
  prefill's at an early layer (CacheBlend's selection). Needs that deviation per token, which the
  engine computes (`mask(layout, deviation)`). The JAX engine only.
- `a+b`: recompute what either part recomputes (`heads:4+last:2`: the first 4 tokens of every
  fact and the last 2 facts whole). Parts are `last`, `top`, `near`, `heads` and `blend`.

The anchors every engine keeps: `all` equals joint prefill and `none` (and `keys:100`) plain
injection, and with facts encoded after exactly their served prefix every policy that only
recomputes (all but `keys:S`) equals joint prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import numpy as np

from inferscale.common.prompt.layout import PromptLayout

POLICIES = ("none", "all", "last", "top", "near", "heads", "blend", "keys", "ape")
_TAKES_N = ("last", "top", "near", "heads", "blend", "keys", "ape")
_COMBINABLE = ("last", "top", "near", "heads", "blend")

T = TypeVar("T")


@dataclass(frozen=True)
class RecoveryPolicy:
    name: str = "none"
    n: int = 0
    plus: tuple["RecoveryPolicy", ...] = ()  # more parts of an `a+b` policy (each recomputes its own)
    m: int = 0  # `ape:t:s`: the scaling factor s (n is the temperature t)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"recovery policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"recovery policy {self.name!r}: n must be an integer >= 0, got {self.n!r}")
        if self.name in _TAKES_N and self.n < 1:
            raise ValueError(f"recovery policy {self.name!r} needs n >= 1 (write it as {self.name}:N)")
        if self.name not in _TAKES_N and self.n:
            raise ValueError(f"recovery policy {self.name!r} takes no n")
        if isinstance(self.m, bool) or not isinstance(self.m, int) or (self.name == "ape") != (self.m > 0):
            raise ValueError(f"recovery policy {self.name!r}: write APE as ape:T:S (temperature and scaling factor, "
                             f"percent, both >= 1)" if self.name == "ape" else f"recovery policy {self.name!r} "
                             "takes one number")
        if self.name == "blend" and self.n > 100:
            raise ValueError(f"recovery policy 'blend' takes a percentage of memory tokens, got {self.n}")
        if self.plus:
            parts = [self, *self.plus]
            if any(p.name not in _COMBINABLE for p in parts) or any(p.plus for p in self.plus):
                raise ValueError(f"recovery policy {str(self)!r}: only {', '.join(_COMBINABLE)} combine with '+'")
            if len({p.name for p in parts}) != len(parts):
                raise ValueError(f"recovery policy {str(self)!r} names a policy twice")

    @classmethod
    def parse(cls, text: str) -> "RecoveryPolicy":
        """`none`, `all`, `last:N`, `top:N`, `near:N`, `heads:N`, `blend:R`, `keys:S`, `ape:T:S`, and `a+b`
        of last / top / near / heads / blend."""
        parts = []
        for part in str(text).strip().split("+"):
            name, *nums = part.strip().split(":")
            if len(nums) > 2 or not all(x.isdigit() for x in nums):
                raise ValueError(f"recovery policy {text!r}: N must be a non-negative integer")
            n, m = (int(x) for x in (nums + ["0", "0"])[:2])
            parts.append(cls(name, n, m=m))
        if len(parts) == 1:
            return parts[0]
        return cls(parts[0].name, parts[0].n, tuple(parts[1:]))

    def __str__(self) -> str:
        own = f"{self.name}:{self.n}" if self.name in _TAKES_N else self.name
        own += f":{self.m}" if self.m else ""
        return "+".join([own, *map(str, self.plus)])

    @property
    def parts(self) -> tuple["RecoveryPolicy", ...]:
        return (RecoveryPolicy(self.name, self.n, m=self.m), *self.plus)

    @property
    def reorders(self) -> bool:
        """True when `arrange` moves facts (`top:n`, `near:n`)."""
        return any(p.name in ("top", "near") for p in self.parts)

    def arrange(self, facts: Sequence[T]) -> list[T]:
        """The order to lay `facts` (retrieval's order, most relevant first) out in: unchanged, but
        for `top:n` and `near:n`, whose n most relevant facts go last, the most relevant next to the
        question."""
        n = max((p.n for p in self.parts if p.name in ("top", "near")), default=0)
        facts = list(facts)
        return facts[n:] + facts[:n][::-1] if n else facts

    @property
    def prefix_compatible(self) -> bool:
        """True when the injected positions always form a prefix of the prompt."""
        return all(p.name not in ("heads", "blend") for p in self.parts)

    @property
    def key_scale(self) -> float:
        """Factor on the injected memory keys (`keys:S`: S/100; `ape:T:S`: 100/T; else 1)."""
        return self.n / 100 if self.name == "keys" else 100 / self.n if self.name == "ape" else 1.0

    @property
    def memory_mass(self) -> float:
        """APE: the factor on the memory group's log-sum-exp (scaling factor times temperature); 1 else."""
        return self.m / 100 * self.n / 100 if self.name == "ape" else 1.0

    @property
    def needs_deviation(self) -> bool:
        """True when the mask depends on the injected KV's deviation (`mask(layout, deviation)`)."""
        return any(p.name == "blend" for p in self.parts)

    def mask(self, layout: PromptLayout, deviation: np.ndarray | None = None) -> np.ndarray:
        """[len(layout)] bool: True where the memory's KV is injected, False where it is computed.
        Segments the layout marks "compute" (footer, question) are always computed. `deviation`
        ([len(layout)] float, higher = further from joint prefill) is what `blend` selects by."""
        if self.plus:  # injected where every part injects
            return np.logical_and.reduce([p.mask(layout, deviation) for p in self.parts])
        mask = layout.inject_mask()
        facts = layout.facts
        if self.name == "all":
            for s in facts:
                mask[s.start : s.end] = False
        elif self.name in ("last", "top"):  # `top`: its facts were moved last (`arrange`)
            for s in facts[len(facts) - min(self.n, len(facts)):]:
                mask[s.start : s.end] = False
        elif self.name == "heads":
            for s in facts:
                mask[s.start : s.start + min(self.n, len(s.token_ids))] = False
        elif self.name == "blend":
            if deviation is None or len(deviation) != len(layout):
                raise ValueError("recovery policy 'blend' needs the KV deviation of every prompt position")
            memory = np.concatenate([np.arange(s.start, s.end) for s in facts]) if facts else np.zeros(0, int)
            take = int(np.ceil(self.n / 100 * len(memory)))
            worst = memory[np.argsort(-np.asarray(deviation)[memory], kind="stable")[:take]]
            mask[worst] = False
        return mask


def connector_policy(policy: "str | RecoveryPolicy | None") -> RecoveryPolicy:
    """The policy (parsed; None: `none`) if vLLM's connector serves it: every policy that only
    recomputes positions it can name without the engine's help (`none`, `all`, `last:N`, `top:N`,
    `near:N`, `heads:N` and their `+`), not `keys:S` (scaled keys) nor `blend:R` (its mask needs joint
    prefill's KV)."""
    p = policy if isinstance(policy, RecoveryPolicy) else RecoveryPolicy.parse(policy or "none")
    if p.name in ("keys", "ape"):
        raise ValueError(f"recovery policy {str(p)!r} scales the memory's keys, which only the JAX engine does")
    if p.needs_deviation:
        raise ValueError(f"recovery policy {str(p)!r} selects tokens by their deviation from joint prefill, which "
                         "only the JAX engine measures (vLLM's connector serves none, all, last:N, top:N, "
                         "near:N, heads:N and their '+')")
    return p


def recompute_runs(mask: np.ndarray, end: int) -> tuple[tuple[int, int], ...]:
    """(start, n) of each run of recomputed positions below `end` (what a plan's `recompute` holds)."""
    off = np.flatnonzero(~np.asarray(mask[:end], dtype=bool))
    if not len(off):
        return ()
    breaks = np.flatnonzero(np.diff(off) > 1)
    starts = np.concatenate([off[:1], off[breaks + 1]])
    stops = np.concatenate([off[breaks], off[-1:]]) + 1
    return tuple((int(a), int(b - a)) for a, b in zip(starts, stops))


def memory_end(layout: PromptLayout, mask: np.ndarray) -> int:
    """Where the injected memory ends: the end of the last header or fact segment with an injected
    position (past it, the engine prefills as usual; before it, it computes the recomputed runs)."""
    end = 0
    for s in layout.segments:
        if s.kind in ("header", "fact") and s.action == "inject" and bool(np.asarray(mask[s.start : s.end]).any()):
            end = s.end
    return end


def injected_prefix(mask: np.ndarray) -> int:
    """Length of the leading run of injected positions."""
    off = np.flatnonzero(~np.asarray(mask, dtype=bool))
    return int(off[0]) if len(off) else len(mask)


def recompute_share(layout: PromptLayout, mask: np.ndarray) -> float:
    """Share of the memory's tokens (its fact tokens) that the policy recomputes."""
    n = sum(len(s.token_ids) for s in layout.facts)
    if not n:
        return 0.0
    recomputed = sum(int((~mask[s.start : s.end]).sum()) for s in layout.facts)
    return recomputed / n
