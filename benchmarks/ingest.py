"""Ingest speed: per-fact vs one-pass Context-Window Encoding, and the conversation encoding,
side by side in one run.

One LoCoMo conversation, `--facts` of its facts (spread evenly over it, or in a row from
`--offset` as one ingest batch takes them), each encoded after the prompt header and its
`w` preceding turns (the plans the memory service builds). For each `w`, both encode modes of each
encoder (`--encoders`: the torch encoder that `inferscale memory add` and the vLLM path use, and
the JAX engine) run the same items, and the conversation encoding (store context "conversation":
each window read from one pass over the fact's span, `inferscale.common.prompt.conversation_pass`) the
same facts, alternating which goes first in each of `--repeats` rounds, after one untimed warm-up
of each (JAX compiles its shapes there). Reported per (encoder, w):

* tokens run: per fact (every item's context + fact), one pass (the prefix tree's tokens: each
  shared prefix once) and the conversation encoding's rows (spans once per row);
* facts/s per mode (median over rounds) and each speed-up over per-fact;
* max |K, V difference| one-pass vs per-fact (the same encoding up to float summation order), and
  the conversation encoding's RMS difference from per-fact relative to the KV's RMS (a different
  encoding: its quality is measured by `benchmarks/locomo.py --context conversation`);
* with `--service`: facts/s of `MemoryService.add` end to end (turns + facts into a new memory:
  encoding, embedding, store and catalog writes), torch encoder, per mode.

    python benchmarks/ingest.py --quick                  # 16 facts, w=5,20, torch (~5 min on 2 cores)
    python benchmarks/ingest.py --offset 40 --facts 24 --repeats 2   # the README's table (~40 min)
    python benchmarks/ingest.py --offset 40 --facts 24 --repeats 2 --w 5,20 --encoders jax
    python benchmarks/ingest.py --encoders torch,jax --service --json runs/ingest.json
    python benchmarks/ingest.py --plans-only             # tokens for the whole conversation, w=5,20,50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import int_list, positive, print_rows  # benchmarks/ is the script's folder

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.evaluation.locomo import load_locomo  # noqa: E402

from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH
from inferscale.common.prompt.conversation_pass import conversation_plan  # noqa: E402
from inferscale.common.prompt.packing import pack_items, row_budget  # noqa: E402
from inferscale.common.modes import ENCODE_MODES

QUICK = {"facts": 16, "w": (5, 20), "repeats": 2}
MODES = ENCODE_MODES + ("conversation",)  # the encoders' two modes, then the conversation encoding
ENCODERS = ("torch", "jax")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Facts/s of per-fact vs one-pass Context-Window Encoding.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversation", default="conv-26", help="LoCoMo conversation id (default conv-26)")
    p.add_argument("--facts", type=positive, default=32, help="facts, spread evenly over the conversation (default 32)")
    p.add_argument("--offset", type=int, default=None,
                   help="take the facts in a row from this index (default: spread evenly)")
    p.add_argument("--w", type=int_list(0), default=(5, 20, 50), help="windows in turns (default 5,20,50)")
    p.add_argument("--encoders", default="torch", help=f"comma-separated, of {', '.join(ENCODERS)} (default torch)")
    p.add_argument("--repeats", type=positive, default=3, help="timed rounds per mode (default 3)")
    p.add_argument("--batch-size", type=positive, default=8, help="sequences (rows) per forward (default 8)")
    p.add_argument("--service", action="store_true", help="also time MemoryService.add end to end (torch)")
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    p.add_argument("--plans-only", action="store_true",
                   help="only the tokens each way runs for the whole conversation (no model forward; seconds)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    args.encoders = tuple(e.strip() for e in args.encoders.split(",") if e.strip())
    bad = [e for e in args.encoders if e not in ENCODERS]
    if bad or not args.encoders:
        p.error(f"--encoders must name {' and/or '.join(ENCODERS)}; got {','.join(bad) or 'nothing'}")
    if args.quick:
        args.facts, args.w, args.repeats = QUICK["facts"], QUICK["w"], QUICK["repeats"]
    from inferscale.models import resolve_model

    args.model = str(resolve_model(args.model))  # the default model is converted on first use
    return args


def make_encoder(kind: str, model: str, mode: str, batch_size: int):
    if kind == "torch":
        from inferscale.encoders.torch_encoder import TorchFactEncoder

        return TorchFactEncoder(model, batch_size=batch_size, encode_mode=mode)
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import EngineConfig

    return Engine.from_pretrained(model, EngineConfig(encode_batch_size=batch_size, encode_mode=mode))


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def max_diff(a, b) -> float:
    return max(max(float(np.abs(x[0] - y[0]).max()), float(np.abs(x[1] - y[1]).max())) for x, y in zip(a, b))


def rel_rms(a, b) -> float:
    """RMS of a - b over all facts' K and V, relative to the RMS of b."""
    num = sum(float(((x[j] - y[j]) ** 2).sum()) for x, y in zip(a, b) for j in (0, 1))
    den = sum(float((y[j] ** 2).sum()) for y in b for j in (0, 1))
    return (num / den) ** 0.5


def plans_of(encoder, conv, facts, w):
    """(turn-window items, spans, the one-pass plan, the conversation encoding's plan) of `facts`."""
    b = encoder.builder
    items = b.windowed_plans(facts, [conv.context_window(f, w) for f in facts])
    spans = [conv.context_span(f, w) for f in facts]
    rows = conversation_plan(b.header_ids, b.span_items(facts, spans, w), w, encoder.max_context)
    return items, spans, pack_items(items, row_budget(items)), rows  # pack_items: the torch encoder's plan


def whole_conversation(encoder, conv, ws) -> list[dict]:
    """Tokens each way would run for every fact of the conversation (plans only, no model)."""
    out = []
    for w in ws:
        _, _, tree, rows = plans_of(encoder, conv, conv.facts, w)
        out.append({"w": w, "facts": len(conv.facts), "tokens_per_fact": tree.item_tokens,
                    "tokens_one_pass": tree.row_tokens, "tokens_conversation": rows.row_tokens})
    return out


def bench_encoder(kind: str, args, conv, facts) -> list[dict]:
    encoders = {m: make_encoder(kind, args.model, m, args.batch_size) for m in ENCODE_MODES}
    rows = []
    for w in args.w:
        plans, spans, tree, rows_plan = plans_of(encoders["one-pass"], conv, facts, w)
        run = {m: (lambda m=m: encoders[m].encode_ids(plans)) for m in ENCODE_MODES}
        run["conversation"] = lambda: [(kv.k, kv.v) for kv in encoders["one-pass"].encode_conversation(facts, spans, w)]
        outs = {m: run[m]() for m in MODES}  # warm-up (JAX compiles here)
        times = {m: [] for m in MODES}
        for r in range(args.repeats):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                s, outs[m] = timed(run[m])
                times[m].append(s)
                print(f"  {kind} w={w} round {r + 1}/{args.repeats} {m}: {s:.2f} s", flush=True)
        med = {m: statistics.median(t) for m, t in times.items()}
        rows.append({"encoder": kind, "w": w, "facts": len(facts), "tokens_per_fact": tree.item_tokens,
                     "tokens_one_pass": tree.row_tokens, "tokens_conversation": rows_plan.row_tokens,
                     "per_fact_s": med["per-fact"], "one_pass_s": med["one-pass"],
                     "conversation_s": med["conversation"],
                     "max_kv_diff": max_diff(outs["per-fact"], outs["one-pass"]),
                     "conversation_rel_diff": rel_rms(outs["conversation"], outs["per-fact"])})
    return rows


def bench_service(args, conv, facts) -> list[dict]:
    from inferscale.encoders.torch_encoder import TorchFactEncoder
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    embedder = MiniLMEmbedder()
    encoders = {m: TorchFactEncoder(args.model, batch_size=args.batch_size, encode_mode=m) for m in ENCODE_MODES}
    last = max(conv.turn_index(f.source_turn) for f in facts if f.source_turn is not None)
    turns = conv.turns[: last + 1]
    rows = []
    with tempfile.TemporaryDirectory(prefix="inferscale-ingest-") as tmp:
        for w in args.w:
            times = {m: [] for m in MODES}
            for r in range(args.repeats):
                for m in MODES if r % 2 == 0 else MODES[::-1]:
                    context = "conversation" if m == "conversation" else "turns"
                    config = MemoryConfig(root=f"{tmp}/w{w}-{m}-{r}", w=w, context=context)
                    service = MemoryService(config, encoders.get(m, encoders["one-pass"]), embedder)
                    s, _ = timed(lambda: service.add("bench", facts, turns))
                    times[m].append(s)
                    print(f"  service w={w} round {r + 1}/{args.repeats} {m}: {s:.2f} s", flush=True)
            rows.append({"w": w, "facts": len(facts), **{f"{m}_s": statistics.median(t) for m, t in times.items()}})
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    path = Path(args.path) if args.path else (REPO_ROOT / DEFAULT_LOCOMO_PATH).resolve()
    sample = next((s for s in load_locomo(path) if s.conversation.id == args.conversation), None)
    if sample is None:
        raise SystemExit(f"no conversation {args.conversation!r} in {path}")
    conv = sample.conversation
    if args.offset is None:
        facts = conv.facts[:: max(1, len(conv.facts) // args.facts)][: args.facts]
    else:
        facts = conv.facts[args.offset: args.offset + args.facts]
        if len(facts) < args.facts:
            raise SystemExit(f"--offset {args.offset}: {conv.id} has {len(conv.facts)} facts, "
                             f"not {args.facts} from there")
    turns = lambda fs: len({f.source_turn for f in fs})  # facts of one turn share their window
    print(f"{conv.id}: {len(facts)} facts from {turns(facts)} source turns (the conversation: "
          f"{len(conv.facts)} from {turns(conv.facts)}), w={list(args.w)}, encoders {list(args.encoders)}, "
          f"{args.repeats} rounds per mode", flush=True)
    rows = [] if args.plans_only else [row for kind in args.encoders for row in bench_encoder(kind, args, conv, facts)]
    if rows:
        print()
        print_rows("Encoding (the same facts; medians; one-pass = shared prefixes once; conversation = spans once per row)",
                   ("encoder", "w", "tokens per-fact", "one-pass", "conversation", "per-fact facts/s",
                    "one-pass facts/s", "speed-up", "max |dKV|", "conversation facts/s", "speed-up",
                    "rel. RMS dKV"),
                   [(r["encoder"], str(r["w"]), f"{r['tokens_per_fact']:,}", f"{r['tokens_one_pass']:,}",
                     f"{r['tokens_conversation']:,}", f"{r['facts'] / r['per_fact_s']:.2f}",
                     f"{r['facts'] / r['one_pass_s']:.2f}", f"{r['per_fact_s'] / r['one_pass_s']:.2f}x",
                     f"{r['max_kv_diff']:.1e}", f"{r['facts'] / r['conversation_s']:.2f}",
                     f"{r['per_fact_s'] / r['conversation_s']:.2f}x", f"{r['conversation_rel_diff']:.3f}") for r in rows])
    whole = whole_conversation(make_encoder("torch", args.model, "one-pass", args.batch_size), conv, args.w)
    print()
    print_rows(f"Tokens to encode all of {conv.id} ({len(conv.facts)} facts; plans only, torch encoder's rows)",
               ("w", "per-fact", "one-pass", "ratio", "conversation", "ratio"),
               [(str(r["w"]), f"{r['tokens_per_fact']:,}", f"{r['tokens_one_pass']:,}",
                 f"{r['tokens_per_fact'] / r['tokens_one_pass']:.2f}x", f"{r['tokens_conversation']:,}",
                 f"{r['tokens_per_fact'] / r['tokens_conversation']:.2f}x") for r in whole])
    result = {"conversation": conv.id, "encoding": rows, "whole_conversation": whole}
    if args.service and not args.plans_only:
        srows = bench_service(args, conv, facts)
        print()
        print_rows("MemoryService.add end to end (torch encoder; turns + facts into a new memory; medians)",
                   ("w", "facts", "per-fact facts/s", "one-pass facts/s", "speed-up", "conversation facts/s",
                    "speed-up"),
                   [(str(r["w"]), str(r["facts"]), f"{r['facts'] / r['per-fact_s']:.2f}",
                     f"{r['facts'] / r['one-pass_s']:.2f}", f"{r['per-fact_s'] / r['one-pass_s']:.2f}x",
                     f"{r['facts'] / r['conversation_s']:.2f}", f"{r['per-fact_s'] / r['conversation_s']:.2f}x")
                    for r in srows])
        result["service"] = srows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
