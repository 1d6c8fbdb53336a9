"""Filters over facts: parsed once, run in the catalog as SQL, with a plain-Python reference.

    f = parse_filter({"and": [{"category": "work"},
                              {"or": [{"priority": {"gte": 2}}, {"tags": {"in": ["urgent"]}}]},
                              {"not": {"created_at": {"lt": "2026-01-01T00:00:00Z"}}}]})
    sql, params = to_sql(f, "alice")       # a WHERE fragment over `facts f` (catalog_facts.py)
    matches(f, metadata, times)            # the reference the SQL is tested against

The language (Mem0's and Zep's filters, lower-case; `AND`/`OR`/`NOT` are accepted too):

* `{"and": [F, ...]}`, `{"or": [F, ...]}`, `{"not": F}`; an object with several entries is the
  `and` of them.
* `{FIELD: VALUE}` is equality; `{FIELD: {OP: VALUE, ...}}` with OP in `eq ne in nin gt gte lt
  lte` (several ops: all of them). `in`/`nin` take a non-empty list.
* FIELD is a metadata key, or one of the fact's times `created_at`, `updated_at`, `expires_at`,
  whose values are ISO 8601 times or epoch seconds.

Semantics, the same in SQL and in `matches`: a metadata value that is a list is the set of its
strings, and a condition holds when one of the values satisfies it (`{"tags": "work"}` holds
when "work" is among the tags). Values compare only with values of their own type: 1 equals 1.0
but neither `"1"` nor `true`; a range with a number compares numbers, with a string compares
strings by their UTF-8 bytes. `ne` and `nin` are the negations of `eq` and `in`, so they hold
for a fact without the key. A fact without an `expires_at` satisfies no condition on it but its
negations.

Bounds (`inferscale.common.bounds`, checked while parsing): at most `MAX_FILTER_DEPTH` nested
`and`/`or`/`not`, `MAX_FILTER_NODES` conditions and operators, `MAX_IN_VALUES` values in one
`in`/`nin` and `MAX_FILTER_VALUES` in the whole filter; times within the time range. The parsed
tree is flattened (`not` of `not` is the filter itself, an `and` inside an `and` joins it, and so
for `or`), so the SQL nests no deeper than the filter's logic and binds no more parameters than
those bounds allow: SQLite's parser stack and variable limit and PostgreSQL's parameter limit are
never reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

from inferscale.common.bounds import MAX_FILTER_DEPTH, MAX_FILTER_NODES, MAX_FILTER_VALUES, MAX_IN_VALUES
from inferscale.common.metadata import LOGICAL, OPS, TIME_FIELDS, check_key, check_scalar, to_epoch

RANGE_SQL = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
MAX_NODES = MAX_FILTER_NODES  # conditions and operators in one filter


@dataclass(frozen=True)
class Cond:
    field: str
    op: str  # eq | in | gt | gte | lt | lte (ne / nin are parsed as Not(eq / in))
    values: tuple  # one value, or the `in` list; times as epoch seconds


@dataclass(frozen=True)
class And:
    parts: tuple


@dataclass(frozen=True)
class Or:
    parts: tuple


@dataclass(frozen=True)
class Not:
    part: "Node"


Node = Union[Cond, And, Or, Not]
NODE_TYPES = (Cond, And, Or, Not)


# -- parsing ---------------------------------------------------------------------------------
class _Budget:
    """What one filter may still hold while it is parsed (nodes, list values)."""

    def __init__(self) -> None:
        self.nodes = self.values = 0

    def node(self, where: str) -> None:
        self.nodes += 1
        if self.nodes > MAX_FILTER_NODES:
            raise ValueError(f"{where}: a filter holds at most {MAX_FILTER_NODES} conditions and operators")

    def listed(self, n: int, where: str) -> None:
        if n > MAX_IN_VALUES:
            raise ValueError(f"{where} has {n} values; the limit is {MAX_IN_VALUES}")
        self.values += n
        if self.values > MAX_FILTER_VALUES:
            raise ValueError(f"{where}: a filter holds at most {MAX_FILTER_VALUES} values in its lists")


def parse_filter(spec: object, where: str = "filters") -> Node | None:
    """The filter of a request's JSON (None or {} for no filter); ValueError naming the part."""
    if spec is None or (isinstance(spec, Mapping) and not spec):
        return None
    return _node(spec, where, _Budget(), 0)


def _node(spec: object, where: str, budget: _Budget, depth: int) -> Node:
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"{where} must be a non-empty JSON object, got {_short(spec)}")
    parts = []
    for key, value in spec.items():
        at = f"{where}.{key}"
        budget.node(at)
        op = key.lower() if isinstance(key, str) and key.lower() in LOGICAL and key in (key.lower(), key.upper()) \
            else None
        if op is not None and depth >= MAX_FILTER_DEPTH:
            raise ValueError(f"{at}: a filter nests at most {MAX_FILTER_DEPTH} and/or/not deep")
        if op in ("and", "or"):
            if not isinstance(value, list) or not value:
                raise ValueError(f"{at} must be a non-empty list of filters")
            subs = [_node(v, f"{at}.{i}", budget, depth + 1) for i, v in enumerate(value)]
            parts.append(_joined(And if op == "and" else Or, subs))
        elif op == "not":
            parts.append(_negated(_node(value, at, budget, depth + 1)))
        elif key in OPS:
            raise ValueError(f"{at}: an operator goes inside a field, as in {{\"priority\": {{\"{key}\": ...}}}}")
        else:
            parts.append(_field(check_key(key, where), value, at, budget))
    return _joined(And, parts)


def _joined(kind: type, parts: list) -> Node:
    """`kind` (And or Or) of `parts`, those of the same kind spliced in (one part: itself)."""
    flat = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, kind) else (p,))
    return flat[0] if len(flat) == 1 else kind(tuple(flat))


def _negated(node: Node) -> Node:
    return node.part if isinstance(node, Not) else Not(node)


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _field(field: str, spec: object, where: str, budget: _Budget) -> Node:
    if not isinstance(spec, Mapping):
        return _cond(field, "eq", spec, where, budget)
    if not spec:
        raise ValueError(f"{where} must be a value or an object of operators ({', '.join(OPS)})")
    conds = []
    for op, value in spec.items():
        budget.node(f"{where}.{op}")
        if op not in OPS:
            raise ValueError(f"{where}: unknown operator {_short(op)}; use {', '.join(OPS)}")
        conds.append(_cond(field, op, value, f"{where}.{op}", budget))
    return _joined(And, conds)


def _cond(field: str, op: str, value: object, where: str, budget: _Budget) -> Node:
    def one(v: object, at: str):
        if field in TIME_FIELDS:
            return to_epoch(v, at)
        if isinstance(v, (list, dict)) or v is None:
            raise ValueError(f"{at} must be a string, number or boolean (lists go in 'in'), got {_short(v)}")
        return check_scalar(v, at)

    if op in ("in", "nin"):
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where} must be a non-empty list of values")
        budget.listed(len(value), where)
        node: Node = Cond(field, "in", tuple(one(v, f"{where}.{i}") for i, v in enumerate(value)))
    else:
        v = one(value, where)
        if op in RANGE_SQL and isinstance(v, bool):
            raise ValueError(f"{where}: a range compares numbers or strings, not booleans")
        node = Cond(field, "eq" if op == "ne" else op, (v,))
    return Not(node) if op in ("ne", "nin") else node


# -- the reference ---------------------------------------------------------------------------
def _typed(v: object) -> tuple:
    """A value with its type, so that True, 1 and "1" never compare equal."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, str):
        return ("s", v.encode("utf-8"))
    return ("n", float(v))


def matches(node: Node | None, metadata: Mapping[str, Any], times: Mapping[str, float | None]) -> bool:
    """Whether a fact with this metadata and these times (`TIME_FIELDS`, epoch seconds or None)
    satisfies `node`: the reference the catalog's SQL is tested against."""
    if node is None:
        return True
    if isinstance(node, And):
        return all(matches(p, metadata, times) for p in node.parts)
    if isinstance(node, Or):
        return any(matches(p, metadata, times) for p in node.parts)
    if isinstance(node, Not):
        return not matches(node.part, metadata, times)
    if node.field in TIME_FIELDS:
        t = times.get(node.field)
        have = [] if t is None else [("n", float(t))]
    else:
        raw = metadata.get(node.field)
        have = [] if raw is None else [_typed(v) for v in (raw if isinstance(raw, list) else [raw])]
    want = [_typed(v) for v in node.values]
    if node.op in ("eq", "in"):
        return any(h in want for h in have)
    kind, bound = want[0]
    compare = {"gt": lambda a: a > bound, "gte": lambda a: a >= bound, "lt": lambda a: a < bound,
               "lte": lambda a: a <= bound}[node.op]
    return any(k == kind and compare(v) for k, v in have)


# -- SQL -------------------------------------------------------------------------------------
def to_sql(node: Node | None, user_id: str, per_row: bool = False) -> tuple[str, list]:
    """A WHERE fragment over `facts f` of `user_id` (with `?` placeholders) and its parameters.
    A metadata condition reads the `fact_meta` rows (one per value): as the set of the user's
    fact ids that satisfy it, through the (user_id, key, value) indexes (to select among all the
    user's facts), or `per_row`, as a lookup per fact through the (fact, key) index (to check a few
    candidates). Strings compare as bytes in both dialects (PostgreSQL's column is `COLLATE "C"`)."""
    if node is None:
        return "1=1", []
    params: list = []
    return _sql(node, params, user_id, per_row), params


def _sql(node: Node, params: list, user_id: str, per_row: bool) -> str:
    if isinstance(node, (And, Or)):
        glue = " AND " if isinstance(node, And) else " OR "
        return "(" + glue.join(_sql(p, params, user_id, per_row) for p in node.parts) + ")"
    if isinstance(node, Not):
        return f"(NOT {_sql(node.part, params, user_id, per_row)})"
    if node.field in TIME_FIELDS:
        column = f"f.{node.field}"
        if node.op == "in":
            params.extend(float(v) for v in node.values)
            test = f"{column} IN ({','.join('?' * len(node.values))})"
        else:
            params.append(float(node.values[0]))
            test = f"{column} {'=' if node.op == 'eq' else RANGE_SQL[node.op]} ?"
        return f"({column} IS NOT NULL AND {test})"  # never NULL, so NOT keeps two-valued logic
    if per_row:
        params.append(node.field)
        return f"EXISTS (SELECT 1 FROM fact_meta m WHERE m.fact = f.id AND m.key = ? AND ({_meta_test(node, params)}))"
    return f"f.id IN ({_meta_set(node, params, user_id)})"


def _meta_set(node: Cond, params: list, user_id: str) -> str:
    """The query of the ids of the user's facts with a metadata value that satisfies `node`."""
    params += [user_id, node.field]
    return f"SELECT m.fact FROM fact_meta m WHERE m.user_id = ? AND m.key = ? AND ({_meta_test(node, params)})"


def _meta_test(node: Cond, params: list) -> str:
    """The condition on one `fact_meta` row `m`."""
    if node.op in ("eq", "in"):
        by_kind: dict[str, list] = {}
        for v in node.values:
            kind, _ = _typed(v)
            by_kind.setdefault(kind, []).append(v if kind == "s" else float(v))
        tests = []
        for kind, values in sorted(by_kind.items()):
            column = "m.sval" if kind == "s" else "m.nval"
            tests.append(f"(m.kind = '{kind}' AND {column} IN ({','.join('?' * len(values))}))")
            params.extend(values)
        return " OR ".join(tests)
    kind, _ = _typed(node.values[0])
    if kind == "s":
        params.append(node.values[0])
        return f"m.kind = 's' AND m.sval {RANGE_SQL[node.op]} ?"
    params.append(float(node.values[0]))
    return f"m.kind = 'n' AND m.nval {RANGE_SQL[node.op]} ?"


def bounds(node: Node | None, user_id: str) -> list[tuple[str, list]]:
    """Queries (`SELECT 1 ...`) each of whose row counts bounds from above how many of the user's
    facts satisfy `node`: one per condition that every match must meet (the `and` of positive
    conditions). Empty when none bounds it (`or`, `not` at the top)."""
    if isinstance(node, And):
        return [b for p in node.parts for b in bounds(p, user_id)]
    if not isinstance(node, Cond):
        return []
    params: list = []
    if node.field in TIME_FIELDS:
        params.append(user_id)
        return [(f"SELECT 1 FROM facts f WHERE f.user_id = ? AND {_sql(node, params, user_id, False)}", params)]
    return [(f"SELECT 1 FROM ({_meta_set(node, params, user_id)}) x", params)]


def meta_rows(metadata: Mapping[str, Any]) -> list[tuple[str, str, str | None, float | None]]:
    """The `fact_meta` rows of a fact's metadata: (key, kind, sval, nval), one per value."""
    rows = []
    for key, raw in metadata.items():
        for v in raw if isinstance(raw, list) else [raw]:
            kind, _ = _typed(v)
            rows.append((key, kind, v if kind == "s" else None, None if kind == "s" else float(v)))
    return rows
