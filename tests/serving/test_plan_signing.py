"""Signed memory plans (`inferscale.common.prompt.plan_signing`): only a plan signed with the secret for
exactly its prompt passes; the secret is made once, private, and the same for processes that
start together."""

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from inferscale.common.prompt.plan import PLAN_KEY, MemoryPlan, PlanError, PlanSegment
from inferscale.common.prompt.plan_signing import load_secret, secret_path, sign, verify

PLAN = MemoryPlan("default:alice", 3, (PlanSegment("shared", "header~1", 0, 4), PlanSegment("user", "cat~1", 4, 6)), "inc1")
IDS = list(range(20))


def test_only_the_signed_plan_for_its_own_prompt_passes(tmp_path):
    secret = load_secret(tmp_path / "s")
    signed = sign(PLAN.to_params(), IDS, secret)
    verify(signed, IDS, secret)
    assert MemoryPlan.from_params(signed) == PLAN  # the signature travels beside the plan's fields
    with pytest.raises(PlanError, match="not signed"):
        verify(PLAN.to_params(), IDS, secret)
    with pytest.raises(PlanError, match="another prompt"):
        verify(signed, IDS[:-1] + [99], secret)  # replayed with another question
    other_user = {PLAN_KEY: {**signed[PLAN_KEY], "user": "default:bob"}}
    with pytest.raises(PlanError, match="does not match"):
        verify(other_user, IDS, secret)  # the plan edited after signing
    with pytest.raises(PlanError, match="does not match"):
        verify(signed, IDS, load_secret(tmp_path / "other"))  # another deployment's secret
    with pytest.raises(PlanError, match="not signed"):
        verify({PLAN_KEY: {**signed[PLAN_KEY], "sig": 7}}, IDS, secret)


def test_the_secret_is_made_once_private_and_shared_by_processes_starting_together(tmp_path):
    path = secret_path(str(tmp_path / "mem"))
    assert path == tmp_path / "mem" / "plan-secret" and secret_path("x", str(tmp_path / "k")) == tmp_path / "k"
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: load_secret(path), range(16)))
    assert len(keys) == 1 and len(keys.pop()) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["plan-secret"]  # no temporary file left
    with pytest.raises(FileNotFoundError):
        load_secret(tmp_path / "none", create=False)
    (tmp_path / "bad").write_text("not hex")
    with pytest.raises(ValueError, match="hex"):
        load_secret(tmp_path / "bad")
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(ValueError, match="too short"):
        load_secret(tmp_path / "short")
