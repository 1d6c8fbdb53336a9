"""Conversations with facts and questions: `Sample`, `QA` and the packaged demo.

Every loader (`load_demo` here, `load_locomo` in `evaluation.locomo`) returns `Sample`s: a
`Conversation` (turns in order, facts tied to their source turns) plus the questions asked about
it. Plain Python: no model or array libraries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from inferscale.common.facts import Conversation, Fact, Turn

__all__ = ["QA", "Sample", "load_demo"]


@dataclass(frozen=True)
class QA:
    """A question about a conversation, with its gold answer and evidence turn ids.

    `evidence` holds the turn ids that exist in the conversation; references that do not
    resolve to a turn are kept, as written, in `unresolved_evidence`. Either may be empty.
    """

    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]
    unresolved_evidence: tuple[str, ...] = ()


@dataclass
class Sample:
    """One conversation and the questions asked about it."""

    conversation: Conversation
    questions: list[QA]


# --------------------------------------------------------------------------------------------
# Demo conversation (packaged with the project)
# --------------------------------------------------------------------------------------------


def load_demo() -> Sample:
    """Load the small demo conversation packaged with InferScale.

    Two friends, three dated sessions (~40 turns), ~30 facts each tied to its source turn, and
    five questions answerable from the facts. Turns carry their session's index (1-based) and
    date; a fact's date is its source turn's session date. Questions get category 4
    (single-hop) and, as evidence, the source turns of their gold facts.
    """
    resource = resources.files("inferscale.evaluation") / "data" / "demo_conversation.json"
    raw = json.loads(resource.read_text(encoding="utf-8"))
    where = "demo_conversation.json"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object at the top level")

    turns: list[Turn] = []
    for s_idx, session in enumerate(_require(raw, "sessions", list, where), start=1):
        s_where = f"{where}: session {s_idx}"
        if not isinstance(session, dict):
            raise ValueError(f"{s_where}: expected an object")
        date = _require(session, "date", str, s_where)
        for t in _require(session, "turns", list, s_where):
            if not isinstance(t, dict):
                raise ValueError(f"{s_where}: every turn must be an object")
            turns.append(
                Turn(
                    id=_require(t, "id", str, s_where),
                    speaker=_require(t, "speaker", str, s_where),
                    text=_require(t, "text", str, s_where),
                    session=s_idx,
                    date=date,
                )
            )
    by_id = {t.id: t for t in turns}

    facts: list[Fact] = []
    for f in _require(raw, "facts", list, where):
        if not isinstance(f, dict):
            raise ValueError(f"{where}: every fact must be an object")
        source = f.get("source_turn")
        if source is not None and source not in by_id:
            raise ValueError(f"{where}: fact {f.get('id')!r} names unknown turn {source!r}")
        facts.append(
            Fact(
                id=_require(f, "id", str, where),
                text=_require(f, "text", str, where),
                source_turn=source,
                date=by_id[source].date if source is not None else None,
            )
        )
    fact_by_id = {f.id: f for f in facts}

    questions: list[QA] = []
    for q in _require(raw, "questions", list, where):
        if not isinstance(q, dict):
            raise ValueError(f"{where}: every question must be an object")
        evidence: list[str] = []
        for fid in _require(q, "fact_ids", list, where):
            if fid not in fact_by_id:
                raise ValueError(f"{where}: question names unknown fact {fid!r}")
            src = fact_by_id[fid].source_turn
            if src is not None and src not in evidence:
                evidence.append(src)
        questions.append(
            QA(
                question=_require(q, "question", str, where),
                answer=str(_require(q, "answer", (str, int, float), where)),
                category=4,
                evidence=tuple(evidence),
                unresolved_evidence=(),
            )
        )

    conversation = Conversation(
        id=_require(raw, "id", str, where),
        turns=turns,
        facts=facts,
        speakers=tuple(raw.get("speakers", ())),
    )
    return Sample(conversation=conversation, questions=questions)


# --------------------------------------------------------------------------------------------
# LoCoMo
# --------------------------------------------------------------------------------------------


def _require(obj: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value
