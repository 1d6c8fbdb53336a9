"""Memory from conversations: facts extracted by an LLM, then added, updated or deleted.

    extractor = Extractor(memory, llm)                 # llm: any JsonLLM (inferscale.memory.extraction_llms)
    outcome = extractor.remember("alice", turns_from_messages(messages))
    outcome.added, outcome.updated, outcome.deleted    # fact ids

The steps, as Mem0's `add(messages)` takes them:

1. The messages are stored as the user's turns (they are the windows facts are encoded after);
   a message whose id the user already has is not stored again.
2. Candidate facts are extracted from the messages, `window` messages per LLM call (the windows
   are independent, so they are asked together: one batch), each naming the message it comes from
   (which becomes the fact's source turn and date).
3. Per candidate, the user's `similar` nearest facts are retrieved and the LLM decides ADD,
   UPDATE (which fact, and its new text), DELETE (which fact) or NONE, in JSON constrained by
   `decide_schema`; a candidate with no fact at least `ask_above` similar is added without
   asking, and one a fact already says in the same words changes nothing. `batch`
   candidates are decided together, each against the memory as it stood before them (as Mem0
   decides one add's facts together); `batch=1` decides each after the previous one is applied.
4. Each decision runs through the memory service's own operations: an update re-encodes the
   fact's KV, a delete forgets it completely, an add encodes it after its window.

Retrying the same messages duplicates nothing: a candidate's fact id is derived from its message
id and its rank among that message's candidates (`m-<turn id>-<n>`), so an add that already
happened is found and skipped, and greedy decoding extracts the same candidates again. The prompts
are versioned files in `inferscale/memory/prompts/` (`PROMPT_VERSION`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Protocol, Sequence

from inferscale.common.facts import Fact, Turn
from inferscale.memory.service_types import MemoryFact

log = logging.getLogger("inferscale.memory.extraction")

PROMPT_VERSION = "v2"
EVENTS = ("ADD", "UPDATE", "DELETE", "NONE")
MIN_ANSWER = 64  # tokens of room below which a single message is not asked about
# A candidate whose nearest memory fact is less similar than this (cosine of the memory's
# embeddings, MiniLM by default) is added without asking: asked about a fact on another subject,
# a small model tends to answer UPDATE and merge the two (Qwen2.5-Coder-1.5B on LoCoMo did).
ASK_ABOVE = 0.7


def prompt(name: str, version: str = PROMPT_VERSION) -> str:
    """The text of prompt `name` ("extract" or "decide") at `version`."""
    return resources.files("inferscale.memory").joinpath(f"prompts/{name}-{version}.md").read_text()


def extract_schema(n_messages: int, max_facts: int = 16) -> dict:
    """The JSON schema of an extraction over `n_messages` numbered messages."""
    item = {"type": "object", "additionalProperties": False, "required": ["text", "message"],
            "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 300},
                           "message": {"type": "integer", "minimum": 0, "maximum": max(0, n_messages - 1)}}}
    return {"type": "object", "additionalProperties": False, "required": ["facts"],
            "properties": {"facts": {"type": "array", "items": item, "maxItems": max_facts}}}


def decide_schema(n_similar: int) -> dict:
    """The JSON schema of a decision against `n_similar` numbered memory facts."""
    return {"type": "object", "additionalProperties": False, "required": ["event", "target", "text"],
            "properties": {"event": {"enum": list(EVENTS)},
                           "target": {"type": "integer", "minimum": -1, "maximum": max(-1, n_similar - 1)},
                           "text": {"type": "string", "maxLength": 300}}}


class JsonLLM(Protocol):
    """An LLM that answers chat `messages` with JSON valid under `schema` (constrained decoding),
    greedily, in at most `max_tokens` tokens; returns the JSON text. One that also has
    `complete_json_many(calls, max_tokens)` (calls: (messages, schema) pairs; the answers in
    order) is asked a batch at once (`ask_many`); one that has `room(messages)` (the tokens its
    context leaves to answer those messages in) gets windows small enough to answer in full."""

    def complete_json(self, messages: list[dict], schema: dict, max_tokens: int) -> str: ...


def ask_many(llm: JsonLLM, calls: list[tuple[list[dict], dict]], max_tokens: int) -> list[str]:
    """The answers to `calls`, in order: one batch where `llm` takes batches, else one by one."""
    if not calls:
        return []
    many = getattr(llm, "complete_json_many", None)
    if many is not None:
        return list(many(calls, max_tokens))
    return [llm.complete_json(m, s, max_tokens) for m, s in calls]


class ExtractionError(RuntimeError):
    """The LLM's answer could not be used (not JSON, or not the schema's shape)."""


def turns_from_messages(messages: Sequence[dict], session: int = 0) -> list[Turn]:
    """OpenAI chat messages (role, content, optional id, name and date) as turns. A message
    without an id gets one derived from its role, content and date, so sending the same messages
    again names the same turns. System and developer messages are not part of a conversation's
    memory and are left out."""
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with a string content")
        role = m.get("role")
        if role not in ("user", "assistant", "tool", "system", "developer"):
            raise ValueError(f"messages[{i}].role must be user, assistant, tool, system or developer, got {role!r}")
        if role in ("system", "developer"):
            continue
        mid = m.get("id")
        if mid is None:
            digest = hashlib.sha256(json.dumps([role, m["content"], m.get("date")]).encode()).hexdigest()[:16]
            mid = f"msg-{digest}"
        try:
            turns.append(Turn(str(mid), str(m.get("name") or role), m["content"], session, m.get("date")))
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
    return turns


def transcript(window: Sequence[Turn]) -> str:
    """The messages as the extraction prompt numbers them: "N. Speaker: text", under a line naming
    their date whenever it changes."""
    lines, date = ["Messages:"], None
    for i, t in enumerate(window):
        if t.date and t.date != date:
            lines.append(f"Written on {t.date}:")
            date = t.date
        lines.append(f"{i}. {t.speaker}: {t.text}")
    return "\n".join(lines)


def same_text(a: str, b: str) -> bool:
    """Two fact texts that say the same words (case, spacing and the final full stop aside)."""
    norm = lambda x: " ".join(x.lower().split()).rstrip(".")  # noqa: E731
    return norm(a) == norm(b)


@dataclass(frozen=True)
class Candidate:
    fact_id: str  # m-<turn id>-<rank>: the same on a retry
    text: str
    turn: Turn


@dataclass(frozen=True)
class Decision:
    event: str  # one of EVENTS
    candidate: Candidate
    target: MemoryFact | None = None  # the memory fact an UPDATE, DELETE or NONE is about
    text: str = ""  # the text an ADD or UPDATE writes


@dataclass
class Extracted:
    """What one `remember` did: fact ids per outcome, and the turns it stored."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # NONE, or an add a retry finds done
    turns_stored: int = 0
    candidates: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Extractor:
    """Extracts facts from a user's messages with `llm` and applies the decisions to `memory`
    (a `MemoryService`)."""

    def __init__(self, memory, llm: JsonLLM, similar: int = 5, window: int = 20, max_facts: int = 16,
                 max_tokens: int = 1024, batch: int = 1, ask_above: float = ASK_ABOVE, quota_of=None) -> None:
        if min(similar, window, max_facts, batch) < 1 or max_tokens < 16:
            raise ValueError("similar, window, max_facts and batch must be >= 1 and max_tokens >= 16")
        if not -1.0 <= ask_above <= 1.0:
            raise ValueError(f"ask_above must be a cosine similarity in [-1, 1], got {ask_above}")
        self.ask_above = ask_above
        self.memory, self.llm = memory, llm
        self.similar, self.window, self.max_facts, self.max_tokens = similar, window, max_facts, max_tokens
        self.batch = batch
        self.quota_of = quota_of or (lambda user: None)  # user -> its tenant's `Quota` (the server's quotas)
        self.extract_prompt, self.decide_prompt = prompt("extract"), prompt("decide")

    def remember(self, user: str, turns: Sequence[Turn], progress=None) -> Extracted:
        """Store `turns`, extract candidates from them, decide and apply each. `progress(done,
        total, what)` is called as windows are extracted and candidates decided."""
        out = Extracted(turns_stored=self.store_turns(user, turns))
        windows = [list(turns[i : i + self.window]) for i in range(0, len(turns), self.window)]
        candidates = [c for found in self.candidates_many(windows) for c in found]
        if progress:
            progress(len(windows), len(windows), "windows extracted")
        out.candidates = len(candidates)
        self.decide_all(user, candidates, out, progress)
        return out

    def decide_all(self, user: str, candidates: Sequence["Candidate"], out: Extracted, progress=None) -> None:
        """Decide `candidates` in order, `batch` at a time, and apply each decision into `out`."""
        for i in range(0, len(candidates), self.batch):
            for d in self.decide_many(user, candidates[i : i + self.batch]):
                self.apply(user, d, out)
            if progress:
                progress(min(i + self.batch, len(candidates)), len(candidates), "candidates decided")

    def store_turns(self, user: str, turns: Sequence[Turn]) -> int:
        """Append the turns the user does not have yet (by id); returns how many were stored."""
        catalog = self.memory.catalog
        known = ({t.turn_id for t in catalog.turns(user, include_deleted=True)} if catalog.user_exists(user)
                 else set())
        new = [t for t in dict((t.id, t) for t in turns).values() if t.id not in known]
        if new:
            self.memory.add(user, turns=new)
        return len(new)

    def candidates(self, window: Sequence[Turn]) -> list[Candidate]:
        """The facts one LLM call finds in `window` (numbered messages), each with its message."""
        return self.candidates_many([window])[0]

    def candidates_many(self, windows: Sequence[Sequence[Turn]]) -> list[list[Candidate]]:
        """`candidates` of each window, asked as one batch. Where the LLM says how much room its
        context leaves, a window whose answer would not fit is split in halves until it does (a
        single message that leaves no room at all is skipped, with a warning)."""
        split = [self._fitting(list(w)) if w else [] for w in windows]
        parts = [part for ps in split for part in ps]
        answers = iter(self._ask_many([self._extract_call(part) for part in parts]))
        return [[c for part in ps for c in self._found(part, next(answers))] for ps in split]

    def _extract_call(self, window: list[Turn]) -> tuple[list[dict], dict]:
        return ([{"role": "system", "content": self.extract_prompt},
                 {"role": "user", "content": transcript(window)}], extract_schema(len(window), self.max_facts))

    def _fitting(self, window: list[Turn]) -> list[list[Turn]]:
        room = getattr(self.llm, "room", None)
        left = room(self._extract_call(window)[0]) if room is not None else self.max_tokens
        if left >= self.max_tokens:
            return [window]
        if len(window) == 1:
            if left >= MIN_ANSWER:
                return [window]  # the answer gets the room there is
            log.warning("message %s leaves no room to extract from it in the model's context: skipped", window[0].id)
            return []
        half = len(window) // 2
        return self._fitting(window[:half]) + self._fitting(window[half:])

    @staticmethod
    def _found(window: list[Turn], answer: dict) -> list[Candidate]:
        ranks: dict[str, int] = {}
        out = []
        for item in answer.get("facts", []):
            text, n = str(item.get("text", "")).strip(), item.get("message")
            if not text or not isinstance(n, int) or not 0 <= n < len(window):
                continue  # outside the schema: ignore rather than guess
            if any(same_text(text, c.text) for c in out):
                continue  # said twice in one answer: once
            turn = window[n]
            rank = ranks[turn.id] = ranks.get(turn.id, -1) + 1
            out.append(Candidate(f"m-{turn.id}-{rank}", text, turn))
        return out

    def decide(self, user: str, c: Candidate) -> Decision:
        """NONE without asking when the candidate's fact exists (a retry: it was decided the first
        time), ADD without asking when the user has no similar fact; otherwise the LLM's decision,
        checked against the facts it was shown."""
        return self.decide_many(user, [c])[0]

    def decide_many(self, user: str, cs: Sequence[Candidate]) -> list[Decision]:
        """`decide` for each candidate against the memory as it stands now; the questions that need
        the LLM are asked as one batch."""
        catalog = self.memory.catalog
        out: list[Decision | None] = [None] * len(cs)
        asked, calls = [], []
        for i, c in enumerate(cs):
            if catalog.user_exists(user) and catalog.fact(user, c.fact_id) is not None:
                out[i] = Decision("NONE", c)
                continue
            similar = self._similar(user, c.text)
            if not similar or (similar[0].score is not None and similar[0].score < self.ask_above):
                out[i] = Decision("ADD", c, text=c.text)  # nothing in memory is about the same thing
                continue
            if same := next((f for f in similar if same_text(f.text, c.text)), None):
                out[i] = Decision("NONE", c, same)  # memory says it in the same words
                continue
            listed = "\n".join(f"{n}. {f.text}" for n, f in enumerate(similar))
            asked.append((i, similar))
            calls.append(([{"role": "system", "content": self.decide_prompt},
                           {"role": "user", "content": f"Memory:\n{listed}\n\nNew fact: {c.text}"}],
                          decide_schema(len(similar))))
        for (i, similar), answer in zip(asked, self._ask_many(calls)):
            out[i] = self._decision(cs[i], similar, answer)
        return out

    @staticmethod
    def _decision(c: Candidate, similar: list[MemoryFact], answer: dict) -> Decision:
        event, target, text = answer.get("event"), answer.get("target"), str(answer.get("text") or "").strip()
        fact = similar[target] if isinstance(target, int) and 0 <= target < len(similar) else None
        if event == "UPDATE" and fact is not None and text:
            return Decision("UPDATE", c, fact, text)
        if event == "DELETE" and fact is not None:
            return Decision("DELETE", c, fact)
        if event == "NONE":
            return Decision("NONE", c, fact)
        return Decision("ADD", c, text=c.text)  # ADD, or an UPDATE / DELETE naming no listed fact

    def apply(self, user: str, d: Decision, out: Extracted) -> None:
        """Run one decision through the memory service (each step is idempotent on a retry). A
        decision about a fact that an earlier decision of its batch deleted adds its candidate
        (UPDATE) or changes nothing (DELETE, NONE)."""
        m = self.memory
        if d.target is not None and m.catalog.fact(user, d.target.fact_id) is None:
            d = Decision("ADD", d.candidate, text=d.candidate.text) if d.event == "UPDATE" else Decision("NONE", d.candidate)
        if d.event == "ADD":
            t = d.candidate.turn
            m.add(user, facts=[Fact(d.candidate.fact_id, d.text, source_turn=t.id, date=t.date)],
                  quota=self.quota_of(user))
            out.added.append(d.candidate.fact_id)
        elif d.event == "UPDATE":
            if d.target.text != d.text:
                m.update(user, d.target.fact_id, d.text, quota=self.quota_of(user))
            out.updated.append(d.target.fact_id)
        elif d.event == "DELETE":
            m.delete(user, d.target.fact_id)
            out.deleted.append(d.target.fact_id)
        else:
            out.unchanged.append(d.target.fact_id if d.target else d.candidate.fact_id)
        log.info("user %s: %s %s", user, d.event, d.target.fact_id if d.target else d.candidate.fact_id)

    def _similar(self, user: str, text: str) -> list[MemoryFact]:
        if not self.memory.catalog.user_exists(user):
            return []
        return self.memory.search(user, text, k=self.similar)

    def _ask_many(self, calls: list[tuple[list[dict], dict]]) -> list[dict]:
        return [self._parse(raw) for raw in ask_many(self.llm, calls, self.max_tokens)]

    def _parse(self, raw: str) -> dict:
        try:
            answer = json.loads(raw)
        except (TypeError, json.JSONDecodeError) as e:  # e.g. cut off by max_tokens
            raise ExtractionError(f"the LLM's answer is not JSON (cut off at max_tokens={self.max_tokens}?): "
                                  f"{str(raw)[:200]!r}") from e
        if not isinstance(answer, dict):
            raise ExtractionError(f"the LLM's answer is not a JSON object: {str(raw)[:200]!r}")
        return answer
