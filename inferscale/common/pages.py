"""Pages of lists that can grow without bound (facts, users, a fact's history).

    page = svc.list_page("alice", limit=100)            # Page(items=[...100], next_cursor="eyJh...")
    page = svc.list_page("alice", limit=100, cursor=page.next_cursor)

Pages are keyset pages: the cursor names the last row of the previous page (opaque: base64 of a
small JSON object), so a page is one indexed query however deep it is, and rows added or removed
between two requests never shift the pages (a row is never returned twice).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Generic, TypeVar

from inferscale.common.bounds import MAX_ROW_ID

MAX_LIMIT = 1000
T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None  # None: this is the last page


def check_limit(limit: object, where: str = "limit") -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"{where} must be an integer in [1, {MAX_LIMIT}], got {limit!r}")
    return limit


def encode_cursor(kind: str, after: int | str) -> str:
    raw = json.dumps({"k": kind, "a": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None, kind: str, type_: type) -> int | str | None:
    """The row the cursor names (None for no cursor); ValueError for one not made by this list,
    or naming a position no row can have (`_in_range`)."""
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        after = data["a"]
        ok = isinstance(data, dict) and data.get("k") == kind and isinstance(after, type_) \
            and not isinstance(after, bool) and _in_range(after)
    except (binascii.Error, ValueError, TypeError, KeyError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ValueError(f"cursor {cursor[:40]!r} is not a cursor of this list (pass next_cursor as it came)")
    return after


def _in_range(after: object) -> bool:
    """A position a catalog can compare with: a 64-bit row id, or a valid Unicode string without NUL."""
    if isinstance(after, int):
        return 0 <= after <= MAX_ROW_ID
    if isinstance(after, str):
        try:
            after.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return "\x00" not in after
    return False


def page_of(rows: list, limit: int, kind: str, key) -> tuple[list, str | None]:
    """`rows` fetched with LIMIT limit + 1: the page and the cursor of the next one (`key(row)`)."""
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, encode_cursor(kind, key(rows[-1]))
