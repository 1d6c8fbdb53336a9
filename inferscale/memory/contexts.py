"""What each fact is encoded after, read from the catalog: its context window.

    contexts = EncodingContexts(catalog, w=5, context="turns")
    contexts.contexts("alice", facts)       # per fact: its w turns (or w facts, or its span)

Under context "turns" a fact's window is the `w` live turns strictly before its source turn;
"conversation" widens it to the span the conversation encoding reads; "facts" takes the `w`
facts added before it. Edits not committed yet (`edits`, `extra_turns`, `extra_facts`) are
folded in, so a change's windows are known before it commits. Plain Python over the catalog.
"""

from __future__ import annotations

from typing import Collection, Protocol, Sequence

from inferscale.common.prompt.conversation_pass import span_start
from inferscale.common.facts import Fact, Turn
from inferscale.common.bounds import clamp_time
from inferscale.common.metadata import loads
from inferscale.common.storage.catalog import FactRow
from inferscale.common.storage.protocols import FactRows, TurnRows


def fact_of(row: FactRow, text: str | None = None) -> Fact:
    """The `Fact` a catalog row holds (with `text` instead of its own, for an edit in flight); a
    stored expiry outside the time range (an older version's) is read clamped into it."""
    return Fact(row.fact_id, row.text if text is None else text, row.source_turn, row.date, loads(row.metadata),
                clamp_time(row.expires_at))


class ConversationRows(TurnRows, FactRows, Protocol):
    """What the encoding contexts read of the catalog: the turns and the facts."""


class EncodingContexts:
    def __init__(self, catalog: ConversationRows, w: int, context: str) -> None:
        self.catalog, self.w, self.context = catalog, w, context

    def windows(self, user: str, facts: Sequence[Fact], extra_turns: Sequence[Turn] = (),
                 edits: dict[str, str | None] | None = None, spans: bool = False,
                 deleted_turns: Collection[str] = ()) -> list[list[Turn]]:
        """Each fact's `w` live turns strictly before its source turn (in conversation order);
        with `spans`, the live turns of its span (`conversation_pass.span_start`, blocks counted
        over every turn, deleted ones included, so a deletion moves no block), which end with them.

        `extra_turns` are appended after the stored ones (those in `deleted_turns` in place, without
        text); `edits` maps turn ids to new text (None: deleted), so a change's windows are known
        before it commits.
        """
        edits = edits or {}
        turns = []
        for r in self.catalog.turns(user, include_deleted=True):
            text = edits.get(r.turn_id, r.text)
            turns.append((r.turn_id, Turn(r.turn_id, r.speaker, text, r.session, r.date) if text else None))
        turns += [(t.id, None if t.id in deleted_turns else t) for t in extra_turns]
        pos = {tid: i for i, (tid, _) in enumerate(turns)}
        out = []
        for f in facts:
            if f.source_turn is None or self.w == 0:
                out.append([])
                continue
            end = pos[f.source_turn]
            live = [(i, t) for i, (_, t) in enumerate(turns[:end]) if t is not None]
            window = live[-self.w:]
            if spans and window:
                start = min(span_start(end, self.w), window[0][0])
                out.append([t for i, t in live if i >= start])
            else:
                out.append([t for _, t in window])
        return out

    def contexts(self, user: str, facts: Sequence[Fact], extra_turns: Sequence[Turn] = (),
                  extra_facts: Sequence[Fact] = (), fact_edits: dict[str, str | None] | None = None,
                  deleted_turns: Collection[str] = ()) -> list[list]:
        """What each fact is encoded after under the configured context (`windows` or `previous`)."""
        if self.context == "facts":
            return self.previous(user, facts, extra_facts, fact_edits)
        return self.windows(user, facts, extra_turns, spans=self.context == "conversation",
                            deleted_turns=deleted_turns)

    def previous(self, user: str, facts: Sequence[Fact], extra_facts: Sequence[Fact] = (),
                  edits: dict[str, str | None] | None = None) -> list[list[Fact]]:
        """Each fact's `w` facts before it in the memory (the order facts were added).

        `extra_facts` follow the stored ones (a batch being added); `edits` maps fact ids to new
        text (None: deleted), so a change's contexts are known before it commits."""
        edits = edits or {}
        memory = [fact_of(r, edits.get(r.fact_id, r.text))
                  for r in self.catalog.facts(user) if edits.get(r.fact_id, r.text) is not None]
        memory += list(extra_facts)
        pos = {f.id: i for i, f in enumerate(memory)}
        w = self.w
        return [memory[max(0, pos[f.id] - w): pos[f.id]] if w else [] for f in facts]

    def listed_after(self, user: str, fact_id: str) -> list[FactRow]:
        """Under context "facts", the facts whose context holds `fact_id`: the `w` added after it."""
        if self.context != "facts" or self.w == 0:
            return []
        rows = self.catalog.facts(user)
        i = next(i for i, r in enumerate(rows) if r.fact_id == fact_id)
        return rows[i + 1: i + 1 + self.w]
