"""Request bodies (pydantic): the OpenAI chat schema with InferScale's `memory` option, and the
`/v1/memories` bodies. Unknown OpenAI fields are accepted and ignored, except the ones whose
silent omission would change the answer (`UNSUPPORTED`), which are refused with a 400."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logprobs",
               "top_logprobs", "logit_bias", "audio", "modalities", "prediction", "best_of", "echo")


class MemoryOptions(BaseModel):
    """Per request: `"memory": {"enabled": true, "k": 10, "mode": "inject"}` (openai client: `extra_body`)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    k: int | None = Field(None, ge=0, description="facts to retrieve (default: the server's default_k)")
    mode: Literal["inject", "text"] | None = Field(
        None, description="inject: the facts' KV is injected; text: the same facts are prefilled as prompt text")
    fact_ids: list[str] | None = Field(None, description="use exactly these facts, in this order (no search)")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

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
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    memory: MemoryOptions | None = None


class FactIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, description="default: derived from the text")
    text: str
    source_turn: str | None = None
    date: str | None = None


class TurnIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    speaker: str = "user"
    text: str
    session: int = 0
    date: str | None = None


class AddMemories(BaseModel):
    model_config = ConfigDict(extra="forbid")
    facts: list[FactIn] = Field(default_factory=list)
    turns: list[TurnIn] = Field(default_factory=list)


class SearchMemories(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str
    k: int = Field(5, ge=1, le=1000)


class TextUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str
