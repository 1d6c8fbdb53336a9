"""Facts, turns, conversations, and Context-Window Encoding planning.

A conversation is an ordered list of turns (possibly spanning several sessions). A fact is a short
sentence distilled from the conversation and tied to the turn it came from. Context-Window
Encoding runs each fact through the model after the `w` turns that came before its source turn,
crossing session boundaries; `context_window` is that plan, in plain Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from inferscale.common.prompt.conversation_pass import span_start
from inferscale.common.bounds import check_time
from inferscale.common.metadata import check_metadata, check_number

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")  # matched with fullmatch ("$" admits a final "\n")


MAX_SESSION = 2**31 - 1


def validate_id(kind: str, value: str) -> str:
    """Return `value` if it is a safe identifier (letters, digits, `_.:-`, <= 128 chars)."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(
            f"invalid {kind} id {value!r}: use 1-128 letters, digits or '_.:-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class Turn:
    """One utterance of a conversation."""

    id: str
    speaker: str
    text: str
    session: int = 0
    date: str | None = None  # the session's date as the dataset writes it

    def __post_init__(self) -> None:
        validate_id("turn", self.id)
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"turn {self.id!r} has empty text")
        if not isinstance(self.speaker, str) or not self.speaker.strip():
            raise ValueError(f"turn {self.id!r} has no speaker")
        if isinstance(self.session, bool) or not isinstance(self.session, int) or not 0 <= self.session <= MAX_SESSION:
            raise ValueError(f"turn {self.id!r}: session must be an integer in [0, {MAX_SESSION}], got {self.session!r}")

    def render(self) -> str:
        return f"{self.speaker}: {self.text}"


@dataclass(frozen=True)
class Fact:
    """A memory: one short sentence tied to the turn it was distilled from."""

    id: str
    text: str
    source_turn: str | None = None
    date: str | None = None
    # filterable key-values (`inferscale.common.metadata`: strings, numbers, booleans, lists of strings)
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
    # UTC epoch seconds (within `bounds.TIME_RANGE`): from then on the fact is never read, then swept
    expires_at: float | None = None

    def __post_init__(self) -> None:
        validate_id("fact", self.id)
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"fact {self.id!r} has empty text")
        object.__setattr__(self, "metadata", check_metadata(self.metadata, f"fact {self.id!r} metadata"))
        if self.expires_at is not None:
            where = f"fact {self.id!r} expires_at"
            object.__setattr__(self, "expires_at", check_time(float(check_number(self.expires_at, where)), where))


@dataclass
class Conversation:
    """Ordered turns plus the facts distilled from them."""

    id: str
    turns: list[Turn]
    facts: list[Fact] = field(default_factory=list)
    speakers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate_id("conversation", self.id)
        self._index = {}
        for i, t in enumerate(self.turns):
            if t.id in self._index:
                raise ValueError(f"conversation {self.id!r}: duplicate turn id {t.id!r}")
            self._index[t.id] = i
        seen = set()
        for f in self.facts:
            if f.id in seen:
                raise ValueError(f"conversation {self.id!r}: duplicate fact id {f.id!r}")
            seen.add(f.id)
            if f.source_turn is not None and f.source_turn not in self._index:
                raise ValueError(
                    f"fact {f.id!r} names source turn {f.source_turn!r}, "
                    f"which conversation {self.id!r} does not have"
                )

    def turn_index(self, turn_id: str) -> int:
        try:
            return self._index[turn_id]
        except KeyError:
            raise KeyError(f"conversation {self.id!r} has no turn {turn_id!r}") from None

    def fact(self, fact_id: str) -> Fact:
        for f in self.facts:
            if f.id == fact_id:
                return f
        raise KeyError(f"conversation {self.id!r} has no fact {fact_id!r}")

    def context_window(self, fact: Fact, w: int) -> list[Turn]:
        """The `w` turns strictly before `fact`'s source turn (fewer at the start).

        Sessions are one ordered stream, so a window crosses session boundaries. A fact without a
        source turn gets an empty window.
        """
        if w < 0:
            raise ValueError(f"context window w must be >= 0, got {w}")
        if w == 0 or fact.source_turn is None:
            return []
        end = self.turn_index(fact.source_turn)
        return self.turns[max(0, end - w) : end]

    def context_span(self, fact: Fact, w: int) -> list[Turn]:
        """The turns the conversation encoding reads `fact`'s window from: from the start of the
        block of `w` turns before the one that holds its window's end, up to its source turn
        (`conversation_pass.span_start`); its last `w` turns are `context_window`."""
        if w < 0:
            raise ValueError(f"context window w must be >= 0, got {w}")
        if w == 0 or fact.source_turn is None:
            return []
        end = self.turn_index(fact.source_turn)
        return self.turns[span_start(end, w) : end]
