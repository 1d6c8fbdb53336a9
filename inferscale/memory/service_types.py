"""The memory service's public types: its config, what it returns, its errors, and what it needs
of an encoder (`KVEncoder`: the JAX engine and the torch encoder both satisfy it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from inferscale.common.facts import Fact, Turn
from inferscale.common.bounds import clamp_time
from inferscale.common.metadata import loads
from inferscale.common.modes import ENCODING_CONTEXTS, KV_DTYPES
from inferscale.common.storage.backends import validate_kv_url
from inferscale.common.storage.catalog import FactRow
from inferscale.common.storage.catalogs import validate_catalog_url
# UnknownFactError is the store's class: the service raises the same one (a caller catches one class)
from inferscale.common.storage.format import FactKV, StoreMeta, UnknownFactError  # noqa: F401


class UnknownUserError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class AddInterrupted(RuntimeError):
    """A large add failed after some of its batches had committed; `added` are the committed ids."""

    def __init__(self, added: list[str], cause: BaseException) -> None:
        super().__init__(f"add stopped after committing {len(added)} facts: {type(cause).__name__}: {cause}")
        self.added = added


class KVEncoder(Protocol):
    """What the service needs from an engine (the JAX `Engine`, the torch encoder). An encoder with
    a `builder` (a `PromptBuilder`) lets the service limit facts in tokens."""

    def store_meta(self, w: int, context: str = "turns") -> StoreMeta: ...

    def encode_windowed(self, facts: Sequence[Fact], windows: Sequence[Sequence[Turn]], w: int) -> list[FactKV]: ...

    def encode_listed(self, facts: Sequence[Fact], previous: Sequence[Sequence[Fact]], w: int) -> list[FactKV]: ...

    def encode_conversation(self, facts: Sequence[Fact], spans: Sequence[Sequence[Turn]], w: int) -> list[FactKV]: ...


@dataclass(frozen=True)
class MemoryConfig:
    root: str
    w: int = 5  # context per fact: turns (or facts, see `context`) it is encoded after
    # "turns" (its w preceding turns), "facts" (the w facts before it) or "conversation" (its w
    # turns read from one pass over the conversation: `inferscale.common.prompt.conversation_pass`)
    context: str = "turns"
    kv_dtype: str = "bfloat16"  # how new stores keep KV: bfloat16 (default), float32, float16, int8, float8_e4m3
    index: str = "auto"  # "auto" | "faiss" | "exact"
    max_text_chars: int = 32768  # per turn or fact (checked before anything is tokenized)
    max_fact_tokens: int = 512  # per fact, with its date prefix (a fact is served whole in the prompt)
    ingest_batch: int = 64  # facts encoded and committed together by one add
    catalog: str = ""  # "" (SQLite in root) or a postgresql:// URL shared by replicas
    kv_store: str = ""  # "" (local files in root) or a redis:// URL shared by replicas

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("MemoryConfig.root must name a directory")
        validate_catalog_url(self.catalog, "MemoryConfig.catalog")
        validate_kv_url(self.kv_store, "MemoryConfig.kv_store")
        if self.w < 0:
            raise ValueError(f"MemoryConfig.w must be >= 0, got {self.w}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"MemoryConfig.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.context not in ENCODING_CONTEXTS:
            raise ValueError(f"MemoryConfig.context must be one of {', '.join(ENCODING_CONTEXTS)}, "
                             f"got {self.context!r}")
        if self.index not in ("auto", "faiss", "exact"):
            raise ValueError(f"MemoryConfig.index must be auto, faiss or exact, got {self.index!r}")
        for name in ("max_text_chars", "max_fact_tokens", "ingest_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class MemoryFact:
    fact_id: str
    text: str
    source_turn: str | None
    date: str | None
    version: int
    score: float | None = None
    metadata: dict = field(default_factory=dict)
    expires_at: float | None = None  # UTC epoch seconds
    created_at: float | None = None
    updated_at: float | None = None


@dataclass(frozen=True)
class FactPlan:
    """What a serving engine needs to lay out a prompt and name the KV to inject, read from one
    consistent snapshot: the memory's version and incarnation (both go into prefix-cache salts)
    and per fact (fact id, kv key, token ids)."""

    version: int
    incarnation: str
    facts: list[tuple[str, str, list[int]]]


def _public(row: FactRow, score: float | None = None) -> MemoryFact:
    """A catalog row as reads return it: times clamped into the time range (`bounds.clamp_time`),
    so a value an older version stored never breaks a read."""
    return MemoryFact(row.fact_id, row.text, row.source_turn, row.date, row.version, score, loads(row.metadata),
                      clamp_time(row.expires_at), clamp_time(row.created_at), clamp_time(row.updated_at))
