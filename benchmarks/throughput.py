"""Serving throughput and TTFT under concurrent users: KV injection vs the facts as prompt text.

Starts `inferscale serve` (a subprocess, loopback only, SmolLM2-135M-Instruct unless `--model`),
ingests one LoCoMo conversation's memory (turns + facts, Context-Window Encoding with w=5) under
`--users` user ids through `POST /v1/memories/{user}` (the same memory copied under each id: each
copy is encoded and stored on its own), then drives C concurrent clients (real HTTP, httpx async,
streaming) for each concurrency level C and each mode:

* inject - `"memory": {"k": 50, "mode": "inject"}`: the retrieved facts' KV is injected by the
           connector, vLLM prefills only the footer and the question;
* text   - `"memory": {"k": 50, "mode": "text"}`: the same server retrieves the same facts and
           prefills them as prompt text (the usual retrieve-and-paste memory);
* chain  - `"memory": {"mode": "chain"}` (`--modes chain,text-all`): the whole memory from each
           user's memory chain (its facts' KV encoded jointly), against
* text-all - `"memory": {"k": "all", "mode": "text"}`: the same whole memory prefilled as text.

Each client loops: next LoCoMo question of the conversation (cycled), next user (round robin), one
streaming chat request; a run stops issuing after `--requests` requests or `--seconds`, whichever
comes first, and waits a bounded grace for the requests in flight (any still running are cut:
the client disconnects and the server aborts them). TTFT is the client's time from sending the
request to the first chunk with content (so it includes queueing, retrieval and prefill); the
engine TTFT is the server's own split (`inferscale.timings.engine_ttft_s`: submission to first
token). vLLM's prefix cache is on for both modes, as in production (per-user salts); the table
shows how many prompt tokens vLLM did not compute (injected + prefix-cache hits).

After the runs the server's `/health` (with the engine probe on) must show no request in vLLM's
frontend or scheduler, no connector state, KV-cache usage 0 and no admission slot held.

    python benchmarks/throughput.py --quick       # 1 user, 80 facts, C = 10, 2 tokens per answer (~5 min, 2 cores)
    python benchmarks/throughput.py               # 8 users, all facts, C = 10, 50, 100, 8 tokens per answer
    python benchmarks/throughput.py --concurrency 10,100 --requests 300 --json out.json
    python benchmarks/throughput.py --modes chain,text-all --users 100 --concurrency 100   # the whole memory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import int_list, print_rows  # benchmarks/ is the script's folder

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

MODES = {"inject": {"mode": "inject"}, "text": {"mode": "text"},  # top k (--k)
         "chain": {"mode": "chain"}, "text-all": {"k": "all", "mode": "text"}}  # the whole memory
QUICK_FACTS = 80


def parse_args(argv=None) -> argparse.Namespace:
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH

    p = argparse.ArgumentParser(description="Requests/s and TTFT of `inferscale serve` under concurrent users: "
                                            "KV injection vs the facts as prompt text.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--quick", action="store_true", help="1 user, first 80 facts, C = 10, 40 requests or 30 s per "
                                                        "run, 2 tokens per answer")
    p.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation (default 0)")
    p.add_argument("--users", type=int, default=None, help="user ids holding a copy of the memory (default 8; "
                                                           "--quick 1)")
    p.add_argument("--concurrency", type=int_list(1), default=None,
                   help="concurrent clients per run, comma-separated (default 10,50,100; --quick 10)")
    p.add_argument("--requests", type=int, default=None, help="requests per run at most (default 200; --quick 40)")
    p.add_argument("--seconds", type=float, default=None, help="issuing time per run at most (default 120; "
                                                               "--quick 30)")
    p.add_argument("--grace", type=float, default=60.0, help="wait for in-flight requests after a run (default 60 s)")
    p.add_argument("--k", type=int, default=50, help="facts retrieved per request (default 50)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 8; "
                                                                 "--quick 2)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server")
    add_flags(p, EngineSettings, defaults={"kv_dtype": "float32"})  # float32: as the README's runs
    p.add_argument("--modes", default="inject,text", help=f"what each run serves, comma-separated, of "
                                                          f"{', '.join(MODES)} (default: inject,text)")
    p.add_argument("--json", default=None, help="also write every measurement and the summary here")
    a = p.parse_args(argv)
    a.modes = tuple(m for m in a.modes.split(",") if m)
    if not a.modes or any(m not in MODES for m in a.modes):
        p.error(f"--modes: each of {', '.join(MODES)}, got {a.modes!r}")
    q = a.quick
    a.users = a.users or (1 if q else 8)
    a.concurrency = a.concurrency or ((10,) if q else (10, 50, 100))
    a.max_tokens = a.max_tokens or (2 if q else 8)
    a.requests = a.requests or (40 if q else 200)
    a.seconds = a.seconds or (30.0 if q else 120.0)
    if a.users < 1 or a.requests < 1 or a.k < 1 or a.max_tokens < 1 or a.seconds <= 0:
        p.error("--users, --requests, --k, --max-tokens and --seconds must be positive")
    if max(a.concurrency) > 100:
        p.error("--concurrency: at most 100 clients")
    a.path = Path(a.path) if a.path else REPO_ROOT / DEFAULT_LOCOMO_PATH
    return a


# -- the memory ----------------------------------------------------------------------------------
def load_memory(path: Path, conversation: int, quick: bool):
    """(turns, facts, questions) as JSON-ready dicts: quick = the first QUICK_FACTS facts and the
    turns up to the last of their source turns."""
    from inferscale.evaluation.locomo import load_locomo

    samples = load_locomo(path)
    if not 0 <= conversation < len(samples):
        raise SystemExit(f"--conversation must be in [0, {len(samples)})")
    s = samples[conversation]
    conv = s.conversation
    facts = list(conv.facts[:QUICK_FACTS] if quick else conv.facts)
    turns = list(conv.turns)
    if quick:
        pos = {t.id: i for i, t in enumerate(turns)}
        last = max((pos[f.source_turn] for f in facts if f.source_turn is not None), default=len(turns) - 1)
        turns = turns[: last + 1]
    tj = [{"id": t.id, "speaker": t.speaker, "text": t.text, "session": t.session, "date": t.date}
          for t in turns]
    fj = [{"id": f.id, "text": f.text, "source_turn": f.source_turn, "date": f.date} for f in facts]
    questions = [qa.question for qa in s.questions if qa.question.strip()]
    return tj, fj, questions


# -- the server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    """The environment of an `inferscale serve` subprocess: offline, loopback, a small CPU KV cache."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_HOST_IP="127.0.0.1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def start_server(args, root: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = server_env()
    cmd = [sys.executable, "-m", "inferscale.cli", "serve", "--store", str(root), "--host", "127.0.0.1",
           "--port", str(port), "--max-concurrent", str(max(args.concurrency)), "--max-queued", "256",
           "--timeout", "600", "--max-k", str(max(args.k, 100)), "--engine-probe", "--log-level", "warning",
           "--kv-dtype", args.kv_dtype]
    if args.model:
        cmd += ["--model", args.model]
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> dict:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the server exited with code {proc.returncode}:\n{tail}")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not become healthy within {timeout:.0f} s (log: {log_path})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # uvicorn shuts down, then the entry point shuts the engine down
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and the engine it started
        proc.wait(timeout=10)


# -- load ----------------------------------------------------------------------------------------
async def one_request(client, url: str, model: str, user: str, question: str, mode: str, args) -> dict:
    body = {"model": model, "user": user, "messages": [{"role": "user", "content": question}],
            "max_tokens": args.max_tokens, "stream": True, "memory": {"k": args.k, **MODES[mode]}}
    t0 = time.perf_counter()
    ttft = None
    final = None
    status = None
    try:
        # X-User-ID: what a user-affinity proxy routes by (benchmarks/replicas.py); the server checks it agrees
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-User-ID": user}) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
                return {"ok": False, "status": status, "error": r.text[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    return {"ok": False, "status": status, "error": d["error"].get("message", "")[:200]}
                ch = d["choices"][0] if d.get("choices") else None
                if ch and ch["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
                if ch and ch.get("finish_reason"):
                    final = d.get("inferscale")
    except Exception as e:  # noqa: BLE001 - counted as a failure
        return {"ok": False, "status": status, "error": f"{type(e).__name__}: {e}"[:200]}
    total = time.perf_counter() - t0
    info = final or {}
    timings = info.get("timings") or {}
    return {"ok": True, "status": status, "ttft_s": ttft if ttft is not None else total, "total_s": total,
            "engine_ttft_s": timings.get("engine_ttft_s"), "prompt_tokens": info.get("prompt_tokens"),
            "cached_tokens": info.get("cached_tokens"), "injected_tokens": info.get("injected_tokens"),
            "facts": len(info.get("facts") or ()), "done": time.perf_counter()}


async def run_level(url: str, model: str, users: list[str], questions: list[str], mode: str, conc: int,
                    args, offset: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    results: list[dict] = []
    counter = {"next": 0}
    start = time.perf_counter()
    stop_at = start + args.seconds

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        async def worker():
            while counter["next"] < args.requests and time.perf_counter() < stop_at:
                i = counter["next"]
                counter["next"] += 1
                q = questions[(offset + i) % len(questions)]
                u = users[i % len(users)]
                results.append(await one_request(client, url, model, u, q, mode, args))

        tasks = [asyncio.ensure_future(worker()) for _ in range(conc)]
        remaining = max(stop_at - time.perf_counter(), 0) + args.grace
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()  # the client disconnects; the server aborts those requests
        await asyncio.gather(*pending, return_exceptions=True)
    ok = [r for r in results if r["ok"]]
    end = max((r["done"] for r in ok), default=time.perf_counter())
    wall = max(end - start, 1e-9)
    return {"mode": mode, "concurrency": conc, "issued": counter["next"], "ok": len(ok),
            "failed": len(results) - len(ok), "cut": counter["next"] - len(results), "wall_s": wall,
            "rps": len(ok) / wall, "ttft": [r["ttft_s"] for r in ok],
            "engine_ttft": [r["engine_ttft_s"] for r in ok if r["engine_ttft_s"] is not None],
            "prompt_tokens": [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None],
            "cached_tokens": [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None],
            "facts": [r["facts"] for r in ok],
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:5]}


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[i]


def summarise(run: dict) -> dict:
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"mode": run["mode"], "concurrency": run["concurrency"], "ok": run["ok"], "failed": run["failed"],
            "cut": run["cut"], "rps": run["rps"], "ttft_p50_s": pct(run["ttft"], 50), "ttft_p99_s": pct(run["ttft"], 99),
            "engine_ttft_p50_s": pct(run["engine_ttft"], 50), "prompt_tokens": mean(run["prompt_tokens"]),
            "cached_tokens": mean(run["cached_tokens"]), "facts": mean(run["facts"]), "errors": run["errors"]}


def print_table(rows: list[dict], meta: dict) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1e3:,.0f}"  # noqa: E731
    num = lambda x, f="{:.0f}": "-" if x is None else f.format(x)  # noqa: E731
    head = ("C", "mode", "ok", "fail", "req/s", "TTFT p50 ms", "TTFT p99 ms", "engine TTFT p50 ms", "prompt tok",
            "not computed tok", "facts")
    body = [(str(r["concurrency"]), r["mode"], str(r["ok"]), str(r["failed"] + r["cut"]), num(r["rps"], "{:.2f}"),
             ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]), ms(r["engine_ttft_p50_s"]), num(r["prompt_tokens"]),
             num(r["cached_tokens"]), num(r["facts"], "{:.1f}")) for r in rows]
    print_rows(f"\nServing throughput, {meta['model']}, k={meta['k']}, {meta['users']} users x {meta['facts']} facts, "
               f"{meta['max_tokens']} tokens per answer, streaming", head, body)
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    print()
    for c in sorted({r["concurrency"] for r in rows}):
        for fast, slow in (("inject", "text"), ("chain", "text-all")):
            i, t = by.get((c, fast)), by.get((c, slow))
            if i and t and i["rps"] and t["rps"] and i["ttft_p50_s"] and t["ttft_p50_s"]:
                print(f"C={c}: {fast}/{slow} requests/s {i['rps'] / t['rps']:.2f}x, "
                      f"{slow}/{fast} TTFT p50 {t['ttft_p50_s'] / i['ttft_p50_s']:.2f}x, "
                      f"p99 {t['ttft_p99_s'] / i['ttft_p99_s']:.2f}x")
    for r in rows:
        if r["errors"]:
            print(f"errors (C={r['concurrency']}, {r['mode']}): {r['errors']}")


async def wait_for_chains(client, url: str, model: str, users, question: str, timeout_s: float = 3600) -> None:
    """Until every user's memory chain holds every link (the warm-up's requests scheduled them)."""
    t = time.perf_counter()
    for u in users:
        while True:
            r = await client.post(f"{url}/v1/chat/completions", headers={"X-User-ID": u}, json={
                "model": model, "user": u, "messages": [{"role": "user", "content": question}], "max_tokens": 1,
                "memory": {"mode": "chain"}})
            chain = r.json()["inferscale"]["chain"]
            if chain["stored"] == chain["facts"]:
                break
            if time.perf_counter() - t > timeout_s:
                raise SystemExit(f"the memory chain of {u} holds {chain['stored']} of {chain['facts']} links")
            await asyncio.sleep(1.0)
    print(f"  every user's memory chain stored ({time.perf_counter() - t:.0f} s)", flush=True)


async def drive(url: str, model: str, users, questions, args) -> list[dict]:
    import httpx

    runs = []
    async with httpx.AsyncClient(timeout=600) as client:  # untimed warm-up: each mode once per user
        for u in users:
            for m in args.modes:
                r = await one_request(client, url, model, u, questions[0], m, args)
                if not r["ok"]:
                    raise SystemExit(f"warm-up request failed: {r}")
        if "chain" in args.modes:
            await wait_for_chains(client, url, model, users, questions[0])
    for li, conc in enumerate(args.concurrency):
        order = args.modes if li % 2 == 0 else args.modes[::-1]  # alternate which mode runs first
        for mode in order:
            t = time.perf_counter()
            run = await run_level(url, model, users, questions, mode, conc, args, offset=li * args.requests)
            s = summarise(run)
            print(f"  C={conc:3d} {mode:8s}: {s['ok']} ok, {s['failed']} failed, {s['cut']} cut, "
                  f"{s['rps']:.2f} req/s, TTFT p50 {s['ttft_p50_s'] or 0:.3f} s ({time.perf_counter() - t:.0f} s)",
                  flush=True)
            runs.append(run)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    turns, facts, questions = load_memory(args.path, args.conversation, args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="inferscale-throughput-"))
    root = Path(args.memory_root) if args.memory_root else tmp / "mem"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp / "server.log"
    t0 = time.perf_counter()
    proc = start_server(args, root, port, log_path)
    try:
        print(f"server: {url} (log {log_path})", flush=True)
        health = wait_healthy(url, proc, args.startup_timeout, log_path)
        model = health["model"]
        print(f"  up in {time.perf_counter() - t0:.0f} s: {model}", flush=True)
        users = [f"bench{i}" for i in range(args.users)]
        t = time.perf_counter()
        existing = {u["user"] for u in httpx.get(f"{url}/v1/memories", timeout=30).json()["data"]}
        for i, u in enumerate(users):
            if u in existing:
                continue
            print(f"  ingesting user {i + 1}/{len(users)} ({len(facts)} facts, {time.perf_counter() - t:.0f} s so far)",
                  flush=True)
            r = httpx.post(f"{url}/v1/memories/{u}", json={"turns": turns, "facts": facts}, timeout=3600)
            if r.status_code != 200:
                raise SystemExit(f"ingest of {u} failed: {r.status_code} {r.text[:500]}")
        ingest_s = time.perf_counter() - t
        print(f"  ingested {len(facts)} facts + {len(turns)} turns for {len(users)} users in {ingest_s:.0f} s",
              flush=True)
        runs = asyncio.run(drive(url, model, users, questions, args))
        time.sleep(0.5)
        # one more request refreshes the scheduler's stats after aborted requests
        httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "user": users[0], "messages": [{"role": "user", "content": questions[0]}],
            "max_tokens": 1, "memory": {"k": 1}})
        end = httpx.get(f"{url}/health", timeout=30).json()
    finally:
        stop_server(proc)
    rows = [summarise(r) for r in runs]
    meta = {"model": model, "k": args.k, "users": len(users), "facts": len(facts), "turns": len(turns),
            "max_tokens": args.max_tokens, "questions": len(questions), "ingest_s": ingest_s,
            "concurrency": list(args.concurrency), "requests": args.requests, "seconds": args.seconds}
    print_table(rows, meta)
    eng, conn, adm = end["engine"], end.get("connector") or {}, end["admission"]
    leak = (eng["unfinished"], eng["running"], eng["waiting"], conn.get("pending_requests"),
            conn.get("scheduler_requests"), adm["in_flight"], adm["queued"])
    clean = all(x == 0 for x in leak) and eng["kv_cache_usage"] == 0.0 and conn.get("kv_cache_usage", 0.0) == 0.0
    print(f"\nafter the runs: vLLM unfinished {eng['unfinished']}, running {eng['running']}, waiting {eng['waiting']}, "
          f"KV-cache usage {eng['kv_cache_usage']:.3f}; connector pending {conn.get('pending_requests')}, scheduler "
          f"requests {conn.get('scheduler_requests')}; admission in flight {adm['in_flight']}, queued {adm['queued']}"
          f" -> {'clean' if clean else 'LEAK'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs, "health": end},
                                              indent=1, default=float))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
