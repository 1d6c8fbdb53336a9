"""What each store dtype does to one model's fact KV: errors against the float32 encoding.

Reads a memory root written by `locomo.py --kv-dtype float32,DTYPE...` (users "<id>-w<w>" in
float32 and "<id>-w<w>-DTYPE" holding the same encodings in DTYPE) and prints, per dtype, over
the facts both users hold (their KV read back with `Store.get`, the reference dequantisation that
serving's kernels reproduce bit for bit):

* max |dK| and max |dV|, and the relative error ||dK|| / ||K|| and ||dV|| / ||V||;
* the largest |K| and, in the key channel holding it, how much it varies over tokens
  (std / |mean|): a channel whose keys are large and nearly constant is where a format with few
  mantissa bits (e4m3: 3) loses most, whatever its scale.

    python benchmarks/store_error.py runs/qwen-dtypes-mem --user conv-26-w5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.common.storage.paths import user_store_dir  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.common.modes import KV_DTYPES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Errors of each store dtype's KV against the float32 encoding.")
    p.add_argument("root", help="memory root (locomo.py --memory-root)")
    p.add_argument("--user", required=True, help="the float32 user, e.g. conv-26-w5; DTYPE users are USER-DTYPE")
    p.add_argument("--facts", type=int, default=0, help="compare at most this many facts (default 0: all)")
    args = p.parse_args(argv)
    if args.facts < 0:
        p.error("--facts must be >= 0")
    return args


def by_fact(store: Store) -> dict[str, str]:
    """fact id -> the store key of its current encoding (keys are "<fact id>~<incarnation>~<version>")."""
    return {key.split("~")[0]: key for key in store.fact_ids()}


def compare(ref: Store, other: Store, facts: list[str]) -> dict:
    rk, ok = by_fact(ref), by_fact(other)
    num = {"dk": 0.0, "dv": 0.0, "k": 0.0, "v": 0.0}
    out = {"max_dk": 0.0, "max_dv": 0.0}
    for fid in facts:
        a, = ref.get([rk[fid]])
        b, = other.get([ok[fid]])
        dk, dv = b.k - a.k, b.v - a.v
        out["max_dk"] = max(out["max_dk"], float(np.abs(dk).max()))
        out["max_dv"] = max(out["max_dv"], float(np.abs(dv).max()))
        for name, x in (("dk", dk), ("dv", dv), ("k", a.k), ("v", a.v)):
            num[name] += float(np.square(x, dtype=np.float64).sum())
    out["rel_k"] = (num["dk"] / num["k"]) ** 0.5
    out["rel_v"] = (num["dv"] / num["v"]) ** 0.5
    return out


def largest_key_channel(ref: Store, facts: list[str]) -> dict:
    """The key channel (layer, KV head, dim) with the largest |K| over these facts, and its spread."""
    keys = by_fact(ref)
    k = np.concatenate([ref.get([keys[f]])[0].k for f in facts], axis=1)  # [L, tokens, KVH, D]
    layer, tok, head, dim = np.unravel_index(np.abs(k).argmax(), k.shape)
    ch = k[layer, :, head, dim].astype(np.float64)
    return {"max_abs_k": float(np.abs(k).max()), "layer": int(layer), "head": int(head), "dim": int(dim),
            "mean": float(ch.mean()), "std": float(ch.std()), "rel_spread": float(ch.std() / max(abs(ch.mean()), 1e-12))}


def main(argv=None) -> None:
    args = parse_args(argv)
    ref = Store.open(user_store_dir(args.root, args.user))
    if ref.meta.dtype != "float32":
        raise SystemExit(f"user {args.user!r} is stored in {ref.meta.dtype}, not float32")
    facts = sorted(by_fact(ref))
    if args.facts:
        facts = facts[: args.facts]
    others = {}
    for d in KV_DTYPES:
        path = user_store_dir(args.root, f"{args.user}-{d}")
        if d != "float32" and (path / Store.MANIFEST).is_file():
            others[d] = Store.open(path)
    if not others:
        raise SystemExit(f"no users {args.user}-DTYPE in {args.root} (run locomo.py with several --kv-dtype)")
    ch = largest_key_channel(ref, facts)
    print(f"{args.user}: {len(facts)} facts; largest |K| {ch['max_abs_k']:.1f} in layer {ch['layer']}, KV head "
          f"{ch['head']}, dim {ch['dim']}: mean {ch['mean']:.1f}, std {ch['std']:.2f} over tokens "
          f"(std / |mean| {ch['rel_spread']:.3f})")
    print("| dtype | max abs dK | max abs dV | rel. error K | rel. error V |")
    print("|---|---|---|---|---|")
    for d, st in others.items():
        missing = [f for f in facts if f not in by_fact(st)]
        if missing:
            raise SystemExit(f"user {args.user}-{d} lacks facts {missing[:3]}...")
        e = compare(ref, st, facts)
        print(f"| {d} | {e['max_dk']:.3g} | {e['max_dv']:.3g} | {e['rel_k']:.2e} | {e['rel_v']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
