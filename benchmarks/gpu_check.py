"""The injection and attention kernels on a GPU: compiled for real, checked against their
references, timed against the memory-bandwidth floor. One script, one run.

Pallas (JAX): `inject_pallas` (float pre-RoPE KV), `inject_compact_pallas` (int8 / e4m3 codes
with per-channel scales, dequantised in the kernel) and `paged_attention_pallas` (full and
sliding-window), each against its jax.numpy reference. Triton (torch): `rotate_triton` and
`dequantize_rotate_triton` against their torch references. Shapes are a k=50 LoCoMo memory of a
1.5B model by default: n = 2,048 memory tokens, 2 KV heads of 128 channels, 28 layers' worth of
calls timed one layer at a time.

The floor of a kernel is the bytes it must move (read its inputs once, write its outputs once)
over the device's copy bandwidth, measured here by timing a large device-to-device copy. Reported
per kernel: max error against the reference (and the dtype tolerance it must meet), median time,
the floor and time / floor.

    python benchmarks/gpu_check.py                  # on the GPU machine (JAX with CUDA, torch, triton)
    python benchmarks/gpu_check.py --interpret      # a CPU dry run (interpreted kernels, small shapes)

Exit status 1 if any kernel misses its tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU kernel check: Pallas and Triton kernels vs references and the "
                                            "memory-bandwidth floor.")
    p.add_argument("--tokens", type=int, default=2048, help="memory tokens injected per call (default 2048)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=12, help="query heads (paged attention)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per kernel (default 20)")
    p.add_argument("--interpret", action="store_true", help="CPU dry run: interpreted kernels, small shapes")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.interpret:
        args.tokens, args.head_dim, args.repeats = min(args.tokens, 48), min(args.head_dim, 32), 2
    return args


def timed(fn, repeats: int, sync) -> float:
    sync(fn())  # compile / warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(jnp, jax, nbytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy (read + write) of an nbytes array."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 0.0)
    t = timed(lambda: f(x), repeats, lambda y: y.block_until_ready())
    return 2 * nbytes / t


def pallas_checks(args, rows: list) -> None:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from inferscale.common.storage.kvquant import pair_partner, quantize
    from inferscale.common.model.rope_tables import cos_sin
    from inferscale.common.model.spec import RopeSpec
    from inferscale.jax.inject import (inject_compact_pallas, inject_compact_reference, inject_pallas,
                                       inject_reference)
    from inferscale.jax.paged_attention import paged_attention_pallas, paged_attention_reference

    interp = True if args.interpret else False
    n, h, d = args.tokens, args.kv_heads, args.head_dim
    rope = RopeSpec(1e6, d, "split")
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(jnp, jax, 256 << 20 if not args.interpret else 1 << 20, args.repeats)
    rows.append({"kernel": "device copy (the floor's bandwidth)", "GB/s": bw / 1e9})
    sync = lambda out: jax.tree_util.tree_map(lambda a: a.block_until_ready(), out)  # noqa: E731
    num_slots = 2 * n
    slots = jnp.asarray(rng.permutation(num_slots)[:n].astype(np.int32))
    cos, sin = (jnp.asarray(t) for t in cos_sin(rope, rng.integers(0, 32768, n)))

    def err(a, b):
        return max(float(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)).max()) /
                   max(1.0, float(jnp.abs(jnp.asarray(y, jnp.float32)).max())) for x, y in zip(a, b))

    for dtype in ("float32", "bfloat16"):
        dt = jnp.dtype(dtype)
        cache = jnp.zeros((num_slots, h, d), dt)
        k = jnp.asarray(rng.standard_normal((n, h, d)), dt)
        v = jnp.asarray(rng.standard_normal((n, h, d)), dt)
        fast = jax.jit(lambda kc, vc: inject_pallas(kc, vc, k, v, cos, sin, slots, rope, interpret=interp))
        ref = jax.jit(lambda kc, vc: inject_reference(kc, vc, k, v, cos, sin, slots, rope))
        e = err(fast(cache, cache), ref(cache, cache))
        t = timed(lambda: fast(cache, cache), args.repeats, sync)
        moved = 2 * n * h * d * dt.itemsize * 2 + n * (cos.shape[1] * 8 + 4)  # read K, V, tables; write K, V
        rows.append({"kernel": f"inject_pallas {dtype}", "err": e, "tol": TOL[dtype], "ms": t * 1e3,
                     "floor_ms": moved / bw * 1e3, "x_floor": t * bw / moved})

        for kv_dtype in ("int8", "float8_e4m3"):
            partner = pair_partner(d, d, "split")
            kq, ks = quantize(np.asarray(k, np.float32)[None], kv_dtype, partner)
            vq, vs = quantize(np.asarray(v, np.float32)[None], kv_dtype)
            view = (lambda c: c) if kv_dtype == "int8" else (lambda c: c.view(ml_dtypes.float8_e4m3fn))
            kc_, vc_ = jnp.asarray(view(kq[0])), jnp.asarray(view(vq[0]))
            ks_, vs_ = jnp.asarray(ks), jnp.asarray(vs)  # one fact: [1, h, d]
            tf = jnp.zeros(n, jnp.int32)
            fast = jax.jit(lambda a, b: inject_compact_pallas(a, b, kc_, vc_, ks_, vs_, tf, cos, sin, slots, rope,
                                                              interpret=interp))
            ref = jax.jit(lambda a, b: inject_compact_reference(a, b, kc_, vc_, ks_, vs_, tf, cos, sin, slots, rope))
            e = err(fast(cache, cache), ref(cache, cache))
            t = timed(lambda: fast(cache, cache), args.repeats, sync)
            moved = 2 * n * h * d * 1 + 2 * n * h * d * dt.itemsize + n * (cos.shape[1] * 8 + 8)
            rows.append({"kernel": f"inject_compact_pallas {kv_dtype} -> {dtype}", "err": e, "tol": TOL[dtype],
                         "ms": t * 1e3, "floor_ms": moved / bw * 1e3, "x_floor": t * bw / moved})

        bs, T, H = 16, 8, args.heads
        blocks = n // bs
        kc = jnp.asarray(rng.standard_normal((blocks + 1, bs, h, d)), dt)
        vc = jnp.asarray(rng.standard_normal((blocks + 1, bs, h, d)), dt)
        table = jnp.asarray(rng.permutation(np.arange(1, blocks + 1)).astype(np.int32))
        q = jnp.asarray(rng.standard_normal((T, H, d)), dt)
        qpos = jnp.arange(n - T, n, dtype=jnp.int32)
        for window in (None, 512):
            kw = dict(scale=d ** -0.5, window=window)
            fast = jax.jit(lambda: paged_attention_pallas(q, kc, vc, table, qpos, interpret=interp, **kw))
            ref = jax.jit(lambda: paged_attention_reference(q, kc, vc, table, qpos, **kw))
            e = err([fast()], [ref()])
            t = timed(fast, args.repeats, sync)
            seen = n if window is None else min(n, window + T)
            moved = 2 * seen * h * d * dt.itemsize + 2 * T * H * d * dt.itemsize
            rows.append({"kernel": f"paged_attention_pallas {dtype} window={window}", "err": e, "tol": TOL[dtype],
                         "ms": t * 1e3, "floor_ms": moved / bw * 1e3, "x_floor": t * bw / moved})


def triton_checks(args, rows: list) -> None:
    import torch

    from inferscale.common.storage.kvquant import pair_partner, quantize
    from inferscale.common.model.spec import RopeSpec
    from inferscale.vllm.kernels.chunked_rope import (RopeTable, dequantize_rotate_reference, dequantize_rotate_triton,
                                      rotate_reference, rotate_triton)

    device = "cpu" if args.interpret else "cuda"
    sync = (lambda _: None) if device == "cpu" else (lambda _: torch.cuda.synchronize())
    n, h, d = args.tokens, args.kv_heads, args.head_dim
    rope = RopeSpec(1e6, d, "split")
    cos, sin = RopeTable(rope, 32768, device)(torch.randint(0, 32768, (n,), device=device))
    x = torch.empty(64 << 20 if device == "cuda" else 1 << 18, dtype=torch.uint8, device=device)
    t = timed(lambda: x.clone(), args.repeats, sync)
    bw = 2 * x.numel() / t
    rows.append({"kernel": "torch device copy (the floor's bandwidth)", "GB/s": bw / 1e9})
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        k = torch.randn(n, h, d, device=device).to(dtype)
        ref = rotate_reference(k, cos, sin, rope).float()
        e = float((rotate_triton(k, cos, sin, rope).float() - ref).abs().max()) / max(1.0, float(ref.abs().max()))
        t = timed(lambda: rotate_triton(k, cos, sin, rope), args.repeats, sync)
        moved = 2 * k.numel() * k.element_size() + 2 * cos.numel() * 4
        rows.append({"kernel": f"rotate_triton {name}", "err": e, "tol": TOL[name], "ms": t * 1e3,
                     "floor_ms": moved / bw * 1e3, "x_floor": t * bw / moved})
        for kv_dtype in ("int8", "float8_e4m3"):
            q, s = quantize(k.float().cpu().numpy()[None], kv_dtype, pair_partner(d, d, "split"))
            codes, scale = torch.from_numpy(q[0]).to(device), torch.from_numpy(s).to(device)
            tf = torch.zeros(n, dtype=torch.int64, device=device)
            ref = dequantize_rotate_reference(codes, scale, tf, cos, sin, rope, kv_dtype, dtype)
            got = dequantize_rotate_triton(codes, scale, tf, cos, sin, rope, kv_dtype, dtype)
            e = float((got.float() - ref.float()).abs().max()) / max(1.0, float(ref.float().abs().max()))
            t = timed(lambda: dequantize_rotate_triton(codes, scale, tf, cos, sin, rope, kv_dtype, dtype),
                      args.repeats, sync)
            moved = codes.numel() + k.numel() * k.element_size() + 2 * cos.numel() * 4 + n * 8
            rows.append({"kernel": f"dequantize_rotate_triton {kv_dtype} -> {name}", "err": e, "tol": TOL[name],
                         "ms": t * 1e3, "floor_ms": moved / bw * 1e3, "x_floor": t * bw / moved})


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    args = parse_args(argv)
    if args.interpret:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton compiles a kernel
    rows: list = []
    pallas_checks(args, rows)
    triton_checks(args, rows)
    table = Table(title=f"kernels: n={args.tokens} tokens, {args.kv_heads} KV heads x {args.head_dim}"
                        + (" (interpreted, CPU)" if args.interpret else ""))
    for col in ("kernel", "max error (tol)", "median", "floor", "x floor"):
        table.add_column(col, justify="right")
    failed = False
    for r in rows:
        if "GB/s" in r:
            table.add_row(r["kernel"], "", f"{r['GB/s']:.0f} GB/s", "", "")
            continue
        ok = r["err"] <= r["tol"]
        failed |= not ok
        table.add_row(r["kernel"], f"{r['err']:.1e} ({r['tol']:g}){'' if ok else ' FAIL'}", f"{r['ms']:.3f} ms",
                      f"{r['floor_ms']:.3f} ms", f"{r['x_floor']:.1f}x")
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
