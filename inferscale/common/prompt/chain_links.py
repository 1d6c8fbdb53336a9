"""The memory chain's bookkeeping: a user's whole memory encoded jointly, one link per fact.

A user's live facts, in the order they were added and rendered as the text layout renders them
(`PromptBuilder.fact_ids`), follow the prompt header in a whole-memory prompt:

    [header][fact 1][fact 2] ... [fact n][the conversation]

Link i is fact i's KV encoded after the header and facts 1..i-1, exactly what precedes it there,
so injecting links 1..m *is* the prefill of that prefix (keys stored before RoPE, as every fact's).
A link is stored under a key chained from the header's tokens, the user's incarnation and the
tokens of every fact up to it:

    key_0 = H("chain", incarnation, header ids)      key_i = H(key_{i-1}, tokens of fact i)

So a key names one exact token prefix: links are never rewritten, never stale, and the same on every
replica. An update or a delete of fact j changes the keys of j and every fact after it, whose links
are then simply absent (the longest stored prefix ends before j) until they are encoded again; an
append adds one key after the others. Plain Python: keys, the prefix a request may inject, the
item that encodes the missing links in one pass, and the token budget.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

CHAIN_PREFIX = "chain~"  # every link's store key starts with it (fact KV keys never do)


def is_chain_key(key: str) -> bool:
    return key.startswith(CHAIN_PREFIX)


def chain_keys(header_ids: Sequence[int], incarnation: str, facts: Sequence[Sequence[int]]) -> list[str]:
    """The store key of each link, for facts (their token ids, in memory order) after `header_ids`."""
    h = hashlib.sha256(f"chain:{incarnation}:{','.join(map(str, header_ids))}".encode()).hexdigest()
    keys = []
    for ids in facts:
        h = hashlib.sha256(f"{h}:{','.join(map(str, ids))}".encode()).hexdigest()
        keys.append(CHAIN_PREFIX + h[:40])
    return keys


def stored_prefix(keys: Sequence[str], missing: Sequence[str]) -> int:
    """How many links from the first are stored, given the keys among `keys` a store lacks."""
    gone = set(missing)
    for i, key in enumerate(keys):
        if key in gone:
            return i
    return len(keys)


def within_budget(facts: Sequence[Sequence[int]], budget: int) -> int:
    """How many facts from the first the chain holds: as many as fit in `budget` tokens."""
    used = 0
    for i, ids in enumerate(facts):
        used += len(ids)
        if used > budget:
            return i
    return len(facts)


def extension_item(header_ids: Sequence[int], facts: Sequence[Sequence[int]], start: int
                   ) -> tuple[list[int], list[int]]:
    """(context ids, ids) that encode links `start`.. in one pass: the header and the facts before
    `start` as context, every later fact's tokens after it (an encoder's `encode_ids` item)."""
    if not 0 <= start < len(facts):
        raise ValueError(f"start must be in [0, {len(facts)}), got {start}")
    context = list(header_ids) + [t for ids in facts[:start] for t in ids]
    return context, [t for ids in facts[start:] for t in ids]


def split_links(k: np.ndarray, v: np.ndarray, lengths: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (k, v) of one extension, [L, sum(lengths), KVH, D] each, cut into one piece per link."""
    if k.shape[1] != sum(lengths) or v.shape[1] != sum(lengths):
        raise ValueError(f"KV of {k.shape[1]} tokens cannot be cut into links of {sum(lengths)}")
    out, pos = [], 0
    for n in lengths:
        out.append((k[:, pos:pos + n].copy(), v[:, pos:pos + n].copy()))
        pos += n
    return out
