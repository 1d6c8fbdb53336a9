"""Request bodies (pydantic): the OpenAI chat schema with InferScale's `memory` option, and the
`/v1/memories` bodies. Unknown OpenAI fields are accepted and ignored, except the ones whose
silent omission would change the answer (`UNSUPPORTED`), which are refused with a 400.

Every string field of a request is `Text`: valid Unicode (JSON can spell a lone surrogate,
`"\\ud800"`, which no tokenizer, embedder or database can take), else a 400 naming the field.
Integers that reach C code are bounded here: `seed` to what vLLM's sampler accepts (`SEED_MIN`..
`SEED_MAX`, torch's `Generator.manual_seed` range), a turn's `session` to 0..2**31-1. Size limits
that depend on the server's configuration (body bytes, items per add, characters per text or
query) are checked by the app and the routes (`ServerConfig.max_*`). A time (`Time`) is checked against
the time range here (`inferscale.common.bounds`), so a refused one is a 400 naming its field."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from inferscale.common.bounds import MAX_JSON_DEPTH, TIME_RANGE, json_depth_within
from inferscale.common.metadata import to_epoch

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed; outside: an engine error
SESSION_MAX = 2**31 - 1


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return s


def _unicode_within(value: object) -> object:
    """The same check on every string inside `value`, before a union is validated, so that the
    error names the field rather than one of the union's members. Iterative, and bounded to
    `MAX_JSON_DEPTH` levels of lists and objects (a 400, never a recursion error)."""
    if not json_depth_within(value, MAX_JSON_DEPTH):
        raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} lists and objects")
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            _unicode(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return value


def _time(value: object) -> object:
    """A time as a request sends it (ISO 8601 or epoch seconds), checked against the time range
    (`bounds.TIME_RANGE`) before anything else reads it: a boolean is not a time."""
    if value is not None:
        to_epoch(value, "it")
    return value


Text = Annotated[str, AfterValidator(_unicode)]
_UNION = BeforeValidator(_unicode_within)  # Text's check for a union of str and lists (clean error locations)

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "audio", "modalities",
               "prediction", "best_of", "echo")


class MemoryOptions(BaseModel):
    """Per request: `"memory": {"enabled": true, "k": 10, "mode": "inject"}` (openai client: `extra_body`)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    k: Annotated[int, Field(ge=0)] | Literal["all"] | None = Field(
        None, description="facts to retrieve, or \"all\": the whole memory, every live fact in the order they were "
                          "added up to the chain's budget, then the most relevant others (default: the server's "
                          "default_k)")
    mode: Literal["auto", "inject", "text", "chain"] | None = Field(
        None, description="auto: the whole memory from the memory chain, top k as the model's calibrated gate picks "
                          "(inject with a recovery policy, or text); inject: the facts' KV is injected; text: the "
                          "same facts are prefilled as prompt text; chain: the whole memory from the user's memory "
                          "chain (exact: the tokens and answers of text with k \"all\")")
    fact_ids: list[Text] | None = Field(None, description="use exactly these facts, in this order (no search)")
    repeat: Annotated[int, Field(ge=0, le=64)] | None = Field(
        None, description="with the whole memory (k \"all\"): its facts most relevant to the new message repeated as "
                          "text after it, next to the message (default: the server's chain_repeat)")
    policy: Text | None = Field(None, description="recovery policy of mode inject: none, last:N (recompute the last N "
                                                  "facts) or all (default: the server's default_policy)")
    remember: bool | None = Field(None, description="store this exchange (the new message and the answer) after "
                                                    "the answer is sent and extract facts from it in the background "
                                                    "(default: the server's remember)")
    filters: Annotated[dict | None, _UNION] = Field(
        None, description="retrieve only facts that satisfy this filter over metadata and times (docs/api.md)")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Annotated[str | list[ContentPart] | None, _UNION] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type in ("text", "input_text"))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Annotated[str | list[str] | None, _UNION] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    memory: MemoryOptions | None = None


# ISO 8601 (UTC without a zone) or epoch seconds, within TIME_RANGE; the time is read from the value as sent
Time = Annotated[str | float | int | None, BeforeValidator(_time), _UNION]
Metadata = Annotated[dict | None, _UNION]  # checked by `inferscale.common.metadata.check_metadata`


class FactIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Text | None = Field(None, description="default: derived from the text")
    text: Text
    source_turn: Text | None = None
    date: Text | None = None
    metadata: Metadata = Field(None, description="strings, numbers, booleans, lists of strings (filterable)")
    expires_at: Time = Field(None, description="from then on the fact is never retrieved, then forgotten")


class TurnIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Text
    speaker: Text = "user"
    text: Text
    session: int = Field(0, ge=0, le=SESSION_MAX)
    date: Text | None = None


class MessageIn(BaseModel):
    """A chat message to remember: stored as a turn, facts extracted from it in the background."""

    model_config = ConfigDict(extra="forbid")
    id: Text | None = Field(None, description="default: derived from role, content and date")
    role: Literal["user", "assistant", "tool", "system", "developer"]
    content: Text
    name: Text | None = None
    date: Text | None = None


class AddMemories(BaseModel):
    model_config = ConfigDict(extra="forbid")
    facts: list[FactIn] = Field(default_factory=list)
    turns: list[TurnIn] = Field(default_factory=list)
    messages: list[MessageIn] = Field(default_factory=list)


class SearchMemories(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: Text
    k: int = Field(5, ge=1, le=1000)
    filters: Annotated[dict | None, _UNION] = Field(None, description="only facts that satisfy it (docs/api.md)")


class FactUpdate(BaseModel):
    """PATCH a fact: what is sent changes (`expires_at: null`: never expires); the rest stays."""

    model_config = ConfigDict(extra="forbid")
    text: Text | None = None
    metadata: Metadata = None
    expires_at: Time = None


class TextUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
