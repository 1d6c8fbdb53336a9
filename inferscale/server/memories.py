"""`/v1/memories`: the memory service over HTTP, scoped to the caller's tenant, usable while serving.

    GET    /v1/memories                                   the tenant's users (a page), and its usage and quotas
    POST   /v1/memories/{user}                            add facts and/or turns {"facts": [...], "turns": [...]};
                                                          with "messages": [...] stored as turns, facts
                                                          extracted in the background: 202 and the job
    GET    /v1/memories/{user}/jobs/{job_id}              an extraction job: state, progress, outcome
    GET    /v1/memories/{user}                            a page of the user's facts (`filters`: JSON) and the
                                                          memory version
    DELETE /v1/memories/{user}                            purge the user (facts, turns, history, index, KV)
    POST   /v1/memories/{user}/search                     {"query": ..., "k": 5, "filters": {...}}
    GET    /v1/memories/{user}/export                     the user's memory as one portable JSON document
    POST   /v1/memories/{user}/import                     write such a document (validated whole first)
    GET    /v1/memories/{user}/facts/{fact_id}            one fact
    PATCH  /v1/memories/{user}/facts/{fact_id}            {"text"?, "metadata"?, "expires_at"?} (a new text
                                                          re-embeds and re-encodes)
    DELETE /v1/memories/{user}/facts/{fact_id}            forget a fact (text, tokens, KV, history texts;
                                                          `?keep_history=true` keeps its history)
    GET    /v1/memories/{user}/facts/{fact_id}/history    the fact's change history (a page)
    PATCH  /v1/memories/{user}/turns/{turn_id}            {"text": ...} (re-encodes the facts whose window holds it)
    DELETE /v1/memories/{user}/turns/{turn_id}            delete a turn's text (same re-encoding)

A fact is `{"id"?, "text", "source_turn"?, "date"?, "metadata"?, "expires_at"?}` (id default: derived
from the text); a turn is `{"id", "speaker"?, "text", "session"?, "date"?}`. Lists are pages:
`?limit=` (default 100, at most 1000) and `?cursor=` (the previous page's `next_cursor`; null on
the last page). Unknown user or fact: 404; bad input: 400; a tenant quota: 413 (facts, KV bytes)
or 429 (requests in flight), naming the limit. A change is visible to the next chat request (the
memory version is part of every plan and salt); an expired fact is gone from every read at once.

Limits (ServerConfig), checked before any work: an add holds at most `max_add_items` facts, turns
and messages together, and an import at most `max_add_items` facts and turns (413: split it); a
fact's, turn's, message's or history event's text at most `max_text_chars` characters, a search
query at most `max_query_chars` (400 naming the field). Times, filters and cursors are bounded
as `inferscale.common.bounds` says (400 naming the field). A request is validated whole before
anything is written: an add's facts, turns and messages (and whether this server extracts facts
at all), an import's whole document; a refused request writes nothing.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import JSONResponse

from inferscale.common.bounds import MAX_JSON_DEPTH
from inferscale.common.pages import MAX_LIMIT
from inferscale.common.storage.filters import Node, parse_filter
from inferscale.server.auth import Tenancy, tenant_of
from inferscale.server.errors import bad_request, too_large
from inferscale.server.schemas import AddMemories, FactUpdate, SearchMemories, TextUpdate

Limit = Query(100, ge=1, le=MAX_LIMIT, description="items per page")
Cursor = Query(None, max_length=512, description="the previous page's next_cursor")

router = APIRouter(prefix="/v1/memories")


def _ctx(request: Request, tenant: str, user: str):
    return request.app.state.inferscale.gateway, Tenancy.internal_user(tenant, user)


def _check_chars(request: Request, text: str, setting: str, param: str) -> None:
    """400 naming `param` if `text` is longer than the ServerConfig limit `setting`."""
    limit = getattr(request.app.state.inferscale.config, setting)
    if len(text) > limit:
        raise bad_request(f"{param} has {len(text)} characters; the limit is {limit} ({setting})", param)


def _check_add(request: Request, body: AddMemories) -> None:
    limit = request.app.state.inferscale.config.max_add_items
    n = len(body.facts) + len(body.turns) + len(body.messages)
    if n > limit:
        raise too_large(f"an add holds at most {limit} facts, turns and messages together (max_add_items); this "
                        f"one has {n}: split it into several requests", "facts")
    for where, items in (("facts", body.facts), ("turns", body.turns)):
        for i, item in enumerate(items):
            _check_chars(request, item.text, "max_text_chars", f"{where}.{i}.text")
    for i, m in enumerate(body.messages):
        _check_chars(request, m.content, "max_text_chars", f"messages.{i}.content")


def _check_import(request: Request, doc: dict) -> None:
    """An import is bounded as an add is: `max_add_items` facts and turns, `max_text_chars` per text."""
    limit = request.app.state.inferscale.config.max_add_items
    items = {k: v for k in ("facts", "turns") if isinstance(v := doc.get(k), list)}
    n = sum(len(v) for v in items.values())
    if n > limit:
        raise too_large(f"an import holds at most {limit} facts and turns together (max_add_items); this one "
                        f"has {n}: split the document into several imports", "facts")
    for where, values in items.items():  # (what is not a string here, the service names)
        for i, item in enumerate(values):
            for path, text in _texts(item, f"{where}.{i}"):
                _check_chars(request, text, "max_text_chars", path)


def _texts(item: object, where: str) -> list[tuple[str, str]]:
    """(path, text) of an imported turn's or fact's text and of its history events' texts."""
    if not isinstance(item, dict):
        return []
    out = [(f"{where}.text", item["text"])] if isinstance(item.get("text"), str) else []
    history = item.get("history")
    for j, event in enumerate(history if isinstance(history, list) else ()):
        if isinstance(event, dict):
            out += [(f"{where}.history.{j}.{k}", event[k]) for k in ("old_text", "new_text")
                    if isinstance(event.get(k), str)]
    return out


def _filter(spec: object, param: str) -> Node | None:
    """A request's filter, parsed (and bounded) where it arrives: 400 naming `param`."""
    try:
        return parse_filter(spec, param)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _filter_query(filters: str | None) -> Node | None:
    """The `filters` query parameter: JSON text, then a filter."""
    if filters is None:
        return None
    try:
        spec = json.loads(filters)
    except (ValueError, RecursionError):
        raise bad_request(f"filters must be a JSON object (nested at most {MAX_JSON_DEPTH} deep)", "filters") from None
    return _filter(spec, "filters")


@router.get("")
async def list_users(request: Request, limit: int = Limit, cursor: str | None = Cursor,
                     tenant: str = Depends(tenant_of)):
    out = await request.app.state.inferscale.gateway.users(tenant, limit, cursor)
    return {"object": "list", "data": [{"user": u} for u in out["users"]], "next_cursor": out["next_cursor"],
            "usage": out["usage"]}


@router.post("/{user}")
async def add(user: str, body: AddMemories, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    _check_add(request, body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    if messages:  # checked whole before the facts and turns are written
        gw.check_messages(messages)
    out = {}
    if body.facts or body.turns or not body.messages:
        out = await gw.add(uid, [f.model_dump() for f in body.facts], [t.model_dump() for t in body.turns])
    if not body.messages:
        return {"user": user, **out}
    job = await gw.remember(uid, messages)
    return JSONResponse({"user": user, **out, "job": job}, status_code=202)


@router.get("/{user}/jobs/{job_id}")
async def get_job(user: str, job_id: str, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    return {"user": user, **await gw.job(uid, job_id)}


@router.get("/{user}")
async def list_facts(user: str, request: Request, limit: int = Limit, cursor: str | None = Cursor,
                     filters: str | None = Query(None, description="a JSON filter (docs/api.md)"),
                     tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    out = await gw.list(uid, limit, cursor, _filter_query(filters))
    return {"object": "list", "user": user, "version": out["version"], "data": out["facts"],
            "next_cursor": out["next_cursor"]}


@router.get("/{user}/export")
async def export(user: str, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    return {**await gw.export(uid), "user": user}


@router.post("/{user}/import")
async def import_(user: str, request: Request, doc: dict = Body(...), tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    doc = {k: v for k, v in doc.items() if k != "user"}  # the exported user's name: this route names the target
    _check_import(request, doc)
    return {"user": user, "imported": await gw.import_(uid, doc)}


@router.delete("/{user}")
async def delete_user(user: str, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    await gw.delete_user(uid)
    return {"user": user, "deleted": True}


@router.post("/{user}/search")
async def search(user: str, body: SearchMemories, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    _check_chars(request, body.query, "max_query_chars", "query")
    node = _filter(body.filters, "filters")
    return {"object": "list", "user": user, "data": await gw.search(uid, body.query, body.k, node)}


@router.get("/{user}/facts/{fact_id}")
async def get_fact(user: str, fact_id: str, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    return await gw.get(uid, fact_id)


@router.patch("/{user}/facts/{fact_id}")
async def update_fact(user: str, fact_id: str, body: FactUpdate, request: Request,
                      tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    if body.text is not None:
        _check_chars(request, body.text, "max_text_chars", "text")
    return await gw.update(uid, fact_id, body.model_dump(include=body.model_fields_set))


@router.delete("/{user}/facts/{fact_id}")
async def delete_fact(user: str, fact_id: str, request: Request, keep_history: bool = False,
                      tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    await gw.delete(uid, fact_id, keep_history)
    return {"user": user, "id": fact_id, "deleted": True}


@router.get("/{user}/facts/{fact_id}/history")
async def history(user: str, fact_id: str, request: Request, limit: int = Limit, cursor: str | None = Cursor,
                  tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    out = await gw.history(uid, fact_id, limit, cursor)
    return {"object": "list", "user": user, "id": fact_id, "data": out["events"], "next_cursor": out["next_cursor"]}


@router.patch("/{user}/turns/{turn_id}")
async def update_turn(user: str, turn_id: str, body: TextUpdate, request: Request,
                      tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    _check_chars(request, body.text, "max_text_chars", "text")
    return {"user": user, "turn_id": turn_id, "reencoded": await gw.change_turn(uid, turn_id, body.text)}


@router.delete("/{user}/turns/{turn_id}")
async def delete_turn(user: str, turn_id: str, request: Request, tenant: str = Depends(tenant_of)):
    gw, uid = _ctx(request, tenant, user)
    return {"user": user, "turn_id": turn_id, "reencoded": await gw.change_turn(uid, turn_id, None)}
