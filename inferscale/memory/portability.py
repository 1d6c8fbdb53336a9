"""A user's memory as one portable document: export, and import (encoded again for this model).

    doc = svc.export_memory("alice")                 # JSON-ready dict, FORMAT / FORMAT_VERSION
    other_svc.import_memory("alice", doc)            # validates all of it, then writes

A part of `MemoryService`: it reads through `MemoryReads` and writes through `MemoryWrites`.

The document holds what the memory *is*: the conversation's turns (a deleted turn keeps its place,
without text), and the live facts with their metadata, expiry, times and change history. It holds
no KV and no embeddings: both are derived, so importing encodes every fact again for the target's
model, with the same context window it had (the same turns, in the same places), and embeds it
with the target's embedder. A backup, a move between deployments or models, and a person's
right of access are the same document.

Import checks everything before it writes anything: the format and its version, every turn and
fact (ids, texts, metadata, times, limits), that every source turn is in the document, and that
the user holds none of its ids. It then writes as one atomic add (`MemoryService.add(atomic=True)`):
every fact is encoded first, and the turns, facts and history commit in one transaction, with the
tenant's quota checked against all of it, so a refused import (a quota, a failure) writes nothing.
Facts expired by the time of the import are not written. The server bounds an import as it bounds
an add (items, text lengths, body bytes: docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

from inferscale.common.facts import Fact, Turn
from inferscale.common.metadata import check_metadata, iso, to_epoch
from inferscale.memory.core import MemoryCore
from inferscale.memory.quotas import Quota
from inferscale.memory.reads import MemoryReads, readable_event
from inferscale.memory.writes import MemoryWrites

FORMAT = "inferscale.memory"
FORMAT_VERSION = 1
EVENTS = ("ADD", "UPDATE", "DELETE", "REENCODE", "IMPORT")
DELETED_TURN = "(deleted)"  # a deleted turn's text until the import's transaction clears it


@dataclass(frozen=True)
class Imported:
    """What an import wrote: turn and fact ids, and the facts skipped as expired."""

    turns: list[str]
    facts: list[str]
    expired: list[str]

    def to_dict(self) -> dict:
        return {"turns": self.turns, "facts": self.facts, "expired": self.expired}


class Portability:
    def __init__(self, core: MemoryCore, reads: MemoryReads, writes: MemoryWrites) -> None:
        self.core, self.catalog, self.reads, self.writes = core, core.catalog, reads, writes

    def export_memory(self, user: str) -> dict:
        """The user's memory as a document (a read: it never waits for a writer)."""
        self.core.check_user(user)
        with self.catalog.snapshot():
            version = self.catalog.version(user)
            turns = self.catalog.turns(user, include_deleted=True)
            facts = self.reads.list(user)
        out_facts = []
        for f in facts:
            events = [readable_event(e) for e in self.catalog.history(user, f.fact_id)]
            out_facts.append({"id": f.fact_id, "text": f.text, "source_turn": f.source_turn, "date": f.date,
                              "metadata": f.metadata, "expires_at": iso(f.expires_at), "created_at": iso(f.created_at),
                              "updated_at": iso(f.updated_at),
                              "history": [{"event": e["event"], "old_text": e["old_text"], "new_text": e["new_text"],
                                           "metadata": e["metadata"], "expires_at": iso(e["expires_at"]),
                                           "at": iso(e["ts"])} for e in events]})
        return {"format": FORMAT, "version": FORMAT_VERSION, "exported_at": iso(self.core.clock()),
                "memory_version": version,
                "turns": [{"id": t.turn_id, "speaker": t.speaker, "text": t.text, "session": t.session, "date": t.date}
                          for t in turns],
                "facts": out_facts}

    def import_memory(self, user: str, doc: Mapping[str, Any], quota: Quota | None = None) -> Imported:
        """Write `doc` (an `export_memory` document) into `user`'s memory; ValueError naming the first
        problem, before anything is written."""
        turns, deleted, facts, extras = _parse(doc)
        self.core.check_user(user, must_exist=False)
        refused = self.core.limits.refusals(facts, [t for t in turns if t.id not in deleted])
        if refused:
            where, why = next(iter(refused.items()))
            raise ValueError(f"{where}: {why}")
        if self.catalog.user_exists(user):
            have_turns = {t.turn_id for t in self.catalog.turns(user, include_deleted=True)}
            clash = [t.id for t in turns if t.id in have_turns] or [f.id for f in facts
                                                                  if self.catalog.fact(user, f.id) is not None]
            if clash:
                raise ValueError(f"user {user!r} already holds {clash[0]!r}: import into a new user, or delete it first")
        now = self.core.clock()
        live = [f for f in facts if f.expires_at is None or f.expires_at > now]
        if turns or live:  # one transaction: a refusal anywhere (a quota, the encoder) writes nothing
            self.writes.add(user, facts=live, turns=turns, quota=quota, imported={f.id: extras[f.id] for f in live},
                            deleted_turns=deleted, atomic=True)
        written = {f.id for f in live}
        return Imported([t.id for t in turns], [f.id for f in live], [f.id for f in facts if f.id not in written])


def _parse(doc: Mapping[str, Any]) -> tuple[list[Turn], set[str], list[Fact], dict[str, dict]]:
    if not isinstance(doc, Mapping):
        raise ValueError(f"the document must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"version {doc.get('version')!r} of {FORMAT} is not one this InferScale reads "
                         f"({FORMAT_VERSION})")
    turns, deleted, seen = [], set(), set()
    for i, t in enumerate(_list(doc, "turns")):
        where = f"turns.{i}"
        _object(t, where, ("id", "speaker", "text", "session", "date"))
        text = t.get("text")
        try:
            turn = Turn(t.get("id"), t.get("speaker", "user"), DELETED_TURN if text is None else text,
                        t.get("session", 0), t.get("date"))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
        if turn.id in seen:
            raise ValueError(f"{where}: turn {turn.id!r} appears twice")
        seen.add(turn.id)
        if text is None:
            deleted.add(turn.id)
        turns.append(turn)
    facts, extras = [], {}
    for i, f in enumerate(_list(doc, "facts")):
        where = f"facts.{i}"
        _object(f, where, ("id", "text", "source_turn", "date", "metadata", "expires_at", "created_at", "updated_at",
                           "history"))
        try:
            expires = f.get("expires_at")
            fact = Fact(f.get("id"), f.get("text"), f.get("source_turn"), f.get("date"), f.get("metadata") or {},
                        None if expires is None else to_epoch(expires, f"{where}.expires_at"))
            times = {k: to_epoch(f[k], f"{where}.{k}") for k in ("created_at", "updated_at") if f.get(k) is not None}
            history = [_event(e, f"{where}.history.{j}") for j, e in enumerate(f.get("history") or [])]
        except (ValueError, TypeError) as e:
            raise ValueError(e if str(e).startswith(where) else f"{where}: {e}") from None
        if fact.id in extras:
            raise ValueError(f"{where}: fact {fact.id!r} appears twice")
        if fact.source_turn is not None and fact.source_turn not in seen:
            raise ValueError(f"{where}: source turn {fact.source_turn!r} is not among the document's turns")
        facts.append(fact)
        extras[fact.id] = {**times, "history": history}
    return turns, deleted, facts, extras


def _list(doc: Mapping, name: str) -> list:
    value = doc.get(name, [])
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list")
    return value


def _object(value: object, where: str, fields: tuple[str, ...]) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object")
    unknown = set(value) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")


def _event(e: object, where: str) -> dict:
    _object(e, where, ("event", "old_text", "new_text", "metadata", "expires_at", "at"))
    if e.get("event") not in EVENTS:
        raise ValueError(f"{where}.event must be one of {', '.join(EVENTS)}, got {e.get('event')!r}")
    for k in ("old_text", "new_text"):
        if e.get(k) is not None and not isinstance(e[k], str):
            raise ValueError(f"{where}.{k} must be a string or null")
    expires = e.get("expires_at")
    fact = SimpleNamespace(metadata=check_metadata(e.get("metadata"), f"{where}.metadata"),
                           expires_at=None if expires is None else to_epoch(expires, f"{where}.expires_at"))
    return {"event": e["event"], "old_text": e.get("old_text"), "new_text": e.get("new_text"), "fact": fact,
            "ts": to_epoch(e["at"], f"{where}.at") if e.get("at") is not None else None}
