"""`inferscale memory ...` end to end on a tiny model (torch encoder, MiniLM)."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from tiny_models import make_tiny_model  # noqa: E402

from inferscale.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_model(path, "qwen3", num_layers=1)
    return str(path)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_memory_commands(model, tmp_path, capsys):
    base = ["memory", "--root", str(tmp_path / "mem"), "--model", model, "--w", "2"]
    doc = {"turns": [{"id": "t1", "speaker": "Maya", "text": "I got a cat!"},
                     {"id": "t2", "speaker": "Tom", "text": "What is its name?"},
                     {"id": "t3", "speaker": "Maya", "text": "Pixel, she is grey."}],
           "facts": [{"id": "cat", "text": "Maya has a grey cat named Pixel.", "source_turn": "t3"}]}
    (tmp_path / "mem.json").write_text(json.dumps(doc))
    rc, out, _ = run(capsys, *base, "add", "maya", "--file", str(tmp_path / "mem.json"),
                     "--fact", "Tom moved to Leeds.", "--id", "move")
    assert rc == 0 and out == {"added": ["cat", "move"], "version": 1}
    rc, out, _ = run(capsys, *base, "search", "maya", "What pet does Maya have?", "-k", "1")
    assert rc == 0 and out[0]["fact_id"] == "cat"
    rc, out, _ = run(capsys, *base, "update-turn", "maya", "t2", "Does it have a name?")
    assert out == {"reencoded": ["cat"]}
    rc, out, _ = run(capsys, *base, "update", "maya", "move", "Tom moved to York.")
    assert out["text"] == "Tom moved to York." and out["version"] == 3
    rc, out, _ = run(capsys, *base, "history", "maya", "move")
    assert [e["event"] for e in out] == ["ADD", "UPDATE"]
    rc, out, _ = run(capsys, *base, "add", "maya", "--fact", "Maya is in Lisbon this week.", "--id", "trip",
                     "--metadata", '{"category": "travel"}', "--expires-at", "2099-01-01T00:00:00Z")
    rc, out, _ = run(capsys, *base, "list", "maya", "--filters", '{"category": "travel"}')
    assert [f["fact_id"] for f in out] == ["trip"] and out[0]["expires_at"] == 4070908800.0
    rc, out, _ = run(capsys, *base, "export", "maya", "--out", str(tmp_path / "maya.json"))
    assert out["facts"] == 3 and out["turns"] == 3
    other = ["memory", "--root", str(tmp_path / "other"), "--model", model, "--w", "2"]
    rc, out, _ = run(capsys, *other, "import", "maya", str(tmp_path / "maya.json"))
    assert rc == 0 and sorted(out["facts"]) == ["cat", "move", "trip"] and out["expired"] == []
    rc, out, _ = run(capsys, *other, "search", "maya", "What pet does Maya have?", "-k", "1")
    assert out[0]["fact_id"] == "cat"
    rc, out, _ = run(capsys, *other, "update", "maya", "trip", "--expires-at", "2001-01-01T00:00:00Z")
    assert out["expires_at"] == 978307200.0
    rc, out, _ = run(capsys, *other, "sweep")
    assert out == {"swept": {"maya": ["trip"]}}
    rc, _, err = run(capsys, *base, "delete", "maya", "nope")
    assert rc == 2 and "has no fact 'nope'" in err
    rc, _, err = run(capsys, *base, "list", "../maya")
    assert rc == 2 and "invalid user id" in err
    rc, out, _ = run(capsys, *base, "delete-user", "maya")
    assert out == {"deleted_user": "maya"}
    rc, _, err = run(capsys, *base, "list", "maya")
    assert rc == 2 and "unknown user" in err


def test_memory_add_messages_extracts_through_an_openai_compatible_endpoint(model, tmp_path, capsys):
    """`memory add --messages FILE --llm-url URL`: the messages become turns and the endpoint's LLM
    (here the extraction tests' deterministic stub behind a loopback OpenAI-style server, asked with
    `response_format: json_schema`) extracts the facts; a second run duplicates nothing."""
    from stub_openai import openai_endpoint
    from test_extraction import CHAT, FACTS_OF, StubLLM

    with openai_endpoint(StubLLM(FACTS_OF)) as (url, asked):
        (tmp_path / "chat.json").write_text(json.dumps({"messages": CHAT}))
        base = ["memory", "--root", str(tmp_path / "mem"), "--model", model, "--w", "2"]
        rc, out, err = run(capsys, *base, "add", "maya", "--messages", str(tmp_path / "chat.json"), "--llm-url", url)
        assert rc == 0, err
        assert out["added"] == ["m-m1-0", "m-m3-0", "m-m3-1"] and out["turns_stored"] == 3
        assert "candidates decided" in err  # progress on stderr
        assert asked[0] == ("/v1/chat/completions", "stub-model", "json_schema", 0)
        rc, again, _ = run(capsys, *base, "add", "maya", "--messages", str(tmp_path / "chat.json"), "--llm-url", url)
        assert rc == 0 and not again["added"] and again["turns_stored"] == 0
        rc, _, err = run(capsys, *base, "add", "maya", "--messages", str(tmp_path / "chat.json"))
        assert rc != 0 and "--llm-url" in err
