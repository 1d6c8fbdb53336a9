"""The one request type, and what `serving.prepare` makes of it for vLLM.

    MemoryRequest("alice", "Where does Tom live?", k=10, mode="auto")          # MemoryLLM
    MemoryRequest("acme:alice", question, messages=chat, mode="auto", k=10,    # the server
                  max_tokens=64, sampling={"temperature": 0.7}, tenant="acme")

Plain Python: no vLLM type is built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferscale.common.modes import SERVE_MODES, WHOLE_MEMORY
from inferscale.common.prompt.recovery import connector_policy


def served_policy(mode: str, policy) -> str | None:
    """The recovery policy a request of `mode` is served with: for "inject" the given one if vLLM
    can serve it (`connector_policy`; default `none`); every other mode takes none ("auto" chooses
    its own). ValueError naming the problem otherwise."""
    if mode == "inject":
        return str(connector_policy(policy))
    if policy is not None:
        raise ValueError("mode 'auto' chooses the recovery policy itself; do not pass one" if mode == "auto"
                         else f"a recovery policy applies to mode 'inject' only, got mode {mode!r}")
    return None


@dataclass(frozen=True)
class MemoryRequest:
    """What one request asks of the memory and the engine, checked on construction.

    `user` None (no user) or mode "none" serve no memory. `fact_ids` names the facts instead of
    retrieving the top `k` for `question`; k "all" is the whole memory, in insertion order.
    `messages` (OpenAI-style `{"role", "content"}` dicts ending with the user's `question`): a
    whole chat, laid out as `chat_layout` says; None: the question alone after the memory."""

    user: str | None
    question: str  # what the memory is searched with (the new message)
    k: int | str = 10  # facts to retrieve, or "all" (`common.modes.WHOLE_MEMORY`)
    mode: str = "inject"  # as requested: auto | inject | text | chain | none
    fact_ids: tuple[str, ...] | None = None
    w: int | None = None  # the encoding window of the facts served (None: the config's)
    max_tokens: int = 64
    cache_salt: str | None = None  # replaces the prefix-cache salt (never share one across users)
    policy: str | None = None  # the recovery policy of mode "inject" (None: plain injection)
    messages: tuple[dict, ...] | None = None
    boundary: bool | None = None  # end the memory with `layout.BOUNDARY` (None: the config's memory_boundary)
    chat_layout: str | None = None  # where a chat's memory goes (common.modes.CHAT_LAYOUTS; None: the config's)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments (greedy by default)
    filters: Any = None  # retrieval among the facts that satisfy it (`common.storage.filters`)
    tenant: str | None = None  # the prefix-cache scope of a request without a user
    repeat: int | None = None  # whole memory: its facts most relevant to `question` repeated next to it (None: config's)

    def __post_init__(self) -> None:
        if self.mode not in SERVE_MODES:
            raise ValueError(f"mode must be one of {SERVE_MODES}, got {self.mode!r}")
        served_policy(self.mode, self.policy)  # ValueError for a policy this mode cannot take
        if self.k != WHOLE_MEMORY and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise ValueError(f"k must be an integer >= 0 or {WHOLE_MEMORY!r}, got {self.k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.repeat is not None and (isinstance(self.repeat, bool) or not isinstance(self.repeat, int)
                                        or self.repeat < 0):
            raise ValueError(f"repeat must be an integer >= 0, got {self.repeat!r}")
        if self.repeat and not self.whole:
            raise ValueError("repeat applies to the whole memory (k \"all\" or mode chain)")
        if self.mode == "chain" and self.fact_ids is not None:
            raise ValueError("mode chain serves the whole memory; name no fact_ids")
        if self.fact_ids is not None and not isinstance(self.fact_ids, tuple):
            object.__setattr__(self, "fact_ids", tuple(self.fact_ids))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))

    @property
    def whole(self) -> bool:
        """Whether it serves the whole memory (k "all", or the chain) rather than facts named or found."""
        return (self.k == WHOLE_MEMORY or self.mode == "chain") and self.fact_ids is None

    @property
    def gate_k(self) -> int | str:
        """The k mode "auto" asks the quality gate about: the facts named, else the k requested."""
        return len(self.fact_ids) if self.fact_ids is not None else self.k

    @property
    def memoryless(self) -> bool:
        """Whether it serves no memory at all: no user, mode "none", or no fact asked for."""
        return self.user is None or self.mode == "none" or (self.k == 0 and self.fact_ids is None
                                                            and self.mode != "chain")

    @property
    def scope(self) -> str:
        """The prefix-cache scope of a request without memory: its user, else its tenant's."""
        return self.user if self.user is not None else f"{self.tenant or ''}:"


@dataclass
class Prepared:
    """One request, ready for the engine."""

    prompt: Any  # vllm TokensPrompt
    params: Any  # vllm SamplingParams
    mode: str  # what is served: inject | text | chain | none
    facts: list[dict]  # [{id, text, score}] in prompt order ("source": chain | retrieval for the whole memory)
    prompt_tokens: int  # the memory prompt's (not counting a scored continuation)
    injected_tokens: int  # memory tokens planned for injection (0 unless mode is "inject" or "chain")
    timings: dict[str, float] = field(default_factory=dict)  # "search" and "compose", in seconds
    policy: str | None = None  # the recovery policy that served it (mode "inject")
    why: str = ""  # why this mode and policy (the gate's reason under mode "auto")
    dropped: dict[str, int] = field(default_factory=dict)  # {"turns": n, "facts": m} left out to fit the context
    chain: dict[str, int] | None = None  # mode "chain": {"facts": chain facts served, "stored": those from links}
    repeated: list[str] = field(default_factory=list)  # fact ids repeated as text after the whole memory

    @property
    def fact_ids(self) -> list[str]:
        return [f["id"] for f in self.facts]
