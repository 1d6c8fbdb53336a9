"""The GPU kernel check runs end to end on CPU (interpreted kernels, small shapes), so the script a
GPU session runs once is known to work before it gets there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_passes_every_kernel(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--json", str(out)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text()) if "err" in r]
    names = {r["kernel"].split()[0] for r in rows}
    assert names == {"inject_pallas", "inject_compact_pallas", "paged_attention_pallas", "rotate_triton",
                     "dequantize_rotate_triton"}
    assert all(r["err"] <= r["tol"] and r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
