"""vLLM engines in processes of their own, for tests that need a second connector configuration
(vLLM keeps one worker-side connector per process) or a real server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def engine_env(in_process_worker: bool = True) -> dict:
    """The environment of a test's vLLM process: offline, no usage reports, loopback, 1 GiB of
    CPU KV cache; the worker inside the engine-core process unless `in_process_worker` is off."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_KVCACHE_SPACE="1")
    if in_process_worker:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def run_engine_script(code: str, timeout: float = 600) -> dict:
    """Run `code` in a fresh Python with `engine_env()`; the JSON of its last `RESULT {...}` line
    (the test fails with the script's stderr when it exits badly or prints none)."""
    proc = subprocess.run([sys.executable, "-c", code], env=engine_env(), capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
