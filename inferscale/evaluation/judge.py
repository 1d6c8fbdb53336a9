"""LLM-as-a-judge for QA answers, through any OpenAI-compatible chat-completions endpoint.

The rubric is the binary one memory-system papers use on LoCoMo (e.g. Mem0's "J" score): the
answer is CORRECT when it refers to the same thing as the gold answer, generous on paraphrase,
extra detail, and date or number formats; WRONG otherwise. The judge replies with a small JSON
object; the label is parsed from it (or, failing that, from the one label word in the reply).

    judge = Judge(JudgeConfig(base_url="http://localhost:8000/v1", model="my-judge"))
    verdicts = judge.judge_many([("When did Tom move?", "May 2023", "He moved on 7 May 2023.")])
    verdicts[0].correct   # True / False, or None when the reply had no label

Needs the `openai` package (the `eval` extra). The API key is read from the environment variable
named by `JudgeConfig.api_key_env` (default OPENAI_API_KEY); endpoints without authentication
(a local vLLM server, say) need none.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlparse

__all__ = ["JudgeConfig", "Judge", "Verdict", "parse_verdict", "verdict_key", "RUBRIC"]

RUBRIC = """You are grading an answer to a question about a long conversation between two people.

Question: {question}
Gold answer: {gold}
Answer to grade: {prediction}

Label the answer CORRECT if it refers to the same thing as the gold answer. Be generous: a longer
answer, a paraphrase, extra detail or a different format (for dates: "7 May 2023", "May 7th",
"the 7th of May"; for numbers: "two" or "2") is CORRECT as long as it contains the gold answer's
meaning. For time questions, a relative date that resolves to the gold date is CORRECT. Label it
WRONG if it contradicts the gold answer, misses its key content, or says it does not know.

Reply with JSON only, in this form: {{"reasoning": "<one sentence>", "label": "CORRECT"}} or
{{"reasoning": "<one sentence>", "label": "WRONG"}}"""

_LABEL_RE = re.compile(r"\b(CORRECT|WRONG)\b")


@dataclass(frozen=True)
class JudgeConfig:
    base_url: str  # the endpoint's /v1 root, e.g. http://localhost:8000/v1
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_retries: int = 3
    concurrency: int = 4  # requests in flight in judge_many
    max_tokens: int = 200

    def __post_init__(self) -> None:
        u = urlparse(self.base_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"judge base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model.strip():
            raise ValueError("judge model must be a non-empty model name")
        if not self.api_key_env.strip():
            raise ValueError("judge api_key_env must name an environment variable")
        if self.timeout_s <= 0:
            raise ValueError(f"judge timeout_s must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"judge max_retries must be >= 0, got {self.max_retries}")
        if not 1 <= self.concurrency <= 64:
            raise ValueError(f"judge concurrency must be in [1, 64], got {self.concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"judge max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Verdict:
    correct: bool | None  # None: no label (the reply carried none, or the request failed)
    reply: str
    error: str | None = None  # judge_many: why the request failed after the client's retries


def verdict_key(question: str, gold: Any, prediction: str) -> tuple[str, str, str]:
    """What a verdict depends on: the rubric's three fields as the prompt writes them."""
    return str(question), str(gold), str(prediction)


def parse_verdict(reply: str) -> bool | None:
    """True for CORRECT, False for WRONG, None when the reply names neither (or both, outside JSON)."""
    text = reply.strip()
    if text.startswith("```"):  # a fenced JSON block
        text = text.strip("`").removeprefix("json").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("label"), str):
        label = obj["label"].strip().upper()
        if label in ("CORRECT", "WRONG"):
            return label == "CORRECT"
    found = set(_LABEL_RE.findall(reply.upper()))
    if len(found) == 1:
        return found.pop() == "CORRECT"
    return None


class Judge:
    def __init__(self, config: JudgeConfig, http_client: Any = None) -> None:
        try:
            from openai import OpenAI
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the LLM judge needs the openai package (pip install 'inferscale[eval]')") from e
        self.config = config
        # local OpenAI-compatible servers usually need no key, but the client insists on one
        key = os.environ.get(config.api_key_env) or "not-needed"
        self.client = OpenAI(base_url=config.base_url, api_key=key, timeout=config.timeout_s,
                             max_retries=config.max_retries, http_client=http_client)

    def judge(self, question: str, gold: Any, prediction: str) -> Verdict:
        """One verdict (greedy). Raises the client's error when the endpoint keeps failing."""
        msg = RUBRIC.format(question=question, gold=gold, prediction=prediction)
        resp = self.client.chat.completions.create(model=self.config.model, temperature=0.0,
                                                   max_tokens=self.config.max_tokens,
                                                   messages=[{"role": "user", "content": msg}])
        reply = resp.choices[0].message.content or ""
        return Verdict(parse_verdict(reply), reply)

    def judge_many(self, items: Sequence[tuple[str, Any, str]]) -> list[Verdict]:
        """Verdicts for (question, gold, prediction) items, in order, `concurrency` at a time. The
        judge is greedy, so items that repeat (several methods giving the same answer) are asked
        once and share the verdict. A request that still fails after the client's retries
        (timeout, connection, HTTP error) gives a Verdict with `correct=None` and its `error`, so
        one bad item does not lose the rest."""
        from openai import APIError

        def one(item) -> Verdict:
            try:
                return self.judge(*item)
            except APIError as e:
                return Verdict(None, "", f"{type(e).__name__}: {e}")

        keys = [verdict_key(*item) for item in items]
        unique = dict(zip(keys, items))  # one item per distinct prompt
        with ThreadPoolExecutor(self.config.concurrency) as pool:
            verdicts = dict(zip(unique, pool.map(one, unique.values())))
        return [verdicts[k] for k in keys]
