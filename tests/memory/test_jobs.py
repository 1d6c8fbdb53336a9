"""Extraction jobs (`inferscale.memory.jobs`) over both catalogs (SQLite, and PostgreSQL + Redis as
replicas share them): the messages are stored before the job is acknowledged, the job reports
progress and its outcome, the same messages return the same job, a failure is reported with its
reason, and a job a crash left running is resumed without duplicating a fact."""

import threading

import pytest


from inferscale.memory.jobs import ExtractionJobs
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig
from test_extraction import CHAT, FACTS_OF, Extractor, StubLLM


@pytest.fixture
def svc(tmp_path, encoder, embedder, storage):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=2, index="exact", **storage), encoder, embedder)
    yield s
    s.close()


def test_a_job_stores_the_messages_then_extracts_in_the_background(svc):
    gate = threading.Event()

    class Held(StubLLM):
        def complete_json(self, messages, schema, max_tokens):
            gate.wait(30)
            return super().complete_json(messages, schema, max_tokens)

    jobs = ExtractionJobs(svc, Extractor(svc, Held(FACTS_OF)))
    try:
        job = jobs.submit("maya", CHAT)
        assert job["state"] in ("queued", "running") and job["messages"] == 3
        assert [t.turn_id for t in svc.catalog.turns("maya")] == ["m1", "m2", "m3"]  # durable already
        assert jobs.submit("maya", CHAT)["id"] == job["id"]  # the same messages: the same job
        gate.set()
        assert jobs.wait_idle(30)
        done = jobs.get("maya", job["id"])
        assert done["state"] == "done" and done["outcome"]["added"] == ["m-m1-0", "m-m3-0", "m-m3-1"]
        assert jobs.submit("maya", CHAT)["outcome"] == done["outcome"]  # a retry after it finished
        assert len(svc.list("maya")) == 3
        with pytest.raises(KeyError):
            jobs.get("maya", "job-nope")
        with pytest.raises(ValueError, match="no user, assistant or tool"):
            jobs.submit("maya", [{"role": "system", "content": "be kind"}])
    finally:
        gate.set()
        jobs.close()


def test_a_failing_job_says_why_and_the_next_one_runs(svc):
    class Down:
        def complete_json(self, messages, schema, max_tokens):
            raise ConnectionError("the engine went away")

    jobs = ExtractionJobs(svc, Extractor(svc, Down()))
    try:
        job = jobs.submit("maya", CHAT)
        assert jobs.wait_idle(30)
        failed = jobs.get("maya", job["id"])
        assert failed["state"] == "failed" and "the engine went away" in failed["error"]
    finally:
        jobs.close()
    jobs = ExtractionJobs(svc, Extractor(svc, StubLLM(FACTS_OF)))
    try:
        other = jobs.submit("maya", [{"id": "m4", "role": "user", "content": "I moved to Leeds last week."}])
        assert jobs.wait_idle(30) and jobs.get("maya", other["id"])["state"] == "done"
    finally:
        jobs.close()


def test_a_job_left_running_by_a_crash_is_resumed_without_duplicates(svc):
    class Crash(StubLLM):
        def complete_json(self, messages, schema, max_tokens):
            if len(self.calls) == 2:  # the extraction and one decision went through: "the process dies"
                raise SystemExit
            return super().complete_json(messages, schema, max_tokens)

    jobs = ExtractionJobs(svc, Extractor(svc, Crash(FACTS_OF)), start=False)  # run here, where SystemExit stops it
    job = jobs.submit("maya", CHAT)
    with pytest.raises(SystemExit):
        jobs.run("maya", job["id"])
    assert jobs.get("maya", job["id"])["state"] == "running" and 0 < len(svc.list("maya")) < 3
    again = ExtractionJobs(svc, Extractor(svc, StubLLM(FACTS_OF)))  # the next server start
    try:
        assert again.resume() == 1 and again.wait_idle(30)
        assert again.get("maya", job["id"])["state"] == "done"
        assert sorted(f.fact_id for f in svc.list("maya")) == ["m-m1-0", "m-m3-0", "m-m3-1"]
    finally:
        again.close()
    svc.delete_user("maya")  # its jobs go with it
    assert not svc.catalog.user_exists("maya") and not svc.catalog.jobs("maya")
