"""The LLM judge against a stand-in OpenAI-compatible endpoint (httpx mock transport, no network)."""

import json

import pytest

from inferscale.evaluation.judge import RUBRIC, Judge, JudgeConfig, parse_verdict

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")


def test_parse_verdict():
    assert parse_verdict('{"reasoning": "same date", "label": "CORRECT"}') is True
    assert parse_verdict('{"reasoning": "no", "label": "wrong"}') is False
    assert parse_verdict('```json\n{"label": "CORRECT"}\n```') is True
    assert parse_verdict("The answer is WRONG.") is False  # not JSON: the one label word
    assert parse_verdict("CORRECT or WRONG?") is None  # both: undecided
    assert parse_verdict("I cannot tell") is None


def test_config_is_validated():
    with pytest.raises(ValueError, match="base_url"):
        JudgeConfig(base_url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="model"):
        JudgeConfig(base_url="http://localhost:8000/v1", model=" ")
    with pytest.raises(ValueError, match="concurrency"):
        JudgeConfig(base_url="http://localhost:8000/v1", model="m", concurrency=0)


def _endpoint(seen: list):
    """A chat-completions endpoint that says CORRECT when the graded answer contains the gold one."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        seen.append(body)
        msg = body["messages"][0]["content"]
        gold = msg.split("Gold answer: ")[1].split("\n")[0]
        pred = msg.split("Answer to grade: ")[1].split("\n")[0]
        label = "CORRECT" if gold.lower() in pred.lower() else "WRONG"
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": json.dumps({"reasoning": "r", "label": label})}}]})

    return handler


def test_judge_many_in_order_through_the_endpoint(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sekrit")
    seen: list = []
    cfg = JudgeConfig(base_url="http://judge.test/v1", model="judge-1", api_key_env="MY_JUDGE_KEY", concurrency=3)
    judge = Judge(cfg, http_client=httpx.Client(transport=httpx.MockTransport(_endpoint(seen))))
    items = [("When?", "7 May 2023", "On 7 May 2023, I think."), ("Who?", "Tom", "Maya"), ("What?", 2022, "In 2022")]
    verdicts = judge.judge_many(items)
    assert [v.correct for v in verdicts] == [True, False, True]
    assert len(seen) == 3 and all(b["model"] == "judge-1" and b["temperature"] == 0.0 for b in seen)
    prompts = sorted(b["messages"][0]["content"] for b in seen)
    assert prompts == sorted(RUBRIC.format(question=q, gold=g, prediction=p) for q, g, p in items)


def test_judge_many_asks_each_distinct_item_once():
    seen: list = []
    cfg = JudgeConfig(base_url="http://judge.test/v1", model="judge-1", concurrency=2)
    judge = Judge(cfg, http_client=httpx.Client(transport=httpx.MockTransport(_endpoint(seen))))
    a, b = ("When?", "7 May 2023", "On 7 May 2023, I think."), ("Who?", "Tom", "Maya")
    verdicts = judge.judge_many([a, b, a, ("When?", "7 May 2023", "On 7 May 2023, I think."), b])
    assert [v.correct for v in verdicts] == [True, False, True, True, False]
    assert len(seen) == 2  # the judge is greedy: a repeated item shares its verdict


def test_judge_errors_surface(monkeypatch):
    def handler(request):
        return httpx.Response(401, json={"error": {"message": "bad key"}})

    cfg = JudgeConfig(base_url="http://judge.test/v1", model="m", max_retries=0)
    judge = Judge(cfg, http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        judge.judge("q", "a", "b")
    (v,) = judge.judge_many([("q", "a", "b")])  # in a batch: recorded, not raised
    assert v.correct is None and "AuthenticationError" in v.error and "bad key" in v.error
