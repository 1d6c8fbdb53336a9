"""The bounds every entry of the memory API checks its input against, in one place.

    check_time(1796558400, "expires_at")           # 1796558400.0, or ValueError naming the field
    clamp_time(1e13)                                # TIME_MAX: a stored value read back safely

Times (`expires_at`, `created_at`, `updated_at`, a history event's `at`, a filter's time bounds)
are UTC epoch seconds within [`TIME_MIN`, `TIME_MAX`]: 1970-01-01T00:00:00Z to
9999-12-31T23:59:59Z, what ISO 8601 and every catalog can spell. A boolean is not a time. Reads
never fail on a stored time: one outside the range (written by an older InferScale) is clamped.

Filters are bounded where they are parsed, so that what the API accepts never reaches a database
limit (SQLite's parser stack and variable count, PostgreSQL's 65,535 parameters): at most
`MAX_FILTER_DEPTH` nested `and`/`or`/`not`, `MAX_FILTER_NODES` conditions and operators,
`MAX_IN_VALUES` values in one `in`/`nin` list and `MAX_FILTER_VALUES` values in the whole filter.
The parameters of a filter's SQL are then at most `MAX_FILTER_VALUES + 3 * MAX_FILTER_NODES`.

A JSON value a request passes through Python validation (a filter, metadata) nests at most
`MAX_JSON_DEPTH` deep. A page cursor names a catalog row id in [0, `MAX_ROW_ID`] (SQLite's and
PostgreSQL's 64-bit integers).
"""

from __future__ import annotations

import math

TIME_MIN = 0.0  # 1970-01-01T00:00:00Z
TIME_MAX = 253402300799.0  # 9999-12-31T23:59:59Z
TIME_RANGE = "1970-01-01T00:00:00Z to 9999-12-31T23:59:59Z"

MAX_FILTER_DEPTH = 16  # nested and / or / not
MAX_FILTER_NODES = 256  # conditions and operators in one filter
MAX_IN_VALUES = 256  # values in one in / nin list
MAX_FILTER_VALUES = 1024  # values in one filter, all its lists together

MAX_JSON_DEPTH = 64  # nesting of a JSON value validated in Python (filters, metadata)
MAX_ROW_ID = 2**63 - 1  # a cursor's position: a 64-bit row id


def check_time(value: float, where: str) -> float:
    """`value` (epoch seconds, a finite float) if it is within the time range, else ValueError naming `where`."""
    if not math.isfinite(value) or not TIME_MIN <= value <= TIME_MAX:
        raise ValueError(f"{where} must be a time from {TIME_RANGE} (epoch seconds {TIME_MIN:.0f} to "
                         f"{TIME_MAX:.0f}), got {value!r}")
    return value


def clamp_time(value: float | None) -> float | None:
    """A stored time as reads return it: inside the range (None and NaN as None)."""
    if value is None or value != value:
        return None
    return min(max(float(value), TIME_MIN), TIME_MAX)


def json_depth_within(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` (parsed JSON) nests at most `limit` lists and objects deep; iterative, so a
    value of any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True
