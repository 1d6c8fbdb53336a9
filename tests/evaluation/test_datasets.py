"""Tests for inferscale.evaluation.datasets: the packaged demo and the LoCoMo loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferscale.evaluation.datasets import QA, Sample, load_demo

from inferscale.evaluation.locomo import load_locomo
from inferscale.common.facts import validate_id

LOCOMO_PATH = Path(__file__).resolve().parents[2].parent / "shared/data/locomo/locomo10.json"


# --------------------------------------------------------------------------------------------
# Demo
# --------------------------------------------------------------------------------------------


def test_the_packaged_assistant_conversations_are_complete_and_grounded():
    """The calibration's second kind of conversation (a user and their assistant over months):
    every fact and every question's evidence is one of the user's own turns, dates increase."""
    from importlib import resources

    path = resources.files("inferscale.evaluation") / "data" / "assistant_conversations.json"
    samples = load_locomo(str(path))
    assert [s.conversation.id for s in samples] == ["asst-1", "asst-2"]
    for s in samples:
        conv = s.conversation
        user = conv.speakers[0]
        assert conv.speakers[1] == "Assistant" and len(conv.facts) >= 100 and len(conv.turns) >= 180
        by_id = {t.id: t for t in conv.turns}
        assert all(f.source_turn is not None and by_id[f.source_turn].speaker == user for f in conv.facts)
        assert len(s.questions) == 45 and {q.category for q in s.questions} == {1, 2, 3, 4}
        for q in s.questions:
            assert q.evidence and not q.unresolved_evidence and q.answer
            assert all(by_id[e].speaker == user for e in q.evidence)
        sessions = sorted({t.session for t in conv.turns})
        assert sessions == list(range(1, 11))


def test_demo_shape():
    sample = load_demo()
    assert isinstance(sample, Sample)
    conv = sample.conversation
    assert conv.id == "demo"
    assert conv.speakers == ("Maya", "Tom")
    assert 36 <= len(conv.turns) <= 44
    assert 26 <= len(conv.facts) <= 34
    assert len(sample.questions) == 5
    assert {t.session for t in conv.turns} == {1, 2, 3}
    assert all(t.speaker in conv.speakers for t in conv.turns)
    # Turns carry their session's date; sessions are in order.
    assert [t.session for t in conv.turns] == sorted(t.session for t in conv.turns)
    assert all(t.date for t in conv.turns)


def test_demo_facts_resolve_and_dates():
    conv = load_demo().conversation
    for fact in conv.facts:
        assert fact.source_turn is not None
        turn = conv.turns[conv.turn_index(fact.source_turn)]
        assert fact.date == turn.date


def test_demo_questions():
    sample = load_demo()
    conv = sample.conversation
    turn_ids = {t.id for t in conv.turns}
    for qa in sample.questions:
        assert isinstance(qa, QA)
        assert qa.category == 4
        assert isinstance(qa.answer, str) and qa.answer
        assert qa.evidence and set(qa.evidence) <= turn_ids
        assert qa.unresolved_evidence == ()


def test_demo_context_window():
    conv = load_demo().conversation
    for fact in conv.facts:
        window = conv.context_window(fact, 5)
        end = conv.turn_index(fact.source_turn)
        assert window == conv.turns[max(0, end - 5) : end]
        assert fact.source_turn not in {t.id for t in window}

    # A fact from one of session 2's first turns: its window reaches back into session 1.
    early_s2 = [
        f
        for f in conv.facts
        if conv.turns[conv.turn_index(f.source_turn)].session == 2
        and conv.turn_index(f.source_turn) - conv.turn_index("S2:1") < 4
    ]
    assert early_s2, "the demo needs a fact from session 2's first turns"
    fact = early_s2[0]
    window = conv.context_window(fact, 5)
    assert len(window) == 5
    assert {t.session for t in window} == {1, 2}
    end = conv.turn_index(fact.source_turn)
    assert [conv.turn_index(t.id) for t in window] == list(range(end - 5, end))


# --------------------------------------------------------------------------------------------
# LoCoMo quirks, on a small hand-written file in LoCoMo's format
# --------------------------------------------------------------------------------------------


def _turns(session: int, n: int, speakers=("Ann", "Bob")) -> list[dict]:
    return [
        {"speaker": speakers[i % 2], "dia_id": f"D{session}:{i + 1}", "text": f"s{session} {i}"}
        for i in range(n)
    ]


def _mini_locomo() -> list[dict]:
    s1 = _turns(1, 3)
    # An image-only turn and an empty turn without caption (dropped).
    s1.append(
        {
            "speaker": "Bob",
            "dia_id": "D1:4",
            "text": "",
            "img_url": ["https://example.invalid/x.jpg"],
            "blip_caption": "a photo of a red kite over a beach",
        }
    )
    s1.append({"speaker": "Ann", "dia_id": "D1:5", "text": "   "})
    s2 = _turns(2, 3)
    s10 = _turns(10, 2)
    conversation = {
        "speaker_a": "Ann",
        "speaker_b": "Bob",
        # Keys deliberately out of numeric order: session_10 must come after session_2.
        "session_10_date_time": "1:00 pm on 10 June, 2023",
        "session_10": s10,
        "session_1_date_time": "9:00 am on 1 May, 2023",
        "session_1": s1,
        "session_2_date_time": "5:30 pm on 8 May, 2023",
        "session_2": s2,
    }
    observation = {
        "session_10_observation": {"Ann": [["Ann flew a kite in June.", "D10:1"]]},
        "session_1_observation": {
            "Ann": [["Ann likes kites.", "D1:3"], ["Ann has a dog.", "D1:1"]],
            "Bob": [
                ["Bob went to the beach.", "D1:4"],
                ["Bob mentioned a turn that does not exist.", "D1:99"],
                ["Bob mentioned several turns.", "D1:77; D1:2"],
            ],
        },
        "session_2_observation": {
            "Bob": [["Bob likes tea.", ["D2:3", "D2:1"]], ["Bob spoke twice.", "D2:2, D2:3"]]
        },
    }
    qa = [
        {"question": "How many kites?", "answer": 2, "evidence": ["D1:3"], "category": 1},
        {"question": "Is Ann an ally?", "answer": "Likely yes", "evidence": [], "category": 3},
        {
            "question": "When did Ann fly a kite?",
            "answer": "June 2023",
            "evidence": ["D10:1", "D10:19", "D:1:3"],
            "category": 2,
        },
        {
            "question": "What did Bob like?",
            "answer": "tea",
            "evidence": ["D2:3; D2:1", "D1:1 D1:2"],
            "category": 4,
        },
        {
            "question": "Did Bob fly the kite?",
            "adversarial_answer": "Yes",
            "evidence": ["D10:1"],
            "category": 5,
        },
    ]
    event_summary = {
        "events_session_1": {"Ann": ["Ann buys a kite."], "Bob": [], "date": "1 May, 2023"},
        "events_session_2": {"Ann": [], "Bob": ["Bob makes tea."], "date": "8 May, 2023"},
        "events_session_10": {"Ann": ["Ann flies the kite."], "Bob": [], "date": "10 June, 2023"},
    }
    return [
        {
            "qa": qa,
            "conversation": conversation,
            "event_summary": event_summary,
            "observation": observation,
            "session_summary": {"session_1_summary": "Ann and Bob talk about kites."},
            "sample_id": "conv 1/x",  # not a valid id as is: must be sanitized
        }
    ]


@pytest.fixture
def mini_path(tmp_path: Path) -> Path:
    p = tmp_path / "mini_locomo.json"
    p.write_text(json.dumps(_mini_locomo()), encoding="utf-8")
    return p


def test_locomo_turns_and_sessions(mini_path: Path):
    (sample,) = load_locomo(mini_path)
    conv = sample.conversation
    validate_id("conversation", conv.id)
    assert conv.speakers == ("Ann", "Bob")
    ids = [t.id for t in conv.turns]
    # session_10 after session_2; the empty turn without a caption is dropped.
    assert ids == ["D1:1", "D1:2", "D1:3", "D1:4", "D2:1", "D2:2", "D2:3", "D10:1", "D10:2"]
    assert [t.session for t in conv.turns] == [1, 1, 1, 1, 2, 2, 2, 10, 10]
    assert conv.turns[0].date == "9:00 am on 1 May, 2023"
    assert conv.turns[-1].date == "1:00 pm on 10 June, 2023"
    image_turn = conv.turns[3]
    assert image_turn.text.startswith("[shares a photo of ")
    assert "red kite over a beach" in image_turn.text
    # The window of a session-10 fact crosses back into session 2.
    fact = next(f for f in conv.facts if f.source_turn == "D10:1")
    assert [t.id for t in conv.context_window(fact, 2)] == ["D2:2", "D2:3"]


def test_locomo_facts(mini_path: Path):
    (sample,) = load_locomo(mini_path)
    conv = sample.conversation
    facts = conv.facts
    assert len(facts) == 8
    for f in facts:
        validate_id("fact", f.id)
        assert f.id.startswith(conv.id + ":o")
    by_text = {f.text: f for f in facts}

    unresolved = by_text["Bob mentioned a turn that does not exist."]
    assert unresolved.source_turn is None
    assert unresolved.metadata["unresolved_source"] == "D1:99"
    assert by_text["Bob mentioned several turns."].source_turn == "D1:2"
    assert by_text["Bob likes tea."].source_turn == "D2:3"
    assert by_text["Bob spoke twice."].source_turn == "D2:2"
    f = by_text["Bob went to the beach."]
    assert f.date == "9:00 am on 1 May, 2023"
    assert f.metadata["speaker"] == "Bob" and f.metadata["session"] == 1
    assert by_text["Ann flew a kite in June."].metadata["session"] == 10

    # Ordered by source turn position; the unresolved fact ends its session.
    assert [f.source_turn for f in facts] == [
        "D1:1", "D1:2", "D1:3", "D1:4", None, "D2:2", "D2:3", "D10:1",
    ]  # fmt: skip
    assert facts[4] is unresolved


def test_locomo_event_summaries(mini_path: Path):
    (plain,) = load_locomo(mini_path)
    (sample,) = load_locomo(mini_path, include_event_summaries=True)
    facts = sample.conversation.facts
    events = [f for f in facts if f.metadata.get("kind") == "event_summary"]
    assert len(facts) == len(plain.conversation.facts) + 3
    assert [f.text for f in events] == ["Ann buys a kite.", "Bob makes tea.", "Ann flies the kite."]
    assert all(f.source_turn is None for f in events)
    assert len({f.id for f in facts}) == len(facts)
    # Each event fact sits at the end of its own session.
    pos = {f.id: i for i, f in enumerate(facts)}
    tea = next(f for f in events if f.text == "Bob makes tea.")
    assert facts[pos[tea.id] - 1].source_turn == "D2:3"
    assert facts[pos[tea.id] + 1].source_turn == "D10:1"


def test_locomo_questions(mini_path: Path):
    (sample,) = load_locomo(mini_path)
    qs = {q.question: q for q in sample.questions}
    assert len(qs) == 4  # category 5 excluded by default
    assert "Did Bob fly the kite?" not in qs

    kites = qs["How many kites?"]
    assert kites.answer == "2" and isinstance(kites.answer, str)
    assert kites.evidence == ("D1:3",)

    ally = qs["Is Ann an ally?"]
    assert ally.evidence == () and ally.unresolved_evidence == ()

    when = qs["When did Ann fly a kite?"]
    assert when.evidence == ("D10:1",)
    assert when.unresolved_evidence == ("D10:19", "D:1:3")

    tea = qs["What did Bob like?"]
    assert tea.evidence == ("D2:3", "D2:1", "D1:1", "D1:2")


def test_locomo_categories(mini_path: Path):
    (only2,) = load_locomo(mini_path, categories=(2,))
    assert [q.category for q in only2.questions] == [2]
    (with5,) = load_locomo(mini_path, categories=(1, 2, 3, 4, 5))
    adv = [q for q in with5.questions if q.category == 5]
    assert len(adv) == 1 and adv[0].answer == "Yes"
    with pytest.raises(ValueError):
        load_locomo(mini_path, categories=(6,))


def test_locomo_missing_file(tmp_path: Path):
    missing = tmp_path / "nope" / "locomo10.json"
    with pytest.raises(FileNotFoundError) as info:
        load_locomo(missing)
    assert str(missing) in str(info.value)
    assert "locomo" in str(info.value).lower()


@pytest.mark.parametrize(
    "payload",
    [
        {"not": "a list"},
        [["not", "a", "dict"]],
        [{"sample_id": "x", "qa": []}],  # no conversation
        [{"sample_id": "x", "qa": [], "conversation": {"speaker_a": "A"}}],  # no sessions
    ],
)
def test_locomo_bad_shape(tmp_path: Path, payload):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(payload), encoding="utf-8")
    with pytest.raises(ValueError):
        load_locomo(p)


def test_locomo_not_json(tmp_path: Path):
    p = tmp_path / "bad.json"
    p.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json"):
        load_locomo(p)


# --------------------------------------------------------------------------------------------
# The real LoCoMo file, when the checkout has it
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not LOCOMO_PATH.is_file(), reason=f"LoCoMo not found at {LOCOMO_PATH}")
def test_real_locomo_counts():
    samples = load_locomo(LOCOMO_PATH)
    assert len(samples) == 10
    assert sum(len(s.questions) for s in samples) == 1540
    assert sum(len(s.conversation.facts) for s in samples) == 2541
    for s in samples:
        conv = s.conversation
        assert len(conv.speakers) == 2
        sessions = [t.session for t in conv.turns]
        assert sessions == sorted(sessions)
        turn_ids = {t.id for t in conv.turns}
        for q in s.questions:
            assert isinstance(q.answer, str)
            assert q.category in (1, 2, 3, 4)
            assert set(q.evidence) <= turn_ids
