"""Fact extraction in the background: an add with messages returns a job at once.

    jobs = ExtractionJobs(memory, extractor)       # one worker thread
    job = jobs.submit("alice", messages)            # the messages are stored (durable) before it returns
    jobs.get("alice", job["id"])                    # {"id", "state", "progress" | "outcome" | "error", ...}

A job is a row of the catalog (`jobs` table), written in the same storage as the turns it reads,
so it survives a crash and every replica sees it. Its id is derived from the user and the ids of
its messages: submitting the same messages again returns the same job (and, once it is done, its
outcome) instead of extracting twice. On start, `resume()` queues again every job a crash left
queued or running: the extractor's steps are idempotent (`inferscale.memory.extraction`), so a job
resumed part way finishes without duplicating a fact.

Extraction never competes with chats for more than one engine request at a time: one worker
thread runs the jobs in order, and each of its LLM calls waits for the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from typing import Sequence

from inferscale.common.facts import Turn
from inferscale.memory.extraction import Extractor, turns_from_messages

log = logging.getLogger("inferscale.memory.jobs")

STATES = ("queued", "running", "done", "failed")


def job_id(user: str, turn_ids: Sequence[str]) -> str:
    return "job-" + hashlib.sha256(json.dumps([user, list(turn_ids)]).encode()).hexdigest()[:20]


class ExtractionJobs:
    def __init__(self, memory, extractor: Extractor, start: bool = True) -> None:
        """`start=False`: jobs are queued but run only when `start()` is called (or `run` is)."""
        self.memory, self.extractor = memory, extractor
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="inferscale-extraction", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def check(self, messages: Sequence[dict]) -> list[Turn]:
        """The turns `messages` are stored as; ValueError naming the message that cannot be (an
        invalid id, a text over the memory's limits) or saying there is nothing to remember."""
        turns = turns_from_messages(messages)
        if not turns:
            raise ValueError("messages holds no user, assistant or tool message to remember")
        for t in turns:
            self.memory.limits.check_turn(t)
        return turns

    def submit(self, user: str, messages: Sequence[dict]) -> dict:
        """Store `messages` as the user's turns and queue their extraction; returns the job. The
        same messages again (by id) return the job already made for them."""
        turns = self.check(messages)
        self.extractor.store_turns(user, turns)  # durable before the job is acknowledged
        ids = [t.id for t in turns]
        jid = job_id(user, ids)
        catalog = self.memory.catalog
        with catalog.transaction() as db:
            new = catalog.insert_job(db, user, jid, json.dumps(ids))
        if new:
            self._queue.put((user, jid))
        return self.get(user, jid)

    def get(self, user: str, jid: str) -> dict:
        """The job as the API shows it; KeyError when the user has no such job."""
        row = self.memory.catalog.job(user, jid) if self.memory.catalog.user_exists(user) else None
        if row is None:
            raise KeyError(f"user {user!r} has no job {jid!r}")
        out = {"id": row.job_id, "object": "memory.job", "state": row.state, "created": row.created,
               "updated": row.updated, "messages": len(json.loads(row.turn_ids))}
        if row.outcome:
            out["outcome" if row.state == "done" else "progress"] = json.loads(row.outcome)
        if row.error:
            out["error"] = row.error
        return out

    def resume(self) -> int:
        """Queue again the jobs a stop or crash left queued or running; how many."""
        n = 0
        for user in self.memory.users():
            for row in self.memory.catalog.jobs(user, unfinished=True):
                self._queue.put((user, row.job_id))
                n += 1
        if n:
            log.info("resuming %d extraction job(s) left unfinished", n)
        return n

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every queued job finished within `timeout` seconds (tests, shutdown)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        """Stop taking jobs; the one running finishes its current step and stays resumable."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _work(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            try:
                if item is not None and not self._stop.is_set():
                    self.run(*item)
            finally:
                self._queue.task_done()

    def run(self, user: str, jid: str) -> None:
        """Run one job to its end in this thread (what the worker does with each queued job)."""
        catalog = self.memory.catalog
        row = catalog.job(user, jid) if catalog.user_exists(user) else None
        if row is None or row.state in ("done", "failed"):
            return  # deleted with its user, or finished before a resume queued it twice
        catalog.set_job(user, jid, "running")
        try:
            turns = self._turns(user, json.loads(row.turn_ids))

            def progress(done: int, total: int, what: str) -> None:
                catalog.set_job(user, jid, "running", json.dumps({"done": done, "total": total, "step": what}))

            outcome = self.extractor.remember(user, turns, progress=progress)
            catalog.set_job(user, jid, "done", json.dumps(outcome.to_dict()))
            log.info("job %s of user %s: added %d, updated %d, deleted %d", jid, user, len(outcome.added),
                     len(outcome.updated), len(outcome.deleted))
        except Exception as e:  # the job fails with its reason; the server goes on
            log.warning("job %s of user %s failed: %r", jid, user, e)
            if catalog.user_exists(user):
                catalog.set_job(user, jid, "failed", error=f"{type(e).__name__}: {e}")

    def _turns(self, user: str, ids: list[str]) -> list[Turn]:
        rows = {r.turn_id: r for r in self.memory.catalog.turns(user)}
        return [Turn(r.turn_id, r.speaker, r.text, r.session, r.date) for i in ids if (r := rows.get(i))]
