"""One replica vs two behind the proxy, over shared storage, side by side in one run.

Brings up `scripts/local_cluster.py` (PostgreSQL catalog, Redis KV tier, two `inferscale serve`
replicas each bound to its own share of the cores, vLLM's router hashing `X-User-ID`), ingests one
LoCoMo conversation's memory under `--users` user ids through the proxy (each user's writes land
on its replica; all of it goes to the shared storage), then, for each concurrency level, drives
concurrent streaming clients (throughput.py's client: `"memory": {"k": K, "mode": "inject"}`)
alternately against

* `1 replica`  - replica 0 directly (it serves every user, reading KV from Redis);
* `2 replicas` - the proxy (each user on one replica by consistent hashing),

and prints requests/s and TTFT p50/p99 for both, their ratio, and per run the KV tiers' hit rates:
the replicas' connector host tiers (summed from their `/metrics`) and the shared Redis tier
(`INFO stats` keyspace hits / misses: a miss is KV Redis did not have, which the replica then
encodes again from the catalog).

    python benchmarks/replicas.py --quick     # 4 users x 80 facts, C = 8, 30 s per run (~10 min, 2 cores)
    python benchmarks/replicas.py --users 8 --concurrency 8,32 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import throughput as tp  # benchmarks/ is the script's folder
from bench_args import int_list, print_rows

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("1 replica", "2 replicas")


def parse_args(argv=None) -> argparse.Namespace:
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH

    p = argparse.ArgumentParser(description="Requests/s and TTFT of one replica vs two behind the proxy")
    p.add_argument("path", nargs="?", default=None, help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH})")
    p.add_argument("--quick", action="store_true", help="4 users, first 80 facts, C = 8, 40 requests or 30 s per run")
    p.add_argument("--conversation", type=int, default=0)
    p.add_argument("--users", type=int, default=None, help="user ids holding a copy of the memory (default 8; --quick 4)")
    p.add_argument("--concurrency", type=int_list(1), default=None, help="clients per run (default 8,32; --quick 8)")
    p.add_argument("--requests", type=int, default=None, help="requests per run at most (default 200; --quick 40)")
    p.add_argument("--seconds", type=float, default=None, help="issuing time per run at most (default 120; --quick 30)")
    p.add_argument("--grace", type=float, default=60.0)
    p.add_argument("--k", type=int, default=20, help="facts retrieved per request (default 20)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 8; --quick 2)")
    p.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--json", default=None, help="also write every measurement here")
    a = p.parse_args(argv)
    q = a.quick
    a.users = a.users or (4 if q else 8)
    a.concurrency = a.concurrency or ((8,) if q else (8, 32))
    a.max_tokens = a.max_tokens or (2 if q else 8)
    a.requests = a.requests or (40 if q else 200)
    a.seconds = a.seconds or (30.0 if q else 120.0)
    if min(a.users, a.requests, a.k, a.max_tokens) < 1 or a.seconds <= 0:
        p.error("--users, --requests, --k, --max-tokens and --seconds must be positive")
    a.path = Path(a.path) if a.path else REPO_ROOT / DEFAULT_LOCOMO_PATH
    return a


def start_cluster(args, directory: Path) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "local_cluster.py"), "--replicas", "2", "--port", "0",
           "--dir", str(directory), "--fresh", "--serve-arg=--kv-dtype=bfloat16", "--serve-arg=--log-level=warning"]
    if args.model:
        cmd += ["--model", args.model]
    log = open(directory.parent / "cluster.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    t0 = time.monotonic()
    for line in proc.stdout:
        if line.startswith("CLUSTER "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, json.loads(line[len("CLUSTER "):])
        print("  " + line.rstrip(), flush=True)
        if time.monotonic() - t0 > args.startup_timeout:
            break
    proc.kill()
    raise SystemExit(f"the cluster did not come up (log: {directory.parent / 'cluster.log'})")


def tier_counters(info: dict) -> dict:
    """Summed connector host-tier counters of the replicas, and Redis's keyspace hits / misses."""
    import httpx
    import redis

    out = {"host_hits": 0.0, "host_misses": 0.0}
    for url in info["replicas"]:
        try:
            text = httpx.get(f"{url}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        for ln in text.splitlines():
            if ln.startswith('inferscale_tier_hits_total{tier="host"}'):
                out["host_hits"] += float(ln.split()[-1])
            elif ln.startswith('inferscale_tier_misses_total{tier="host"}'):
                out["host_misses"] += float(ln.split()[-1])
    st = redis.Redis.from_url(info["kv_store"]).info("stats")
    out["redis_hits"], out["redis_misses"] = float(st["keyspace_hits"]), float(st["keyspace_misses"])
    return out


def rate(before: dict, after: dict, hit: str, miss: str) -> float | None:
    h, m = after[hit] - before[hit], after[miss] - before[miss]
    return h / (h + m) if h + m else None


async def drive(info: dict, model: str, users, questions, args) -> list[dict]:
    import httpx

    urls = {"1 replica": info["replicas"][0], "2 replicas": info["proxy"]}
    async with httpx.AsyncClient(timeout=600) as client:  # untimed warm-up: every user on both targets
        for u in users:
            for url in urls.values():
                r = await tp.one_request(client, url, model, u, questions[0], "inject", args)
                if not r["ok"]:
                    raise SystemExit(f"warm-up request failed: {r}")
    rows = []
    for li, conc in enumerate(args.concurrency):
        for target in (TARGETS if li % 2 == 0 else TARGETS[::-1]):  # alternate which runs first
            before = tier_counters(info)
            t = time.perf_counter()
            run = await tp.run_level(urls[target], model, users, questions, "inject", conc, args,
                                     offset=li * args.requests)
            after = tier_counters(info)
            s = tp.summarise(run)
            s.update(target=target, host_hit_rate=rate(before, after, "host_hits", "host_misses"),
                     redis_hit_rate=rate(before, after, "redis_hits", "redis_misses"))
            print(f"  C={conc:3d} {target:10s}: {s['ok']} ok, {s['failed']} failed, {s['rps']:.2f} req/s, "
                  f"TTFT p50 {s['ttft_p50_s'] or 0:.3f} s ({time.perf_counter() - t:.0f} s)", flush=True)
            rows.append(s)
    return rows


def print_table(rows: list[dict], meta: dict) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1e3:,.0f}"  # noqa: E731
    pc = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    head = ("C", "target", "ok", "fail", "req/s", "TTFT p50 ms", "TTFT p99 ms", "host tier hits", "Redis hits")
    body = [(str(r["concurrency"]), r["target"], str(r["ok"]), str(r["failed"] + r["cut"]), f"{r['rps']:.2f}",
             ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]), pc(r["host_hit_rate"]), pc(r["redis_hit_rate"])) for r in rows]
    print_rows(f"\nReplicas over PostgreSQL + Redis, {meta['model']}, k={meta['k']}, {meta['users']} users x "
               f"{meta['facts']} facts, {meta['max_tokens']} tokens per answer, inject, streaming, "
               f"{meta['cores']} cores", head, body)
    by = {(r["concurrency"], r["target"]): r for r in rows}
    print()
    for c in sorted({r["concurrency"] for r in rows}):
        one, two = by.get((c, "1 replica")), by.get((c, "2 replicas"))
        if one and two and one["rps"] and one["ttft_p50_s"] and two["ttft_p50_s"]:
            print(f"C={c}: 2 replicas / 1 replica requests/s {two['rps'] / one['rps']:.2f}x, "
                  f"TTFT p50 {two['ttft_p50_s'] / one['ttft_p50_s']:.2f}x, p99 {two['ttft_p99_s'] / one['ttft_p99_s']:.2f}x")
    for r in rows:
        if r["errors"]:
            print(f"errors (C={r['concurrency']}, {r['target']}): {r['errors']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    turns, facts, questions = tp.load_memory(args.path, args.conversation, args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="inferscale-replicas-"))
    print(f"cluster in {tmp} (log {tmp / 'cluster.log'})", flush=True)
    proc, info = start_cluster(args, tmp / "cluster")
    try:
        proxy = info["proxy"]
        model = httpx.get(f"{info['replicas'][0]}/health", timeout=30).json()["model"]
        users = [f"bench{i}" for i in range(args.users)]
        t = time.perf_counter()
        for i, u in enumerate(users):
            print(f"  ingesting user {i + 1}/{len(users)} through the proxy ({len(facts)} facts, "
                  f"{time.perf_counter() - t:.0f} s so far)", flush=True)
            r = httpx.post(f"{proxy}/v1/memories/{u}", json={"turns": turns, "facts": facts}, timeout=3600,
                           headers={"X-User-ID": u})
            if r.status_code != 200:
                raise SystemExit(f"ingest of {u} failed: {r.status_code} {r.text[:300]}")
        ingest_s = time.perf_counter() - t
        rows = asyncio.run(drive(info, model, users, questions, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    meta = {"model": model, "k": args.k, "users": len(users), "facts": len(facts), "max_tokens": args.max_tokens,
            "ingest_s": ingest_s, "cores": len(os.sched_getaffinity(0))}
    print_table(rows, meta)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": rows}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
