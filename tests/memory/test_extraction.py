"""Facts extracted from messages (`inferscale.memory.extraction`) with a deterministic stub for the
LLM: the messages become turns, candidates name their source message, the decisions (add, update,
delete, none) run through the memory service (an update re-encodes, a delete forgets the KV), and
a retry with the same message ids duplicates nothing."""

import json

import jsonschema
import pytest

from inferscale.memory.extraction import (
    EVENTS,
    ExtractionError,
    Extractor as _Extractor,
    decide_schema,
    extract_schema,
    prompt,
    turns_from_messages,
)
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig, UnknownFactError


class StubLLM:
    """Answers extraction from a table (message text -> fact texts) and decisions from a rule:
    a new fact whose first word is "Not" deletes the listed fact it negates, one that starts like
    a listed fact updates it, an exact repeat is NONE, anything else is ADD. Every answer is
    checked against the schema it was asked under, as constrained decoding guarantees."""

    def __init__(self, facts_of: dict[str, list[str]]):
        self.facts_of, self.calls = facts_of, []

    def complete_json(self, messages, schema, max_tokens):
        self.calls.append((messages, schema))
        system, user = messages[0]["content"], messages[1]["content"]
        if system == prompt("extract"):
            numbered = [ln.split(". ", 1) for ln in user.split("\n")[1:] if not ln.startswith("Written on ")]
            facts = [{"text": t, "message": int(n)} for n, ln in numbered
                     for t in self.facts_of.get(ln.split(": ", 1)[1], [])]
            answer = {"facts": facts}
        else:
            listed = [ln.split(". ", 1)[1] for ln in user.split("\n\n")[0].split("\n")[1:]]
            new = user.split("New fact: ", 1)[1]
            answer = {"event": "ADD", "target": -1, "text": new}
            for i, old in enumerate(listed):
                if new == old:
                    answer = {"event": "NONE", "target": i, "text": ""}
                elif new.startswith("Not ") and new[4:] == old:
                    answer = {"event": "DELETE", "target": i, "text": ""}
                elif new.split()[:3] == old.split()[:3]:
                    answer = {"event": "UPDATE", "target": i, "text": new}
        jsonschema.validate(answer, schema)
        return json.dumps(answer)


def Extractor(svc, llm, **kw):  # noqa: N802 - the stub's decisions are asked about every similar fact
    return _Extractor(svc, llm, **{"ask_above": -1.0, **kw})


@pytest.fixture
def svc(tmp_path, encoder, embedder):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=2, index="exact"), encoder, embedder)
    yield s
    s.close()


CHAT = [{"role": "system", "content": "You are kind."},
        {"id": "m1", "role": "user", "content": "I moved to Leeds last week.", "date": "2 May 2025"},
        {"id": "m2", "role": "assistant", "content": "How exciting!"},
        {"id": "m3", "role": "user", "content": "My cat Pixel loves the new flat."}]
FACTS_OF = {"I moved to Leeds last week.": ["Maya lives in Leeds."],
            "My cat Pixel loves the new flat.": ["Maya has a cat named Pixel.", "Pixel likes the flat."]}


def test_messages_become_turns_and_facts_name_their_source(svc, encoder):
    llm = StubLLM(FACTS_OF)
    out = Extractor(svc, llm).remember("maya", turns_from_messages(CHAT))
    assert out.turns_stored == 3 and out.candidates == 3  # the system prompt is not a turn
    assert out.added == ["m-m1-0", "m-m3-0", "m-m3-1"] and not (out.updated or out.deleted)
    assert [t.turn_id for t in svc.catalog.turns("maya")] == ["m1", "m2", "m3"]
    leeds = svc.get("maya", "m-m1-0")
    assert (leeds.text, leeds.source_turn, leeds.date) == ("Maya lives in Leeds.", "m1", "2 May 2025")
    # each fact was encoded after its window of turns (Context-Window Encoding): m3's saw m1 and m2
    assert svc.load_kv("maya", ["m-m3-0"])[0].meta["ctx"].startswith("m1:I moved to Leeds")
    assert len(llm.calls) == 1 + 2  # one extraction window; the first fact needed no decision (none similar)


def test_extracted_facts_count_against_the_tenant_s_quota(svc):
    from inferscale.memory.quotas import Quota, QuotaExceeded

    ex = Extractor(svc, StubLLM(FACTS_OF), quota_of=lambda user: Quota(user.split(":")[0] + ":", max_facts=2))
    with pytest.raises(QuotaExceeded, match="max_facts is 2"):  # the job fails naming the limit
        ex.remember("t:maya", turns_from_messages(CHAT))
    assert len(svc.list("t:maya")) == 2


def test_update_delete_and_none_run_through_the_service(svc):
    ex = Extractor(svc, StubLLM({**FACTS_OF,
                                 "Actually I moved to York.": ["Maya lives in York."],
                                 "Pixel ran away, sadly.": ["Not Maya has a cat named Pixel."],
                                 "Still in York!": ["Maya lives in York."]}), window=1)  # m4 and m6: one fact
    ex.remember("maya", turns_from_messages(CHAT))
    old_kv = svc.load_kv("maya", ["m-m1-0"])[0]
    out = ex.remember("maya", turns_from_messages([{"id": "m4", "role": "user", "content": "Actually I moved to York."},
                                                   {"id": "m5", "role": "user", "content": "Pixel ran away, sadly."},
                                                   {"id": "m6", "role": "user", "content": "Still in York!"}]))
    assert out.updated == ["m-m1-0"] and out.deleted == ["m-m3-0"] and out.unchanged == ["m-m1-0"]
    assert svc.get("maya", "m-m1-0").text == "Maya lives in York."
    assert svc.load_kv("maya", ["m-m1-0"])[0].k.tobytes() != old_kv.k.tobytes()  # re-encoded
    with pytest.raises(UnknownFactError):
        svc.load_kv("maya", ["m-m3-0"])  # forgotten, KV included
    assert [e["event"] for e in svc.history("maya", "m-m3-0")] == ["ADD", "DELETE"]


def test_a_retry_with_the_same_message_ids_duplicates_nothing(svc):
    ex = Extractor(svc, StubLLM(FACTS_OF))
    first = ex.remember("maya", turns_from_messages(CHAT))
    v = svc.version("maya")
    again = ex.remember("maya", turns_from_messages(CHAT))
    assert again.turns_stored == 0 and not again.added and sorted(again.unchanged) == sorted(first.added)
    assert svc.version("maya") == v and len(svc.list("maya")) == 3
    # a message without an id is named by its content: sending it twice stores it once
    anon = [{"role": "user", "content": "I like tea."}]
    assert turns_from_messages(anon)[0].id == turns_from_messages(anon)[0].id
    assert ex.store_turns("maya", turns_from_messages(anon)) == 1 and ex.store_turns("maya", turns_from_messages(anon)) == 0


def test_a_crash_mid_job_resumes_where_it_stopped(svc):
    class Flaky(StubLLM):
        def complete_json(self, messages, schema, max_tokens):
            if len(self.calls) == 2:  # the extraction and one decision went through
                self.calls.append(None)
                raise ConnectionError("the engine went away")
            return super().complete_json(messages, schema, max_tokens)

    with pytest.raises(ConnectionError):
        Extractor(svc, Flaky(FACTS_OF)).remember("maya", turns_from_messages(CHAT))
    done = {f.fact_id for f in svc.list("maya")}
    assert done and done != {"m-m1-0", "m-m3-0", "m-m3-1"}  # stopped part way
    out = Extractor(svc, StubLLM(FACTS_OF)).remember("maya", turns_from_messages(CHAT))
    assert {f.fact_id for f in svc.list("maya")} == {"m-m1-0", "m-m3-0", "m-m3-1"}
    assert sorted(out.added + out.unchanged) == ["m-m1-0", "m-m3-0", "m-m3-1"]


def test_answers_outside_the_schema_are_refused_or_ignored(svc):
    class Bad:
        def __init__(self, answer):
            self.answer = answer

        def complete_json(self, messages, schema, max_tokens):
            return self.answer

    with pytest.raises(ExtractionError, match="not JSON"):
        Extractor(svc, Bad("no")).remember("maya", turns_from_messages(CHAT))
    out = Extractor(svc, Bad(json.dumps({"facts": [{"text": "x", "message": 7}]}))).remember(
        "maya", turns_from_messages(CHAT))
    assert out.candidates == 0  # a message number outside the window names no turn
    with pytest.raises(ValueError, match="role"):
        turns_from_messages([{"role": "robot", "content": "hi"}])
    for n in (1, 5):
        jsonschema.Draft202012Validator.check_schema(extract_schema(n))
        jsonschema.Draft202012Validator.check_schema(decide_schema(n))
    assert decide_schema(3)["properties"]["event"]["enum"] == list(EVENTS)


class BatchingStub(StubLLM):
    """The stub, asked in batches (`complete_json_many`): each batch's size is recorded."""

    def __init__(self, facts_of):
        super().__init__(facts_of)
        self.batches = []

    def complete_json_many(self, calls, max_tokens):
        self.batches.append(len(calls))
        return [self.complete_json(m, s, max_tokens) for m, s in calls]


def test_windows_are_extracted_in_one_batch_and_candidates_decided_in_batches(svc):
    llm = BatchingStub(FACTS_OF)
    Extractor(svc, llm, window=1).remember("maya", turns_from_messages(CHAT))
    assert llm.batches == [3, 1, 1]  # three windows of one message: one batch; then one decision at a time
    # (the first candidate meets an empty memory and is added without asking)
    llm = BatchingStub({"Actually I moved to York.": ["Maya lives in York."],
                        "Pixel ran away, sadly.": ["Not Maya has a cat named Pixel."],
                        "Still in Leeds, no, York!": ["Maya lives in York now."]})
    out = Extractor(svc, llm, batch=3).remember("maya", turns_from_messages(
        [{"id": "m4", "role": "user", "content": "Actually I moved to York."},
         {"id": "m5", "role": "user", "content": "Pixel ran away, sadly."},
         {"id": "m6", "role": "user", "content": "Still in Leeds, no, York!"}]))
    assert llm.batches == [1, 3]  # one extraction window, then the three candidates decided together
    # both updates of m-m1-0 were decided against the memory before the batch; the later one is applied last
    assert out.updated == ["m-m1-0", "m-m1-0"] and out.deleted == ["m-m3-0"]
    assert svc.get("maya", "m-m1-0").text == "Maya lives in York now."
    with pytest.raises(ValueError, match="batch"):
        Extractor(svc, llm, batch=0)


def test_a_decision_about_a_fact_its_batch_deleted_does_not_resurrect_it(svc):
    ex = Extractor(svc, StubLLM(FACTS_OF))
    ex.remember("maya", turns_from_messages(CHAT))
    pixel = svc.get("maya", "m-m3-0")
    from inferscale.memory.extraction import Candidate, Decision, Extracted

    c = Candidate("m-m3-9", "Pixel is a tabby.", turns_from_messages(CHAT)[2])
    svc.delete("maya", "m-m3-0")
    out = Extracted()
    ex.apply("maya", Decision("UPDATE", c, pixel, "Maya has a tabby cat named Pixel."), out)
    ex.apply("maya", Decision("DELETE", c, pixel), out)
    assert out.added == ["m-m3-9"] and out.unchanged == ["m-m3-9"] and not (out.updated or out.deleted)
    assert svc.catalog.fact("maya", "m-m3-0") is None and svc.get("maya", "m-m3-9").text == "Pixel is a tabby."


def test_a_window_too_long_for_the_context_is_split_until_its_answer_fits(svc):
    class Roomy(BatchingStub):  # a context that leaves 100 tokens per message not asked about
        def room(self, messages):
            return 1000 - 100 * messages[1]["content"].count("\n")

    llm = Roomy({f"Day {i} in Leeds.": [f"Maya spent day {i} in Leeds."] for i in range(8)})
    msgs = [{"id": f"w{i}", "role": "user", "content": f"Day {i} in Leeds."} for i in range(8)]
    ex = Extractor(svc, llm, max_tokens=500)
    (found,) = ex.candidates_many([turns_from_messages(msgs)])
    assert llm.batches == [2]  # 8 messages leave 200 tokens: two windows of 4 leave 600, asked in one batch
    assert [c.turn.id for c in found] == [f"w{i}" for i in range(8)]  # every message, in order
    assert ex.candidates_many([turns_from_messages(msgs[:1])]) == [[ex.candidates(turns_from_messages(msgs[:1]))[0]]]
    # a single message that leaves less than MIN_ANSWER is skipped, not sent
    llm.room = lambda messages: 10
    assert ex.candidates_many([turns_from_messages(msgs[:2]), []]) == [[], []]


def test_only_candidates_near_a_memory_fact_are_asked_about(svc):
    """With the default `ask_above`, a candidate whose nearest fact is not that similar is added
    without asking; one a fact says in the same words changes nothing, also without asking; only
    the rest go to the LLM. The transcript names each message's speaker and, once, the date."""
    llm = StubLLM(FACTS_OF)
    _Extractor(svc, llm, ask_above=1.0).remember("maya", turns_from_messages(CHAT))
    assert len(llm.calls) == 1 and len(svc.list("maya")) == 3  # nothing is that similar: no decision asked
    llm.calls.clear()
    repeat = [{"id": "m7", "role": "user", "content": "I moved to Leeds last week."}]  # "Maya lives in Leeds." again
    out = _Extractor(svc, llm, ask_above=-1.0).remember("maya", turns_from_messages(repeat))
    assert out.unchanged == ["m-m1-0"] and len(llm.calls) == 1  # the same words: NONE, no decision asked
    from inferscale.memory.extraction import same_text, transcript

    assert same_text("Maya lives in Leeds.", "maya  lives in leeds") and not same_text("Maya lives in Leeds.", "Maya lived in Leeds.")
    text = transcript(turns_from_messages(CHAT))
    assert text.splitlines()[:3] == ["Messages:", "Written on 2 May 2025:", "0. user: I moved to Leeds last week."]
    with pytest.raises(ValueError, match="ask_above"):
        _Extractor(svc, llm, ask_above=2.0)


def test_a_fact_said_twice_in_one_answer_is_one_candidate(svc):
    llm = StubLLM({"I moved to Leeds last week.": ["Maya lives in Leeds.", "maya lives in Leeds"]})
    out = Extractor(svc, llm).remember("maya", turns_from_messages(CHAT[:2]))
    assert out.candidates == 1 and out.added == ["m-m1-0"]
