"""A fact's metadata and times: what they may hold, checked once, and how times are written.

    check_metadata({"category": "work", "tags": ["q3", "okr"], "priority": 2, "done": False})
    to_epoch("2026-12-06T12:00:00Z") == to_epoch(1796558400)     # ISO 8601 or epoch seconds
    iso(1796558400.0) == "2026-12-06T12:00:00Z"

Metadata is a flat JSON object. Keys are 1-64 letters, digits or `_.-`, and not one of the names
filters use for a fact's own fields (`RESERVED`). Values are strings, numbers, booleans or lists of
strings: exactly what `inferscale.common.storage.filters` can compare, in SQL and in Python alike.
Numbers must be finite, and integers within +-2**53 (the catalog keeps them as doubles, which
hold such integers exactly). The whole object is bounded (`MAX_METADATA_BYTES` as compact JSON).

Times are UTC epoch seconds inside InferScale, within `inferscale.common.bounds.TIME_RANGE` (a
boolean is not a time); the API writes them as ISO 8601 with a `Z`, and a stored time outside the
range (from an older InferScale) is read back clamped into it, so no read fails on one.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any, Mapping

from inferscale.common.bounds import check_time, clamp_time

MAX_METADATA_BYTES = 4096  # the object as compact JSON
MAX_METADATA_KEYS = 32
MAX_LIST_ITEMS = 64
MAX_INT = 2**53  # integers beyond this lose digits as doubles
# a fact's own fields, which filters name directly; and the filters' logical operators
TIME_FIELDS = ("created_at", "updated_at", "expires_at")
LOGICAL = ("and", "or", "not")
OPS = ("eq", "ne", "in", "nin", "gt", "gte", "lt", "lte")  # a filter's comparisons
RESERVED = frozenset(TIME_FIELDS + LOGICAL + tuple(op.upper() for op in LOGICAL) + OPS)
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")


def check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"{where}: invalid metadata key {key!r}: use 1-64 letters, digits or '_.-'")
    return key


def check_number(value: object, where: str) -> float | int:
    """A finite number that a double holds exactly when it is an integer (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise ValueError(f"{where}: integers must be within +-2**53, got {value}")
    return value


def check_unicode(text: str, what: str) -> str:
    """`text` if it is valid Unicode: JSON can spell a lone surrogate, which no tokenizer,
    embedder or database takes (ValueError naming `what`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text ({e.reason} at character {e.start})") from None
    return text


def check_scalar(value: object, where: str) -> str | float | int | bool:
    """A string, number or boolean, as metadata and filters compare them."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where} must not contain NUL characters")
        return check_unicode(value, where)
    if isinstance(value, bool):
        return value
    return check_number(value, where)


def check_metadata(metadata: object, where: str = "metadata") -> dict[str, Any]:
    """`metadata` if it is a valid metadata object (a plain dict copy), else ValueError naming what."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"{where} has {len(metadata)} keys; the limit is {MAX_METADATA_KEYS}")
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        check_key(key, where)
        if key in RESERVED:
            raise ValueError(f"{where}: {key!r} is a reserved name (a fact's own field or a filter operator)")
        at = f"{where}.{key}"
        if isinstance(value, list):
            if len(value) > MAX_LIST_ITEMS:
                raise ValueError(f"{at} has {len(value)} items; the limit is {MAX_LIST_ITEMS}")
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"{at}: a list may hold strings only")
            out[key] = [check_scalar(v, f"{at}.{i}") for i, v in enumerate(value)]
        else:
            out[key] = check_scalar(value, at)
    size = len(dumps(out).encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{where} is {size} bytes as JSON; the limit is {MAX_METADATA_BYTES}")
    return out


def dumps(metadata: Mapping[str, Any]) -> str:
    """The catalog's spelling: compact JSON, keys sorted."""
    return json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads(text: str | None) -> dict[str, Any]:
    return json.loads(text) if text else {}


def to_epoch(value: object, where: str) -> float:
    """UTC epoch seconds of an ISO 8601 time (a time without a zone is UTC) or of epoch seconds,
    within the time range (`bounds.check_time`); ValueError naming `where` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a time (ISO 8601 or epoch seconds), got a boolean")
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ValueError(f"{where} must be an ISO 8601 time (2026-12-06T12:00:00Z) or epoch seconds, "
                             f"got {value[:64]!r}") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=timezone.utc)
        return check_time(t.timestamp(), where)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a time (ISO 8601 or epoch seconds), got {type(value).__name__}")
    return check_time(float(check_number(value, where)), where)


def iso(epoch: float | None) -> str | None:
    """ISO 8601 in UTC with a `Z` (microseconds when the time has them); a time outside the range
    (stored by an older version) is written clamped into it, never an error."""
    epoch = clamp_time(epoch)
    if epoch is None:
        return None
    text = datetime.fromtimestamp(epoch, timezone.utc).isoformat()
    return text.replace("+00:00", "Z")
