"""Streaming (non-temporal) stores for the CPU kernels, as Numba intrinsics.

A plain store into memory that is not in the CPU's caches first reads the line it fills; a load
of 2,000 positions writes about 92 MB into float32 paged caches, so that read doubles the traffic
of a bandwidth-bound write. A streaming store skips it (`movnti` on x86; LLVM's `!nontemporal`
store elsewhere, a plain store where the target has none). The values written are the same bits.

Imported only from inside the kernels' builders (after `cpu_kernels._numba()`): importing it
imports Numba.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def store_nt(typingctx, address, index, value):
    """`store_nt(address, index, value)`: element `index` of the array at `address` (uint64
    integers: no reference counting per call) = `value` (uint16 or uint32), non-temporally."""
    if not isinstance(value, types.Integer) or value.bitwidth not in (16, 32):
        return None
    bits = value.bitwidth

    def codegen(context, builder, signature, args):
        elem = ir.IntType(bits)
        offset = builder.mul(args[1], ir.Constant(ir.IntType(64), bits // 8))
        ptr = builder.inttoptr(builder.add(args[0], offset), elem.as_pointer())
        store = builder.store(args[2], ptr)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64, value), codegen


@intrinsic
def fence(typingctx):
    """`fence()`: the streaming stores before it are visible to every thread before anything after
    it (streaming stores are weakly ordered; a sequentially consistent fence is `mfence` on x86)."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen
