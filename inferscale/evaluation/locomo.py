"""The LoCoMo benchmark (Maharana et al., ACL 2024, CC BY-NC 4.0) as `Sample`s.

    samples = load_locomo(DEFAULT_LOCOMO_PATH, conversations=["conv-26"], categories={1, 2, 3, 4})

LoCoMo is not shipped with the project; pass the path of `locomo10.json`. Each conversation's
sessions become turns (with their dates), its `observation` facts become facts tied to the turns
they cite, and its QA pairs become questions with their evidence.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from inferscale.common.facts import Conversation, Fact, Turn, validate_id
from inferscale.evaluation.datasets import QA, Sample

DEFAULT_LOCOMO_PATH = "../shared/data/locomo/locomo10.json"

_SESSION_RE = re.compile(r"session_(\d+)")
_OBSERVATION_RE = re.compile(r"session_(\d+)_observation")
_EVENTS_RE = re.compile(r"events_session_(\d+)")
_REF_SPLIT_RE = re.compile(r"[;,\s]+")
_BAD_ID_CHARS_RE = re.compile(r"[^A-Za-z0-9_.:\-]+")
_PHOTO_PREFIX_RE = re.compile(r"^\s*(?:a\s+)?(?:photo|picture|image)\s+of\s+", re.IGNORECASE)


def load_locomo(
    path: str | os.PathLike[str] = DEFAULT_LOCOMO_PATH,
    categories: Iterable[int] = (1, 2, 3, 4),
    include_event_summaries: bool = False,
) -> list[Sample]:
    """Load the LoCoMo benchmark (`locomo10.json`) as one `Sample` per conversation.

    Args:
        path: the LoCoMo JSON file. A relative path is resolved against the current directory.
        categories: question categories to keep (1 multi-hop, 2 temporal, 3 open-domain,
            4 single-hop, 5 adversarial). Category 5 has no `answer`; when requested, its
            `adversarial_answer` is used as the answer.
        include_event_summaries: also turn each session's `event_summary` entries into facts
            (with no source turn), placed after that session's observation facts.

    Turns keep LoCoMo's `dia_id` ("D3:5") as id, with the session number and date. A turn
    whose text is empty but which shares an image becomes "[shares a photo of <caption>]";
    other empty turns are dropped. Facts come from `observation`, with ids
    "<sample_id>:o<n>" (1-based, in file order), ordered by the position of their source turn;
    a fact whose dia_id does not resolve has `source_turn=None`, keeps the raw reference in
    `meta["unresolved_source"]`, and is placed at the end of its session. Question evidence is
    split on ';', ',' and whitespace; ids that are not turns go to `unresolved_evidence`.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not JSON in LoCoMo's shape, or `categories` is invalid.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"LoCoMo file not found at {str(path)!r} (resolved to {str(p.absolute())!r}); "
            "pass the path of locomo10.json to load_locomo"
        )
    wanted = _check_categories(categories)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(raw, list):
        raise ValueError(f"{p}: expected a JSON list of LoCoMo samples, got {type(raw).__name__}")

    samples: list[Sample] = []
    seen_ids: set[str] = set()
    for i, item in enumerate(raw):
        sample = _locomo_sample(item, i, wanted, include_event_summaries, str(p))
        if sample.conversation.id in seen_ids:
            raise ValueError(f"{p}: duplicate sample id {sample.conversation.id!r}")
        seen_ids.add(sample.conversation.id)
        samples.append(sample)
    return samples


def _locomo_sample(
    item: Any, index: int, wanted: frozenset[int], include_events: bool, source: str
) -> Sample:
    where = f"{source}: sample {index}"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected an object, got {type(item).__name__}")
    for key in ("sample_id", "conversation", "qa"):
        if key not in item:
            raise ValueError(f"{where}: missing key {key!r}; is this a LoCoMo file?")
    raw_id = item["sample_id"]
    if not isinstance(raw_id, (str, int)):
        raise ValueError(f"{where}: sample_id must be a string")
    conv_id = _sanitize_id(str(raw_id), fallback=f"sample{index}")
    where = f"{source}: sample {raw_id!r}"

    conv = item["conversation"]
    if not isinstance(conv, dict):
        raise ValueError(f"{where}: 'conversation' must be an object")
    speakers = tuple(
        s for s in (conv.get("speaker_a"), conv.get("speaker_b")) if isinstance(s, str) and s
    )

    # Sessions, ordered numerically (session_10 after session_9).
    sessions: list[tuple[int, list[Any]]] = []
    for key, value in conv.items():
        m = _SESSION_RE.fullmatch(key)
        if m is None:
            continue
        if not isinstance(value, list):
            raise ValueError(f"{where}: {key!r} must be a list of turns")
        sessions.append((int(m.group(1)), value))
    if not sessions:
        raise ValueError(f"{where}: 'conversation' has no session_N entries")
    sessions.sort(key=lambda s: s[0])

    turns: list[Turn] = []
    session_dates: dict[int, str | None] = {}
    last_turn_of_session: dict[int, int] = {}  # session -> index of its last turn
    for n, raw_turns in sessions:
        date = conv.get(f"session_{n}_date_time")
        session_dates[n] = date if isinstance(date, str) and date.strip() else None
        for t in raw_turns:
            turn = _locomo_turn(t, n, session_dates[n], f"{where}: session_{n}")
            if turn is not None:
                turns.append(turn)
        last_turn_of_session[n] = len(turns) - 1
    turn_pos = {}
    for i, t in enumerate(turns):
        if t.id in turn_pos:
            raise ValueError(f"{where}: duplicate dia_id {t.id!r}")
        turn_pos[t.id] = i

    facts = _locomo_facts(
        item, conv_id, session_dates, turn_pos, last_turn_of_session, include_events, where
    )
    questions = _locomo_questions(item["qa"], wanted, turn_pos, where)
    conversation = Conversation(id=conv_id, turns=turns, facts=facts, speakers=speakers)
    return Sample(conversation=conversation, questions=questions)


def _locomo_turn(t: Any, session: int, date: str | None, where: str) -> Turn | None:
    if not isinstance(t, dict):
        raise ValueError(f"{where}: every turn must be an object")
    dia_id = t.get("dia_id")
    speaker = t.get("speaker")
    if not isinstance(dia_id, str) or not isinstance(speaker, str):
        raise ValueError(f"{where}: every turn needs string 'dia_id' and 'speaker'")
    text = t.get("text")
    text = text.strip() if isinstance(text, str) else ""
    if not text:
        caption = t.get("blip_caption")
        caption = caption.strip() if isinstance(caption, str) else ""
        if not caption:
            return None
        caption = _PHOTO_PREFIX_RE.sub("", caption) or caption
        text = f"[shares a photo of {caption}]"
    try:
        return Turn(id=dia_id, speaker=speaker, text=text, session=session, date=date)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _locomo_facts(
    item: dict,
    conv_id: str,
    session_dates: dict[int, str | None],
    turn_pos: dict[str, int],
    last_turn_of_session: dict[int, int],
    include_events: bool,
    where: str,
) -> list[Fact]:
    # Each entry: (sort key, Fact). Sort key = (position, after-turn flag, running order).
    keyed: list[tuple[tuple[int, int, int], Fact]] = []
    order = 0

    def end_of_session(n: int) -> int:
        """Index of the last turn at or before session n (-1 if none)."""
        best = -1
        for s, last in last_turn_of_session.items():
            if s <= n:
                best = max(best, last)
        return best

    observation = item.get("observation") or {}
    if not isinstance(observation, dict):
        raise ValueError(f"{where}: 'observation' must be an object")
    obs_sessions = []
    for key, value in observation.items():
        m = _OBSERVATION_RE.fullmatch(key)
        if m is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key!r} must map speakers to lists of facts")
        obs_sessions.append((int(m.group(1)), value))
    obs_sessions.sort(key=lambda s: s[0])

    count = 0
    for n, by_speaker in obs_sessions:
        for speaker, entries in by_speaker.items():
            if not isinstance(entries, list):
                raise ValueError(f"{where}: session_{n}_observation[{speaker!r}] must be a list")
            for entry in entries:
                if not isinstance(entry, (list, tuple)) or len(entry) < 1:
                    raise ValueError(
                        f"{where}: session_{n}_observation entries must be [text, dia_id]"
                    )
                text = entry[0]
                ref = entry[1] if len(entry) > 1 else None
                if not isinstance(text, str) or not text.strip():
                    continue
                count += 1
                source = _first_resolving(ref, turn_pos)
                meta: dict[str, Any] = {
                    "speaker": speaker,
                    "session": n,
                    "kind": "observation",
                }
                if source is None:
                    meta["unresolved_source"] = ref
                    key = (end_of_session(n), 1, order)
                else:
                    key = (turn_pos[source], 0, order)
                order += 1
                fact = Fact(
                    id=f"{conv_id}:o{count}",
                    text=text.strip(),
                    source_turn=source,
                    date=session_dates.get(n),
                    metadata=meta,
                )
                keyed.append((key, fact))

    if include_events:
        events = item.get("event_summary") or {}
        if not isinstance(events, dict):
            raise ValueError(f"{where}: 'event_summary' must be an object")
        ev_sessions = []
        for key, value in events.items():
            m = _EVENTS_RE.fullmatch(key)
            if m is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {key!r} must be an object")
            ev_sessions.append((int(m.group(1)), value))
        ev_sessions.sort(key=lambda s: s[0])
        count = 0
        for n, by_speaker in ev_sessions:
            date = by_speaker.get("date")
            if not isinstance(date, str) or not date.strip():
                date = session_dates.get(n)
            for speaker, texts in by_speaker.items():
                if speaker == "date":
                    continue
                if not isinstance(texts, list):
                    raise ValueError(f"{where}: events_session_{n}[{speaker!r}] must be a list")
                for text in texts:
                    if not isinstance(text, str) or not text.strip():
                        continue
                    count += 1
                    fact = Fact(
                        id=f"{conv_id}:e{count}",
                        text=text.strip(),
                        source_turn=None,
                        date=date,
                        metadata={"speaker": speaker, "session": n, "kind": "event_summary"},
                    )
                    keyed.append(((end_of_session(n), 2, order), fact))
                    order += 1

    keyed.sort(key=lambda kf: kf[0])
    return [f for _, f in keyed]


def _locomo_questions(
    qa: Any, wanted: frozenset[int], turn_pos: dict[str, int], where: str
) -> list[QA]:
    if not isinstance(qa, list):
        raise ValueError(f"{where}: 'qa' must be a list")
    out: list[QA] = []
    for j, q in enumerate(qa):
        q_where = f"{where}: qa[{j}]"
        if not isinstance(q, dict):
            raise ValueError(f"{q_where}: expected an object")
        category = q.get("category")
        if not isinstance(category, int) or isinstance(category, bool):
            raise ValueError(f"{q_where}: 'category' must be an integer")
        if category not in wanted:
            continue
        question = q.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{q_where}: missing 'question'")
        answer_key = "adversarial_answer" if category == 5 else "answer"
        answer = q.get(answer_key)
        if answer is None and category == 5:
            answer = q.get("answer")
        if answer is None or isinstance(answer, (dict, list)):
            raise ValueError(f"{q_where}: missing {answer_key!r}")
        resolved: list[str] = []
        unresolved: list[str] = []
        raw_evidence = q.get("evidence") or []
        if isinstance(raw_evidence, str):
            raw_evidence = [raw_evidence]
        if not isinstance(raw_evidence, list):
            raise ValueError(f"{q_where}: 'evidence' must be a list")
        for ref in _split_refs(raw_evidence):
            bucket = resolved if ref in turn_pos else unresolved
            if ref not in bucket:
                bucket.append(ref)
        out.append(
            QA(
                question=question.strip(),
                answer=str(answer),
                category=category,
                evidence=tuple(resolved),
                unresolved_evidence=tuple(unresolved),
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _check_categories(categories: Iterable[int]) -> frozenset[int]:
    try:
        wanted = frozenset(categories)
    except TypeError:
        raise ValueError(
            f"categories must be an iterable of ints 1-5, got {categories!r}"
        ) from None
    bad = [c for c in wanted if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= 5]
    if bad:
        raise ValueError(f"unknown LoCoMo question categories {sorted(map(repr, bad))}; use 1-5")
    return wanted


def _split_refs(refs: Iterable[Any]) -> list[str]:
    """Flatten dia_id references: lists, and strings like "D8:6; D9:17" or "D1:2 D1:3"."""
    out: list[str] = []
    for ref in refs:
        if isinstance(ref, (list, tuple)):
            out.extend(_split_refs(ref))
        elif ref is not None:
            out.extend(part for part in _REF_SPLIT_RE.split(str(ref)) if part)
    return out


def _first_resolving(ref: Any, turn_pos: dict[str, int]) -> str | None:
    for part in _split_refs([ref]):
        if part in turn_pos:
            return part
    return None


def _sanitize_id(value: str, fallback: str) -> str:
    """Turn a dataset's sample id into one `validate_id` accepts."""
    cleaned = _BAD_ID_CHARS_RE.sub("_", value.strip()).lstrip("_.:-")[:100]
    if not cleaned:
        cleaned = fallback
    return validate_id("conversation", cleaned)
