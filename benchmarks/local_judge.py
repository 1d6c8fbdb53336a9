"""A local LLM judge for the LoCoMo benchmarks: `inferscale serve` with memory off, judged through
its OpenAI-compatible endpoint (`inferscale.evaluation.judge`, Mem0's binary J rubric).

    with local_judge(model_dir, log_path, concurrency=4) as config:     # a JudgeConfig
        verdicts = Judge(config).judge_many([(question, gold, prediction), ...])

The server runs in a subprocess on a free loopback port with a memory root of its own (its
requests name no user, so no memory is retrieved or injected: the model judges from the rubric
alone), and is stopped, engine included, when the block ends. Start it after the benchmark's own
engine is gone: a 1.5B model in vLLM holds ~12 GB on CPU.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from throughput import REPO_ROOT, free_port, server_env, stop_server, wait_healthy  # benchmarks/ is the script's folder

from inferscale.evaluation.judge import JudgeConfig


def judge_command(model: str | None, root: str, port: int, concurrency: int) -> list[str]:
    cmd = [sys.executable, "-m", "inferscale.cli", "serve", "--store", root, "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(concurrency), "--max-queued", "256", "--timeout", "900", "--log-level", "warning"]
    return cmd + (["--model", model] if model else [])


@contextmanager
def local_judge(model: str | None, log_path: Path, concurrency: int = 4,
                startup_timeout_s: float = 900.0) -> Iterator[JudgeConfig]:
    """The judge's config while its server runs (`model`: a model folder; None: the packaged SmolLM2)."""
    root = tempfile.mkdtemp(prefix="inferscale-judge-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = judge_command(model, root, port, concurrency)
    print("judge server:", " ".join(cmd[1:]), f"(log: {log_path})", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(), cwd=str(REPO_ROOT),
                                start_new_session=True)
    try:
        health = wait_healthy(url, proc, startup_timeout_s, log_path)
        yield JudgeConfig(base_url=f"{url}/v1", model=health["model"], timeout_s=900.0, concurrency=concurrency,
                          max_tokens=120)
    finally:
        stop_server(proc)
        shutil.rmtree(root, ignore_errors=True)
