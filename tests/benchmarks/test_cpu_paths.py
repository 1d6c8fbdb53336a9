"""The CPU fast-path benchmark runs end to end (rotation part on a tiny model, small shapes), and
what it prints as the fast path's difference from the reference is within the tests' tolerances."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cpu_paths  # noqa: E402


def test_rotation_part_runs_and_matches_the_reference(tmp_path):
    from tiny_models import make_tiny_model

    make_tiny_model(tmp_path / "m", "llama")
    out = cpu_paths.main(["--parts", "rotation", "--model", str(tmp_path / "m"), "--tokens", "40",
                          "--load-facts", "4", "--rounds", "1"])
    rows = out["rotation"]
    assert [r["dtype"] for r in rows] == list(cpu_paths.ROTATION_DTYPES)
    assert all(r["reference_s"] > 0 and r["fast_s"] > 0 and r["max_k_diff"] < 1e-4 for r in rows)


def test_bad_parts_are_refused():
    with pytest.raises(SystemExit):
        cpu_paths.parse_args(["--parts", "attention,speed"])
