"""Prompt layout: `[header][fact_1]...[fact_k][footer][question]` with serving positions, or for a
chat, one of two `CHAT_LAYOUTS`; with `boundary=True` a computed `[boundary]` follows the last fact
(`BOUNDARY`: where the memory ends and what to do with it, so that an answer does not continue the
fact list). A whole-memory prompt may repeat its few most relevant facts as text after the memory
(`repeat_ids`, computed), next to the question.

The chat template is rendered once with placeholders and split into a header (template start +
memory preamble), a footer (end of the system turn + start of the user turn) and a tail (end of
the user turn + generation prompt). Chats are laid out in one of two ways:

- "history-first" (`history_ids`, the default): `[system][earlier turns][start of the new user
  turn][memory][the new message]`. The memory sits inside the new user turn, under `MEMORY_LABEL`,
  and the system turn opens with `CHAT_PREAMBLE`. Everything before the memory is the same tokens
  from one turn to the next, so turn n+1 finds turn n's conversation in the engine's prefix cache
  (the memory changes with every turn's retrieval and would break that prefix if it came first).
- "memory-first" (`conversation_ids`): the memory opens the first system turn, the request's own
  system prompts follow it inside that turn, then every earlier turn and the new message.

Facts keep the exact token ids they were encoded with, so the served prompt is the concatenation of
token ids, never a re-tokenisation of text. Positions are contiguous from 0. Each segment is marked
"inject" (its KV comes from the store or a precomputed cache) or "compute" (prefilled by the
engine); `inject_mask` is that, per token, and recovery policies (`recovery.py`) flip memory tokens
to "compute". The engines execute a mask: computed positions may come before, between or after
injected ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from inferscale.common.prompt.conversation_pass import SpanItem

if TYPE_CHECKING:
    from inferscale.common.facts import Fact, Turn

DEFAULT_PREAMBLE = (
    "You are a helpful assistant with a long-term memory of the user. "
    "Answer the user's question briefly, using these remembered facts:\n"
)
BOUNDARY = "(End of the remembered facts. Use them to answer; do not repeat the list.)\n"
# the system turn's opening in a history-first chat, and what heads the memory in the user's turn
CHAT_PREAMBLE = ("You are a helpful assistant with a long-term memory of the user. The user's message begins "
                 "with facts you remember about them; answer briefly, using them.")
MEMORY_LABEL = "Remembered facts:\n"
# heads the few most relevant facts, repeated as text after the whole memory (`repeat_ids`)
REPEAT_LABEL = "Most relevant to the question:\n"
_MEM, _Q = "\x00MEMORY\x00", "\x00QUESTION\x00"

Tokenize = Callable[[str], list[int]]
RenderChat = Callable[[list[dict]], str]  # messages -> text, with the generation prompt


@dataclass(frozen=True)
class Segment:
    kind: str  # "header" | "fact" | "boundary" | "repeat" | "footer" | "question" | "conversation" | "history" | "message"
    token_ids: tuple[int, ...]
    start: int  # serving position of the first token
    action: str  # "inject" | "compute"
    fact_id: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class PromptLayout:
    segments: tuple[Segment, ...]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def facts(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "fact"]

    def inject_mask(self) -> np.ndarray:
        """[len(self)] bool: True for tokens of "inject" segments (a policy may flip them)."""
        mask = np.zeros(len(self), dtype=bool)
        for s in self.segments:
            if s.action == "inject":
                mask[s.start : s.end] = True
        return mask

    @property
    def num_injected(self) -> int:
        """Tokens the plain layout injects (its "inject" segments: the facts, and the header where
        it is injected)."""
        return int(self.inject_mask().sum())

    def prefix_ids(self, segment: Segment) -> list[int]:
        """Every token id served before `segment` (what exact composition encodes it after)."""
        return self.token_ids[: segment.start]


class PromptBuilder:
    """Turns a chat template and a tokenizer into prompt layouts.

    tokenize: text -> token ids, without adding special tokens (the template carries them).
    render_chat: messages -> text with the assistant generation prompt appended.
    """

    def __init__(
        self,
        tokenize: Tokenize,
        render_chat: RenderChat,
        max_context: int,
        preamble: str = DEFAULT_PREAMBLE,
        chat_preamble: str = CHAT_PREAMBLE,
    ) -> None:
        if max_context <= 0:
            raise ValueError(f"max_context must be > 0, got {max_context}")
        self.tokenize = tokenize
        self.max_context = max_context
        text = render_chat(
            [{"role": "system", "content": preamble + _MEM}, {"role": "user", "content": _Q}]
        )
        if text.count(_MEM) != 1 or text.count(_Q) != 1 or text.index(_MEM) > text.index(_Q):
            raise ValueError("chat template does not keep the system and user contents in order")
        head, rest = text.split(_MEM)
        self._footer_text, self._tail_text = rest.split(_Q)
        self._head_text, self._preamble, self._render = head, preamble, render_chat
        self._chat_preamble = chat_preamble
        self.header_ids = tuple(tokenize(head))
        self.footer_ids = tuple(tokenize(self._footer_text))
        self.boundary_ids = tuple(tokenize(BOUNDARY))
        self.repeat_label_ids = tuple(tokenize(REPEAT_LABEL))

    @classmethod
    def for_tokenizer(cls, tokenizer, max_context: int, preamble: str = DEFAULT_PREAMBLE) -> "PromptBuilder":
        """A builder over a Hugging Face tokenizer (anything with `encode` and `apply_chat_template`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        return cls(
            tokenize=lambda s: tokenizer.encode(s, add_special_tokens=False),
            render_chat=lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            max_context=max_context,
            preamble=preamble,
        )

    @staticmethod
    def fact_text(text: str, date: str | None = None) -> str:
        """How one fact reads inside the memory block."""
        text = " ".join(text.split())
        return f"- ({date}) {text}\n" if date else f"- {text}\n"

    def fact_ids(self, text: str, date: str | None = None) -> list[int]:
        if not text or not text.strip():
            raise ValueError("a fact must have non-empty text")
        ids = self.tokenize(self.fact_text(text, date))
        if len(ids) + len(self.header_ids) + len(self.footer_ids) >= self.max_context:
            raise ValueError(
                f"fact of {len(ids)} tokens does not fit the model's context of "
                f"{self.max_context} tokens with the prompt header and footer"
            )
        return ids

    def window_ids(self, turns: Sequence["Turn"]) -> list[int]:
        """Tokens a fact is encoded after: the prompt header, then its window turns."""
        text = "".join(f"{t.render()}\n" for t in turns)
        return list(self.header_ids) + (self.tokenize(text) if text else [])

    def encode_plan(self, text: str, date: str | None, turns: Sequence["Turn"]) -> tuple[list[int], list[int]]:
        """(context ids, fact ids) for Context-Window Encoding of one fact, shared by both encoders.

        When window + fact overflow the context, the header stays and the oldest window tokens go.
        """
        ids = self.fact_ids(text, date)
        ctx = self.window_ids(turns)
        n_head = len(self.header_ids)
        room = self.max_context - len(ids) - n_head
        if len(ctx) - n_head > room:
            ctx = ctx[:n_head] + ctx[len(ctx) - room:]
        return ctx, ids

    def list_plan(self, text: str, date: str | None, previous: Sequence[tuple[str, str | None]]) -> tuple[list[int], list[int]]:
        """(context ids, fact ids) for list-context encoding: the fact after the header and the
        `previous` facts ((text, date), in memory order) rendered as the memory block renders them,
        so its KV has seen a list like the one it is served in. The oldest go first on overflow."""
        ids = self.fact_ids(text, date)
        ctx = [t for p_text, p_date in previous for t in self.fact_ids(p_text, p_date)]
        room = self.max_context - len(ids) - len(self.header_ids)
        return list(self.header_ids) + ctx[max(0, len(ctx) - room):], ids

    def windowed_plans(self, facts: Sequence["Fact"], windows: Sequence[Sequence["Turn"]]) -> list[tuple[list[int], list[int]]]:
        """`encode_plan` of each fact after its window turns (both encoders' Context-Window Encoding)."""
        if len(facts) != len(windows):
            raise ValueError(f"{len(facts)} facts but {len(windows)} windows")
        return [self.encode_plan(f.text, f.date, turns) for f, turns in zip(facts, windows)]

    def span_items(self, facts: Sequence["Fact"], spans: Sequence[Sequence["Turn"]], w: int) -> list["SpanItem"]:
        """Each fact with its span (`conversation_pass.span_start`), turns tokenized one by one,
        for the conversation encoding; the window is the span's last `w` turns."""
        if len(facts) != len(spans):
            raise ValueError(f"{len(facts)} facts but {len(spans)} spans")
        ids: dict = {}  # a turn is tokenized once per batch
        out = []
        for f, span in zip(facts, spans):
            turns = tuple(ids.setdefault(t, tuple(self.tokenize(f"{t.render()}\n"))) for t in span)
            out.append(SpanItem(turns, min(w, len(turns)), tuple(self.fact_ids(f.text, f.date))))
        return out

    def listed_plans(self, facts: Sequence["Fact"], previous: Sequence[Sequence["Fact"]]) -> list[tuple[list[int], list[int]]]:
        """`list_plan` of each fact after the facts `previous[i]` (both encoders' list-context encoding)."""
        if len(facts) != len(previous):
            raise ValueError(f"{len(facts)} facts but {len(previous)} lists of previous facts")
        return [self.list_plan(f.text, f.date, [(p.text, p.date) for p in prev]) for f, prev in zip(facts, previous)]

    def question_ids(self, question: str) -> list[int]:
        if not question or not question.strip():
            raise ValueError("the question must have non-empty text")
        return self.tokenize(question.strip() + self._tail_text)

    @staticmethod
    def _split_chat(messages: Sequence[dict]) -> tuple[list[str], list[dict]]:
        """(the system and developer prompts' texts, the other turns as {"role", "content"}) of an
        OpenAI-style chat, checked: text contents, known roles, the last a user's or a tool's."""
        system, turns = [], []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be text")
            if role in ("system", "developer"):
                if content.strip():
                    system.append(content.strip())
            elif role in ("user", "assistant", "tool"):
                turns.append({"role": role, "content": content})
            else:
                raise ValueError(f"messages[{i}].role {role!r} is not one of system, developer, user, assistant, tool")
        if not turns or turns[-1]["role"] not in ("user", "tool"):
            raise ValueError("the last message must be the user's (or a tool result)")
        if not turns[-1]["content"].strip():
            raise ValueError("the last message has no text")
        return system, turns

    def conversation_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat after the memory (memory-first): the end of the memory's system turn,
        which carries the request's own system (and developer) prompts, then the earlier turns and
        the new message and the generation prompt, as the chat template renders them. `messages` are
        OpenAI-style `{"role", "content"}` dicts with text content; the last must be the user's (or
        a tool's)."""
        system, turns = self._split_chat(messages)
        extra = "".join(f"\n\n{s}" for s in system)
        text = self._render([{"role": "system", "content": self._preamble + _MEM + extra}, *turns])
        head, sep, rest = text.partition(_MEM)
        if not sep or head != self._head_text:
            raise ValueError("the chat template does not render the memory's system turn first for these messages")
        return self.tokenize(rest)

    def history_ids(self, messages: Sequence[dict], memory: bool = True) -> tuple[list[int], list[int]]:
        """A chat laid out history-first: (the ids before the memory, the ids after it). Before: the
        system turn (`CHAT_PREAMBLE`, then the request's system and developer prompts), every
        earlier turn and the start of the last user turn, ending with `MEMORY_LABEL` when `memory`;
        after: that turn's text, any tool results after it, and the generation prompt. The ids
        before the memory of turn n+1 start with those of turn n up to its last user turn."""
        system, turns = self._split_chat(messages)
        users = [i for i, t in enumerate(turns) if t["role"] == "user"]
        if not users:
            raise ValueError("the chat has no user message to put the memory in")
        last = users[-1]
        lead = f"{MEMORY_LABEL}{_MEM}\n" if memory else _MEM
        marked = {"role": "user", "content": lead + turns[last]["content"]}
        preamble = "\n\n".join([self._chat_preamble, *system])
        text = self._render([{"role": "system", "content": preamble}, *turns[:last], marked, *turns[last + 1:]])
        head, sep, rest = text.partition(_MEM)
        if not sep or _MEM in rest or self._chat_preamble not in head:
            raise ValueError("the chat template does not render the system turn and the user's message for these "
                             "messages")
        return self.tokenize(head), self.tokenize(rest)

    def plain_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` as the chat template renders them without any memory (what
        vLLM's own chat endpoint would prefill), with the generation prompt."""
        return self.tokenize(self._render([{"role": m["role"], "content": m["content"]} for m in messages]))

    def repeat_ids(self, facts: Sequence[Sequence[int]]) -> list[int]:
        """Facts (their token ids, as the memory block renders them) repeated after the memory under
        `REPEAT_LABEL`, next to the question; none: no tokens."""
        return list(self.repeat_label_ids) + [t for f in facts for t in f] if facts else []

    def chat_layout(self, facts: Sequence[tuple[str, Sequence[int]]], conversation_ids: Sequence[int],
                    boundary: bool = False, repeat: Sequence[int] = ()) -> PromptLayout:
        """Lay out header, facts (id, token ids) in the given order, the boundary if asked, the
        repeated facts (`repeat_ids`) and the conversation (`conversation_ids`); everything after
        the facts is computed by the engine."""
        if len(conversation_ids) == 0:
            raise ValueError("the conversation has no tokens")
        return self._lay_out(facts, self._boundary(boundary) + self._repeat(repeat) +
                             [("conversation", conversation_ids)])

    def history_layout(self, facts: Sequence[tuple[str, Sequence[int]]], before: Sequence[int],
                       after: Sequence[int], boundary: bool = False) -> PromptLayout:
        """Lay out a history-first chat (`history_ids`): the conversation before the memory, the facts
        (id, token ids) in the given order, the boundary if asked, and the new message; everything
        but the facts is computed by the engine."""
        if len(after) == 0:
            raise ValueError("the new message has no tokens")
        return self._lay_out(facts, self._boundary(boundary) + [("message", after)], head=("history", before))

    def layout(
        self, facts: Sequence[tuple[str, Sequence[int]]], question_ids: Sequence[int], boundary: bool = False,
        repeat: Sequence[int] = ()
    ) -> PromptLayout:
        """Lay out header, facts (id, token ids) in the given order, the boundary if asked, the
        repeated facts (`repeat_ids`), footer and question."""
        return self._lay_out(facts, self._boundary(boundary) + self._repeat(repeat) +
                             [("footer", self.footer_ids), ("question", question_ids)])

    def _boundary(self, boundary: bool) -> list[tuple[str, Sequence[int]]]:
        return [("boundary", self.boundary_ids)] if boundary else []

    @staticmethod
    def _repeat(repeat: Sequence[int]) -> list[tuple[str, Sequence[int]]]:
        return [("repeat", repeat)] if len(repeat) else []

    def _lay_out(self, facts: Sequence[tuple[str, Sequence[int]]], tail: Sequence[tuple[str, Sequence[int]]],
                 head: tuple[str, Sequence[int]] | None = None) -> PromptLayout:
        """Segments from position 0: `head` computed (default: the header, injected), the facts
        injected, then `tail` computed."""
        segs: list[Segment] = []
        pos = 0

        def add(kind: str, ids: Sequence[int], action: str, fact_id: str | None = None) -> None:
            nonlocal pos
            segs.append(Segment(kind, tuple(map(int, ids)), pos, action, fact_id))
            pos += len(ids)

        if head is None:
            add("header", self.header_ids, "inject")
        elif len(head[1]):
            add(head[0], head[1], "compute")
        seen = set()
        for fact_id, ids in facts:
            if fact_id in seen:
                raise ValueError(f"fact {fact_id!r} appears twice in one prompt")
            if len(ids) == 0:
                raise ValueError(f"fact {fact_id!r} has no tokens")
            seen.add(fact_id)
            add("fact", ids, "inject", fact_id)
        for kind, ids in tail:
            add(kind, ids, "compute")
        if pos > self.max_context:
            raise ValueError(
                f"prompt of {pos} tokens ({len(facts)} facts) exceeds the model's context of "
                f"{self.max_context} tokens; retrieve fewer facts"
            )
        return PromptLayout(tuple(segs))


def fit_turns(messages: Sequence[dict], budget: int, render) -> tuple[list[dict], int, list[int]]:
    """(messages kept, turns dropped, their token ids): the oldest turns before the new message
    go (system prompts stay) until the rendering fits `budget` tokens or only the new message is left;
    a conversation never starts with an assistant's reply. The fewest turns that fit are found
    by bisection (a rendering only shrinks as turns go), so a long chat is rendered O(log n) times."""
    head, last = list(messages[:-1]), list(messages[-1:])
    turns = [i for i, m in enumerate(head) if m["role"] not in ("system", "developer")]

    def without(d: int) -> tuple[list[dict], int]:  # the oldest d turns gone, and replies left leading
        while 0 < d < len(turns) and head[turns[d]]["role"] == "assistant":
            d += 1
        gone = set(turns[:d])
        return [m for i, m in enumerate(head) if i not in gone] + last, d

    kept, dropped = without(0)
    ids = render(kept)
    if len(ids) <= budget or not turns:
        return kept, dropped, ids
    lo, hi = 1, len(turns)  # the answer: the least d in [lo, hi] that fits, or hi when none does
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        k, d = without(mid)
        r = render(k)
        if len(r) <= budget:
            best, hi = (k, d, r), mid - 1
        else:
            lo = mid + 1
    if best is None:
        k, d = without(len(turns))
        best = (k, d, render(k))
    return best
