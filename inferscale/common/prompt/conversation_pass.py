"""Conversation encoding: each fact's window read from one pass over the conversation.

Context-Window Encoding (store context "turns") runs every fact after its own copy of the `w`
turns before its source turn, so each turn is run about once per fact whose window holds it
(w times at one fact per turn), and windows that overlap cannot share their turns: a turn's KV
depends on where its copy of the window starts. The conversation encoding (store context
"conversation") runs the turns once per block instead, with one fixed rule for what each turn sees:

- The conversation's turns are cut into blocks of `w` turns. A fact whose window ends in block b
  is encoded from its *span*: the turns from the start of block b - 1 up to its source turn
  (`span_start`; between w and 2w turns, all of them when the fact is in the first two blocks).
- A row holds the prompt header, a span and the facts read from it. Each turn attends to the
  header, to itself (causally) and to at most the `w` turns before it, none before the span's first
  turn; each fact attends to the header, its window (the last `w` turns of its span) and itself,
  at the positions right after its window.

So a fact sees exactly its window, as in turn-window encoding, and its window's turns have seen at
least what they see there (the window's turns before them) and at most `w` turns back: an
approximation of reading the window from the whole conversation's KV, not the turn-window encoding
(only the facts whose span is their window, the first `w` turns' facts, get the same KV). A fact's
KV depends only on its span's tokens, never on which other facts are encoded with it; facts whose
spans are prefixes of one another share one row. With `share=False` every fact gets a row of its
own: the reference the shared rows are tested against.

Turns are tokenized one by one here (`PromptBuilder.span_items`); turn-window encoding tokenizes a
window's text at once, which gives the same ids wherever a turn boundary is a pre-tokenizer boundary
(a line break before a speaker's name is one in the tokenizers of the supported families).

    SpanItem.turns: the span's turns, token ids each;  plan rows as `inferscale.common.prompt.packing`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from inferscale.common.prompt.packing import MIN_ROW, MaskedRow, PackedRow, PackPlan


def span_start(source: int, w: int) -> int:
    """Index of the first turn of the span of a fact whose source turn has index `source`: the
    start of the block before the one holding the window's last turn (blocks of `w` turns)."""
    if source < 0 or w < 0:
        raise ValueError(f"source and w must be >= 0, got {source} and {w}")
    if w == 0 or source == 0:
        return source
    return max(0, ((source - 1) // w - 1) * w)


@dataclass(frozen=True)
class SpanItem:
    turns: tuple[tuple[int, ...], ...]  # the span's turns in order, token ids each
    window: int  # the fact's window: the last `window` turns of the span
    fact: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.window <= len(self.turns):
            raise ValueError(f"window of {self.window} turns in a span of {len(self.turns)}")
        if not self.fact:
            raise ValueError("a span item needs fact tokens")

    def span_tokens(self, turns: int | None = None) -> int:
        return sum(len(t) for t in self.turns[: turns])

    @property
    def window_tokens(self) -> int:
        return sum(len(t) for t in self.turns[len(self.turns) - self.window:])


def _fit(header: Sequence[int], item: SpanItem, max_context: int) -> SpanItem | None:
    """`item` with its leading non-window turns dropped until it fits `max_context`; None when
    even header + window + fact do not fit (the caller clips the window's tokens instead)."""
    room = max_context - len(header) - len(item.fact)
    lead = len(item.turns) - item.window
    drop = 0
    while drop < lead and item.span_tokens() - item.span_tokens(drop) > room:
        drop += 1
    if item.span_tokens() - item.span_tokens(drop) > room:
        return None
    return SpanItem(item.turns[drop:], item.window, item.fact)


def _clipped_chain(header: Sequence[int], item: SpanItem, max_context: int) -> tuple[PackedRow, np.ndarray]:
    """A window too long for the context, as turn-window encoding clips it: the header, then the
    window's last tokens, then the fact, in plain causal order."""
    window = [t for turn in item.turns[len(item.turns) - item.window:] for t in turn]
    room = max_context - len(header) - len(item.fact)
    tokens = np.asarray(list(header) + window[len(window) - room:] + list(item.fact), np.int32)
    T = len(tokens)
    return (PackedRow(tokens, np.arange(T, dtype=np.int32), np.arange(-1, T - 1, dtype=np.int32)),
            np.arange(T - len(item.fact), T))


def _row(header: Sequence[int], span: Sequence[Sequence[int]], facts: Sequence[SpanItem],
         w: int) -> tuple[MaskedRow, list[np.ndarray]]:
    """One row: header, the span's turns, then each fact; its mask is the rule of the module
    docstring. Returns the row and each fact's token indices in it."""
    lens = [len(header)] + [len(t) for t in span] + [len(f.fact) for f in facts]
    seg = np.repeat(np.arange(len(lens)), lens)  # [T]: 0 header, 1..m turns, m+1.. facts
    m = len(span)
    see = np.zeros((len(lens), len(lens)), dtype=bool)  # segment q sees segment k (k != q: whole)
    see[:, 0] = True
    for j in range(1, m + 1):
        see[j, max(1, j - w): j] = True
    ends = np.cumsum(lens)  # ends[j]: one past segment j's last token
    positions = [np.arange(ends[m], dtype=np.int32)]
    for i, f in enumerate(facts):
        n = len(f.turns)  # its span: the row's first n turns
        see[m + 1 + i, n - f.window + 1: n + 1] = True
        positions.append(ends[n] + np.arange(len(f.fact), dtype=np.int32))
    tokens = np.asarray(list(header) + [t for turn in span for t in turn] + [t for f in facts for t in f.fact], np.int32)
    T = len(tokens)
    same = seg[:, None] == seg[None, :]
    allowed = np.where(same, np.tri(T, dtype=bool), see[seg[:, None], seg[None, :]])
    where = [np.arange(ends[m + i], ends[m + 1 + i]) for i in range(len(facts))]
    return MaskedRow(tokens, np.concatenate(positions), allowed), where


def conversation_plan(header: Sequence[int], items: Sequence[SpanItem], w: int, max_context: int,
                      row_tokens: int | None = None, share: bool = True) -> PackPlan:
    """Rows for `items` (one per fact): facts whose spans are prefixes of one another share a row
    of at most `row_tokens` tokens (default: twice the longest item, at least `MIN_ROW`, at most
    `max_context`); `share=False`: a row each. `PackPlan.item_tokens` counts what turn-window
    encoding runs for the same facts (header + window + fact each)."""
    if w < 0:
        raise ValueError(f"w must be >= 0, got {w}")
    if row_tokens is None:
        longest = max((len(header) + it.span_tokens() + len(it.fact) for it in items), default=0)
        row_tokens = min(max_context, max(MIN_ROW, 2 * longest))
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1, got {row_tokens}")
    h = len(header)
    rows: list = []
    where: list = [None] * len(items)
    fitted: list[tuple[int, SpanItem]] = []
    for i, it in enumerate(items):
        if it.window > w:
            raise ValueError(f"item {i}: a window of {it.window} turns with w={w}")
        fit = _fit(header, it, max_context)
        if fit is None:
            row, at = _clipped_chain(header, it, max_context)
            where[i] = (len(rows), at)
            rows.append(row)
        else:
            fitted.append((i, fit))
    fitted.sort(key=lambda p: p[1].turns)  # a span's extensions follow it
    group: list[tuple[int, SpanItem]] = []

    def flush() -> None:
        if group:
            row, ats = _row(header, group[-1][1].turns, [it for _, it in group], w)
            for (i, _), at in zip(group, ats):
                where[i] = (len(rows), at)
            rows.append(row)
            group.clear()

    for i, it in fitted:
        if group:
            span = group[-1][1].turns  # the longest so far (spans come in order)
            size = h + it.span_tokens() + sum(len(g.fact) for _, g in group) + len(it.fact)
            if not share or it.turns[: len(span)] != span or size > row_tokens:
                flush()
        group.append((i, it))
    flush()
    item_tokens = sum(h + it.window_tokens + len(it.fact) for it in items)
    return PackPlan(rows, where, item_tokens)
