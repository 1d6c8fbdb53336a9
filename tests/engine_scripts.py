"""vLLM engines in processes of their own, for tests that need a second connector configuration
(vLLM keeps one worker-side connector per process) or a real server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor


def engine_env(in_process_worker: bool = True) -> dict:
    """The environment of a test's vLLM process: offline, no usage reports, loopback, 1 GiB of
    CPU KV cache; the worker inside the engine-core process unless `in_process_worker` is off."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_KVCACHE_SPACE="1")
    if in_process_worker:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def run_engine_script(code: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Run `code` in a fresh Python with `engine_env()`; the JSON of its last `RESULT {...}` line
    (the test fails with the script's stderr when it exits badly or prints none)."""
    return _result(subprocess.run([sys.executable, "-c", code], env=env or engine_env(), capture_output=True,
                                  text=True, timeout=timeout))


def run_engine_scripts(codes: dict[str, str], timeout: float = 600) -> dict[str, Future]:
    """Start `codes` (name -> script, as `run_engine_script` takes) two at a time on a machine with
    two or more cores, each pinned to a core of its own (vLLM CPU binds its worker's threads to one
    core; two engines left to choose would both take the same one). Returns name -> future of the
    script's result, which raises as `run_engine_script` fails; each test waits for its own."""
    cores = sorted(os.sched_getaffinity(0))
    slots = cores[:2] if len(cores) >= 2 else [None]
    free = list(slots)

    def run(code: str) -> dict:
        core = free.pop()  # the pool has as many workers as slots: one is always free here
        try:
            env = engine_env()
            if core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
            return run_engine_script(code, timeout, env)
        finally:
            free.append(core)

    pool = ThreadPoolExecutor(len(slots), thread_name_prefix="engine-script")
    futures = {name: pool.submit(run, code) for name, code in codes.items()}
    pool.shutdown(wait=False)  # the queued scripts still run; the threads end with them
    return futures


def selected_params(request, name: str) -> list:
    """The values of parameter `name` among this module's tests that the session will run (after
    -k / deselection), so a module fixture starts only the scripts those tests wait for."""
    return list(dict.fromkeys(it.callspec.params[name] for it in request.session.items
                              if it.module is request.module and name in getattr(getattr(it, "callspec", None),
                                                                                  "params", {})))
