import pytest

from inferscale.common.layout import PromptBuilder


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
