"""Editing a conversation's turns after the fact: the facts whose encoding window held the turn
are encoded again, so their KV never carries text the memory no longer has. A part of
`MemoryService` (on its `core`: the catalog, stores and locks)."""

from __future__ import annotations

from inferscale.common.facts import validate_id
from inferscale.memory.contexts import EncodingContexts, fact_of
from inferscale.memory.core import MemoryCore
from inferscale.memory.crash_recovery import CrashRecovery
from inferscale.memory.encoding import FactEncoding


class TurnEdits:
    def __init__(self, core: MemoryCore, encoding: FactEncoding, contexts: EncodingContexts,
                 recovery: CrashRecovery) -> None:
        self.core, self.catalog, self.encoding, self.contexts, self.recovery = (core, core.catalog, encoding,
                                                                                 contexts, recovery)

    def update_turn(self, user: str, turn_id: str, text: str) -> list[str]:
        """Edit a turn; re-encodes exactly the facts whose window contains it. Returns their ids."""
        self.core.limits.check_text(text, f"turn {turn_id!r}")
        return self._change_turn(user, turn_id, text)

    def delete_turn(self, user: str, turn_id: str) -> list[str]:
        """Delete a turn's text (it keeps its place); re-encodes the facts whose window held it."""
        return self._change_turn(user, turn_id, None)

    def _change_turn(self, user: str, turn_id: str, text: str | None) -> list[str]:
        self.core.check_user(user)
        validate_id("turn", turn_id)
        with self.core.writer(user):
            self.recovery.recover(user)
            old = self.catalog.turn(user, turn_id)
            if old is None or old.text is None:
                raise ValueError(f"user {user!r} has no turn {turn_id!r}")
            rows = self.catalog.facts(user)
            facts = [fact_of(r) for r in rows]
            context = self.core.config.context
            spans = context == "conversation"  # a fact's KV depends on its whole span
            before = self.contexts.windows(user, facts, spans=spans) if context != "facts" else [[] for _ in facts]
            affected = [(r, f) for r, f, win in zip(rows, facts, before) if any(t.id == turn_id for t in win)]
            after = self.contexts.windows(user, [f for _, f in affected], edits={turn_id: text}, spans=spans)
            version = self.catalog.version(user) + 1
            kvs = (self.encoding.encode([f for _, f in affected], after, self.catalog.incarnation(user), version)
                   if affected else [])
            store = self.core.store(user)
            if kvs:
                store.put(kvs)
            with self.catalog.transaction() as db:
                v = self.catalog.bump_version(db, user)
                self.catalog.set_turn_text(db, user, turn_id, text)
                self.encoding.reencoded(db, user, v, [r for r, _ in affected], kvs)
            self.core.forget_kv(store, [r.kv_key for r, _ in affected])  # KV that saw the old turn
            self.core.indexes.apply(user, v)  # no index change; keeps the cached index current
            if text is None:
                self.catalog.checkpoint()
            return [r.fact_id for r, _ in affected]
