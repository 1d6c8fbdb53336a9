"""What the memory service accepts as text: plain Python checks, each a ValueError naming the item.

    limits = TextLimits(max_text_chars=32768, max_fact_tokens=512, builder=encoder.builder)
    limits.check_fact(fact); limits.check_turn(turn); limits.refusals(facts, turns)
    check_new_ids(catalog, user, facts, turns, now)   # an add's ids are new, its source turns known

Texts must be non-empty, valid Unicode (JSON can spell a lone surrogate, which no tokenizer,
embedder or database takes) and at most `max_text_chars` characters (checked before anything is
tokenized). A fact is served whole inside the prompt, so with a `builder` (a `PromptBuilder`) it is
also limited in tokens, date prefix included; turns only ever appear, truncated, in encoding windows.

The bounds that do not depend on the configuration (the time range, filter depth, nodes and list
lengths, JSON depth, cursor positions) are `inferscale.common.bounds`, where the parsers of
times, filters and cursors (which live in `inferscale.common`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from inferscale.common.facts import Fact, Turn
from inferscale.common.metadata import check_unicode

if TYPE_CHECKING:
    from inferscale.memory.contexts import ConversationRows


@dataclass(frozen=True)
class TextLimits:
    max_text_chars: int
    max_fact_tokens: int
    builder: Any = None  # a PromptBuilder, or None (no token limit)

    def check_text(self, text: str | None, what: str, optional: bool = False) -> str | None:
        if optional and text is None:
            return None
        if not isinstance(text, str) or (not optional and not text.strip()):
            raise ValueError(f"{what} has empty text")
        if len(text) > self.max_text_chars:
            raise ValueError(f"{what} has {len(text)} characters; the limit is {self.max_text_chars}")
        return check_unicode(text, what)

    def check_turn(self, t: Turn) -> None:
        self.check_text(t.text, f"turn {t.id!r}")
        self.check_text(t.speaker, f"turn {t.id!r} speaker")
        self.check_text(t.date, f"turn {t.id!r} date", optional=True)

    def check_fact(self, f: Fact) -> None:
        self.check_text(f.text, f"fact {f.id!r}")
        self.check_text(f.date, f"fact {f.id!r} date", optional=True)
        if self.builder is not None:
            n = len(self.builder.fact_ids(f.text, f.date))
            if n > self.max_fact_tokens:
                raise ValueError(f"fact {f.id!r} has {n} tokens; the limit is {self.max_fact_tokens}")

    def refusals(self, facts: Sequence[Fact] = (), turns: Sequence[Turn] = ()) -> dict[str, str]:
        """Why each of these turns and facts would be refused, by "turn <id>" / "fact <id>"."""
        out = {}
        for kind, items, check in (("turn", turns, self.check_turn), ("fact", facts, self.check_fact)):
            for x in items:
                try:
                    check(x)
                except ValueError as e:
                    out[f"{kind} {x.id}"] = str(e)
        return out


def check_new_ids(catalog: "ConversationRows", user: str, facts: Sequence[Fact], turns: Sequence[Turn],
                  now: float) -> None:
    """ValueError unless every turn and fact id is new to the user (and to the add; a fact expired
    at `now` frees its id, its fact swept before the add writes), and every source turn is the
    user's or the add's."""
    known = {r.turn_id for r in catalog.turns(user, include_deleted=True)}
    new_turns = set()
    for t in turns:
        if t.id in known or t.id in new_turns:
            raise ValueError(f"user {user!r} already has turn {t.id!r}")
        new_turns.add(t.id)
    seen = set()
    have = catalog.facts_by_fact_ids(user, [f.id for f in facts], now=now)
    for f in facts:
        if f.id in seen or f.id in have:
            raise ValueError(f"user {user!r} already has fact {f.id!r}; use update()")
        seen.add(f.id)
        if f.source_turn is not None and f.source_turn not in known and f.source_turn not in new_turns:
            raise ValueError(f"fact {f.id!r} names unknown turn {f.source_turn!r}")
