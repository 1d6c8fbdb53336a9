import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.common.prompt.layout import PromptBuilder


def _builder(max_context=200):
    # a character-level "tokenizer" and a ChatML-like template, enough to check the bookkeeping
    render = lambda msgs: "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in msgs) + "<assistant>"
    return PromptBuilder(tokenize=lambda s: [ord(c) for c in s], render_chat=render, max_context=max_context,
                         preamble="Facts:\n")


def test_segments_are_contiguous_and_cover_the_prompt():
    b = _builder()
    facts = [("f1", b.fact_ids("Tom lives in Leeds.")), ("f2", b.fact_ids("Maya has a cat.", "2 May 2025"))]
    lay = b.layout(facts, b.question_ids("Where does Tom live?"))
    text = "".join(chr(t) for t in lay.token_ids)
    assert text == ("<system>Facts:\n- Tom lives in Leeds.\n- (2 May 2025) Maya has a cat.\n</system>"
                    "<user>Where does Tom live?</user><assistant>")
    assert [s.kind for s in lay.segments] == ["header", "fact", "fact", "footer", "question"]
    pos = 0
    for s in lay.segments:
        assert s.start == pos and list(s.positions) == list(range(pos, pos + len(s.token_ids)))
        pos = s.end
    assert len(lay) == pos == len(lay.token_ids)
    assert lay.num_injected == lay.facts[-1].end  # header + facts are injected, the rest computed
    assert lay.prefix_ids(lay.facts[1]) == lay.token_ids[: lay.facts[1].start]


def test_the_boundary_ends_the_memory_in_the_computed_tail():
    b = _builder(max_context=400)
    facts = [("f1", b.fact_ids("Tom lives in Leeds."))]
    plain, ended = b.layout(facts, b.question_ids("Where?")), b.layout(facts, b.question_ids("Where?"), boundary=True)
    assert [s.kind for s in ended.segments] == ["header", "fact", "boundary", "footer", "question"]
    text = "".join(chr(t) for t in ended.token_ids)
    assert text.startswith("<system>Facts:\n- Tom lives in Leeds.\n(End of the remembered facts.")
    assert ended.num_injected == plain.num_injected  # the same injected prefix: stored KV stays valid
    assert ended.segments[2].action == "compute" and ended.token_ids[: plain.facts[-1].end] == \
        plain.token_ids[: plain.facts[-1].end]
    chat = b.chat_layout(facts, b.conversation_ids([{"role": "user", "content": "Hi"}]), boundary=True)
    assert [s.kind for s in chat.segments] == ["header", "fact", "boundary", "conversation"]


_fact_texts = st.lists(st.text(alphabet="abcdefgh ", min_size=1, max_size=12).filter(str.strip), min_size=1,
                       max_size=5)


@settings(max_examples=40, deadline=None)
@given(texts=_fact_texts, n_repeat=st.integers(0, 3), boundary=st.booleans())
def test_repeated_facts_follow_the_memory_computed_and_leave_its_injected_prefix_alone(texts, n_repeat, boundary):
    b = _builder(max_context=2000)
    facts = [(f"f{i}", b.fact_ids(t)) for i, t in enumerate(texts)]
    repeat = b.repeat_ids([ids for _, ids in facts[:n_repeat]])
    plain = b.layout(facts, b.question_ids("Where?"), boundary)
    rep = b.layout(facts, b.question_ids("Where?"), boundary, repeat)
    if not n_repeat:
        assert repeat == [] and rep.token_ids == plain.token_ids
        return
    kinds = [s.kind for s in rep.segments]
    assert kinds == [s.kind for s in plain.segments[:-2]] + ["repeat", "footer", "question"]
    (seg,) = [s for s in rep.segments if s.kind == "repeat"]
    assert seg.action == "compute" and "".join(chr(t) for t in seg.token_ids) == \
        "Most relevant to the question:\n" + "".join(b.fact_text(t) for t in texts[:n_repeat])
    assert rep.num_injected == plain.num_injected and rep.token_ids[:seg.start] == plain.token_ids[:seg.start]
    chat = b.chat_layout(facts, b.conversation_ids([{"role": "user", "content": "Hi"}]), boundary, repeat)
    assert [s.kind for s in chat.segments][-2:] == ["repeat", "conversation"]


def test_bad_input_is_refused():
    b = _builder(max_context=120)
    with pytest.raises(ValueError, match="non-empty"):
        b.fact_ids("   ")
    with pytest.raises(ValueError, match="question"):
        b.question_ids("")
    with pytest.raises(ValueError, match="does not fit"):
        b.fact_ids("x" * 200)
    ids = b.fact_ids("A fact of moderate length here.")
    with pytest.raises(ValueError, match="twice"):
        b.layout([("f", ids), ("f", ids)], b.question_ids("q?"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        b.layout([(f"f{i}", ids) for i in range(5)], b.question_ids("q?"))
    with pytest.raises(ValueError, match="in order"):
        PromptBuilder(lambda s: [1], lambda m: "no placeholders here", max_context=10)


def _chat(turns: list[tuple[str, str]], new: str, system: str | None = "Be brief.") -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": new}]


def test_a_history_first_chat_puts_the_memory_inside_the_new_user_turn():
    from inferscale.common.prompt.layout import CHAT_PREAMBLE, MEMORY_LABEL

    b = _builder(max_context=2000)
    facts = [("f1", b.fact_ids("Tom lives in Leeds.")), ("f2", b.fact_ids("Maya has a cat."))]
    before, after = b.history_ids(_chat([("Hi", "Hello!")], "Where does Tom live?"))
    lay = b.history_layout(facts, before, after, boundary=True)
    assert [(s.kind, s.action) for s in lay.segments] == [
        ("history", "compute"), ("fact", "inject"), ("fact", "inject"), ("boundary", "compute"), ("message", "compute")]
    text = "".join(chr(t) for t in lay.token_ids)
    assert text == (f"<system>{CHAT_PREAMBLE}\n\nBe brief.</system><user>Hi</user><assistant>Hello!</assistant>"
                    f"<user>{MEMORY_LABEL}- Tom lives in Leeds.\n- Maya has a cat.\n(End of the remembered facts. "
                    "Use them to answer; do not repeat the list.)\n\nWhere does Tom live?</user><assistant>")
    assert lay.num_injected == sum(len(s.token_ids) for s in lay.facts)  # only the facts: nothing else is stored
    plain_before, plain_after = b.history_ids(_chat([("Hi", "Hello!")], "Where?"), memory=False)
    assert MEMORY_LABEL not in "".join(chr(t) for t in plain_before + plain_after)


_words = st.text(alphabet="abc xyz?!.", min_size=1, max_size=12).filter(str.strip)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(_words, _words), min_size=0, max_size=6), new=_words, nxt=_words,
       reply=_words, system=st.one_of(st.none(), _words))
def test_history_first_keeps_each_turn_s_conversation_a_prefix_of_the_next_turn(turns, new, nxt, reply, system):
    """Turn n+1's prompt starts with every token of turn n's prompt before its memory but the
    memory's label: the system prompt and the conversation so far are a stable prefix, whatever the
    memory of either turn (what the engine's prefix cache reuses)."""
    from inferscale.common.prompt.layout import MEMORY_LABEL

    b = _builder(max_context=4000)
    before_n, _ = b.history_ids(_chat(turns, new, system))
    before_next, after_next = b.history_ids(_chat(turns + [(new, reply)], nxt, system))
    label = len(b.tokenize(MEMORY_LABEL))
    stable = before_n[: len(before_n) - label]
    facts = [("f", b.fact_ids("Some fact."))]
    assert b.history_layout(facts, before_next, after_next).token_ids[: len(stable)] == stable
    # memory-first: the memory comes first, so the next turn shares only the header
    first = b.chat_layout(facts, b.conversation_ids(_chat(turns, new, system))).token_ids
    assert first[: len(b.header_ids)] == list(b.header_ids)


def test_history_first_refuses_a_chat_without_a_user_message():
    b = _builder()
    with pytest.raises(ValueError, match="no user message"):
        b.history_ids([{"role": "tool", "content": "42"}])
    with pytest.raises(ValueError, match="new message has no tokens"):
        b.history_layout([], [1], [])
