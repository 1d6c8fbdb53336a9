"""vLLM engines in processes of their own, for tests that need another connector configuration
(vLLM keeps one worker-side connector per process, built for one model and one configuration) or
a real server process.

Most of an engine's start is a fresh Python importing vLLM, torch and transformers; a second
engine in the same process, once the first is shut down, skips that (vLLM drops the
worker's connector when its worker shuts down, and the next engine builds a fresh one). So the
engine tests hand their scripts to one runner for the whole session (`engine_cases` in
tests/vllm/conftest.py): every script is a *case*, the cases run one after another in two
processes, each pinned to a core of its own, and each case reports its own result or its own
failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future

# Runs the cases given as JSON on stdin, in order, in this one process. A case is a script that
# shuts its engine down before it ends (try/finally) and leaves its result in a variable RESULT.
DRIVER = """
import gc, json, sys, traceback
for name, code in json.load(sys.stdin):
    print(f"CASE {name}", file=sys.stderr, flush=True)
    scope = {"__name__": "__case__"}
    try:
        exec(compile(code, f"<case {name}>", "exec"), scope)
        print("RESULT " + json.dumps([name, scope["RESULT"]]), flush=True)
    except BaseException:
        print("FAILED " + json.dumps([name, traceback.format_exc()]), flush=True)
    del scope
    gc.collect()  # the engine's model and KV cache sit in reference cycles: free them before the next
"""


def engine_env(in_process_worker: bool = True) -> dict:
    """The environment of a test's vLLM process: offline, no usage reports, loopback, 1 GiB of
    CPU KV cache; the worker inside the engine-core process unless `in_process_worker` is off."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_KVCACHE_SPACE="1")
    if in_process_worker:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class CaseFailed(AssertionError):
    pass


def _run_process(cases: list[tuple[str, str]], futures: dict[str, Future], core: int | None, timeout: float) -> None:
    env = engine_env()
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), env=env, capture_output=True,
                              text=True, timeout=timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = e.stdout or "", e.stderr or "", f"killed after {timeout:.0f} s"
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    for line in out.splitlines():
        kind, _, payload = line.partition(" ")
        if kind in ("RESULT", "FAILED"):
            name, value = json.loads(payload)
            if kind == "RESULT":
                futures[name].set_result(value)
            else:
                futures[name].set_exception(CaseFailed(f"case {name} failed:\n{value}"))
    for name, _ in cases:  # the process died (or timed out) before this case reported
        if not futures[name].done():
            futures[name].set_exception(CaseFailed(f"case {name}: the engine process ended ({rc}) first; its "
                                                   f"stderr ends:\n{err[-4000:]}"))


def run_engine_cases(cases: dict[str, str], timeout: float = 1200) -> dict[str, Future]:
    """Start `cases` (name -> script that sets RESULT, a JSON-able value) in two processes on a
    machine with two or more cores (one otherwise), each pinned to a core of its own (vLLM CPU
    binds its worker's threads to one core; two engines left to choose would both take the same
    one), the cases dealt to them in turn. Returns name -> future of the case's RESULT, which
    raises `CaseFailed` with the case's traceback (or the process's stderr)."""
    cores = sorted(os.sched_getaffinity(0))
    slots = cores[:2] if len(cores) >= 2 else [None]
    futures = {name: Future() for name in cases}
    items = list(cases.items())
    for i, core in enumerate(slots):
        share = items[i::len(slots)]
        if share:
            threading.Thread(target=_run_process, args=(share, futures, core, timeout), daemon=True,
                             name=f"engine-cases-{i}").start()
    return futures


def selected(request, module_name: str) -> list:
    """The tests of module `module_name` (its basename) that this session runs (after -k and
    deselection)."""
    return [it for it in request.session.items if it.module.__name__.rsplit(".", 1)[-1] == module_name]


def selected_params(items: list, name: str) -> list:
    """The distinct values of parameter `name` among `items`, in order."""
    return list(dict.fromkeys(it.callspec.params[name] for it in items
                              if name in getattr(getattr(it, "callspec", None), "params", {})))
