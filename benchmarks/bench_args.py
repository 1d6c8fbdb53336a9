"""Shared pieces of the benchmark scripts: argparse value types, vLLM CPU's environment, plain tables."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable


def int_list(minimum: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers (duplicates dropped), each >= `minimum`."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError("expected at least one integer")
        if minimum is not None and min(vals) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return tuple(dict.fromkeys(vals))

    return parse


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


# fact orders in a prompt, one meaning in every benchmark (`--order`): the facts in the order they
# were added to the memory; retrieval's order, most relevant first (the server's); or most relevant
# last, next to the question (where `last:N` recomputes the most relevant)
ORDERS = ("conversation", "relevance", "relevance_last")


def arrange(best_first: list, order: str, position=None) -> list:
    """Retrieved facts (most relevant first) in `order` (`ORDERS`); "conversation" sorts by
    `position` (default: the items themselves)."""
    if order == "relevance":
        return list(best_first)
    if order == "relevance_last":
        return list(reversed(best_first))
    if order == "conversation":
        return sorted(best_first, key=position)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def vllm_cpu_env() -> None:
    """vLLM CPU's settings (see ../shared/notes/vllm-cpu.md); must precede importing vllm. The KV
    cache size is `MemoryLLMConfig.cpu_kv_cache_gib`'s to set."""
    for key, val in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                     ("VLLM_HOST_IP", "127.0.0.1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, val)


def memory_root(path: str | None, prefix: str) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """(root, temporary directory or None): `path` when given, else a new temporary directory
    that the caller removes with `.cleanup()`."""
    if path is not None:
        return path, None
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    return tmp.name, tmp


def print_rows(title: str, head: tuple[str, ...], body: list[tuple[str, ...]]) -> None:
    """A right-aligned plain-text table (whole in a log file too): title, header, rule, rows."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    print(title)
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for b in body:
        print("  ".join(c.rjust(w) for c, w in zip(b, widths)))
