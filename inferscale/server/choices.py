"""OpenAI chat-completion choices from the engine's delta outputs: per choice index its text,
finish reason and (when asked) logprobs, for the whole answer or one streamed delta.

    choices = Choices(n=2, top_logprobs=3)            # top_logprobs None: no logprobs
    for out in engine_outputs:                         # vLLM RequestOutput deltas (or RemoteOutput)
        for delta in choices.add(out.outputs):         # [(index, text, logprobs content or None)]
            ...
    choices.message_choices()                          # the non-streamed "choices" list

Logprobs come as vLLM gives them (per token a dict token id -> Logprob with `logprob`, `rank`,
`decoded_token`) or as a remote vLLM's completions endpoint gives them (`tokens`,
`token_logprobs`, `top_logprobs`); both become OpenAI's `{"token", "logprob", "bytes",
"top_logprobs"}` entries.
"""

from __future__ import annotations

from typing import Any, Sequence

MIN_LOGPROB = -9999.0  # OpenAI's floor: JSON has no -inf


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(float(logprob), MIN_LOGPROB), "bytes": list(token.encode("utf-8"))}


def from_vllm(token_ids: Sequence[int], logprobs: Sequence[dict] | None, top: int) -> list[dict]:
    """OpenAI logprobs content of one delta from vLLM's per-token dicts (token id -> Logprob)."""
    out = []
    for tid, d in zip(token_ids, logprobs or ()):
        chosen = d.get(tid)
        if chosen is None:
            continue
        entry = _entry(chosen.decoded_token or "", chosen.logprob)
        ranked = sorted((lp for t, lp in d.items() if lp.rank is not None), key=lambda lp: lp.rank)
        entry["top_logprobs"] = [_entry(lp.decoded_token or "", lp.logprob) for lp in ranked[:top]]
        out.append(entry)
    return out


def from_completions(logprobs: dict | None, top: int) -> list[dict]:
    """OpenAI chat logprobs content from a completions endpoint's `logprobs` object."""
    if not logprobs:
        return []
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens") or ())
    out = []
    for token, lp, alts in zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or (), tops):
        entry = _entry(token, lp if lp is not None else MIN_LOGPROB)
        ranked = sorted((alts or {}).items(), key=lambda kv: -kv[1])
        entry["top_logprobs"] = [_entry(t, v) for t, v in ranked[:top]]
        out.append(entry)
    return out


class Choices:
    def __init__(self, n: int = 1, top_logprobs: int | None = None) -> None:
        self.n, self.top = n, top_logprobs
        self.texts = [""] * n
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.completion_tokens = 0

    def add(self, completions: Sequence[Any]) -> list[tuple[int, str, list[dict] | None]]:
        """Take one engine output's completions (deltas); what each choice gained."""
        out = []
        for c in completions:
            i = getattr(c, "index", 0) or 0
            self.texts[i] += c.text
            self.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish[i] = c.finish_reason
            content = None
            if self.top is not None:
                if hasattr(c, "openai_logprobs"):  # a remote engine's, converted already
                    content = c.openai_logprobs or []
                else:
                    content = from_vllm(c.token_ids, c.logprobs, self.top)
                self.logprobs[i] += content
            out.append((i, c.text, content))
        return out

    def finish_reason(self, i: int) -> str:
        return self.finish[i] or "stop"

    def logprobs_of(self, content: list[dict] | None) -> dict | None:
        return None if self.top is None else {"content": content or []}

    def message_choices(self) -> list[dict]:
        return [{"index": i, "message": {"role": "assistant", "content": self.texts[i]},
                 "logprobs": self.logprobs_of(self.logprobs[i]), "finish_reason": self.finish_reason(i)}
                for i in range(self.n)]
