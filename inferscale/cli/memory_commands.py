"""`inferscale memory add|search|list|update|delete|delete-user|history|update-turn|delete-turn|export|import|sweep`.

Every command takes `--root` (the memory directory) and `--model` (the model whose KV the memory
holds; default the packaged SmolLM2). Output is JSON on stdout. The model is loaded only by
commands that encode KV (add, update, turn edits), and the embedder only by those that embed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


class LazyEncoder:
    """Store meta from the model folder alone; the torch encoder is loaded on the first encode."""

    def __init__(self, model_dir: Path) -> None:
        from inferscale.common.model.spec import ModelSpec, model_fingerprint

        self.model_dir = model_dir
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.fingerprint = model_fingerprint(model_dir, self.spec)
        self._encoder = None

    def store_meta(self, w: int, context: str = "turns"):
        from inferscale.common.storage.format import StoreMeta

        return StoreMeta.for_model(self.spec, self.fingerprint, w=w, context=context)

    def _loaded(self):
        if self._encoder is None:
            from inferscale.encoders.torch_encoder import TorchFactEncoder

            self._encoder = TorchFactEncoder(self.model_dir)
        return self._encoder

    def encode_windowed(self, facts, windows, w):
        return self._loaded().encode_windowed(facts, windows, w)

    def encode_listed(self, facts, previous, w):
        return self._loaded().encode_listed(facts, previous, w)


class LazyEmbedder:
    """`MiniLMEmbedder(query_weights=...)`, loaded on the first text embedded."""

    name, dim = "all-MiniLM-L6-v2", 384

    def __init__(self, query_weights: str = "auto") -> None:
        from inferscale.common.modes import QUERY_WEIGHTS

        if query_weights not in QUERY_WEIGHTS:
            raise ValueError(f"query_weights must be one of {', '.join(QUERY_WEIGHTS)}, got {query_weights!r}")
        self.query_weights = query_weights
        self._embedder = None

    def _loaded(self):
        if self._embedder is None:
            from inferscale.retrieval.embedders import MiniLMEmbedder

            self._embedder = MiniLMEmbedder(query_weights=self.query_weights)
        return self._embedder

    def embed(self, texts):
        return self._loaded().embed(texts)

    def embed_query(self, text):
        return self._loaded().embed_query(text)


MEMORY_FLAGS = ("w", "context", "catalog", "kv_store")  # the engine settings a memory root is opened with


def add_parser(sub) -> None:
    from inferscale.config import EngineSettings, add_flags  # plain Python: no engine

    p = sub.add_parser("memory", help="add, search, update and delete per-user memories")
    p.add_argument("--root", required=True, help="memory directory (created if missing)")
    p.add_argument("--model", default=None, help="HF model folder (default: the packaged SmolLM2)")
    add_flags(p, EngineSettings, MEMORY_FLAGS)  # serve's flags of the same names (one definition)
    cmds = p.add_subparsers(dest="memory_command", metavar="ACTION", required=True)
    a = cmds.add_parser("add", help="add facts (and the turns they came from)")
    a.add_argument("user")
    a.add_argument("--fact", action="append", default=[], metavar="TEXT", help="a fact (repeatable)")
    a.add_argument("--id", action="append", default=[], metavar="ID", help="ids of the --fact values, in order")
    a.add_argument("--file", type=Path, help="JSON file: {\"turns\": [{id, speaker, text, ...}], "
                                               "\"facts\": [{id, text, source_turn?, date?}]}")
    a.add_argument("--messages", type=Path, metavar="FILE",
                   help="JSON file of chat messages [{role, content, id?, date?}]: stored as turns, and facts "
                        "extracted from them (add / update / delete decisions) by the LLM at --llm-url")
    a.add_argument("--llm-url", metavar="URL", help="OpenAI-compatible /v1 endpoint that extracts the facts of "
                                                    "--messages (an `inferscale serve` or `vllm serve`)")
    a.add_argument("--llm-model", metavar="NAME", help="the endpoint's model (default: the first it lists)")
    a.add_argument("--metadata", type=json.loads, metavar="JSON", help="metadata of every --fact: a JSON object")
    a.add_argument("--expires-at", metavar="TIME", help="when every --fact expires (ISO 8601 or epoch seconds)")
    filters = {"type": json.loads, "metavar": "JSON", "help": "only facts that satisfy this filter (docs/api.md)"}
    s = cmds.add_parser("search", help="the user's facts nearest to a query")
    s.add_argument("user")
    s.add_argument("query")
    s.add_argument("-k", type=int, default=5)
    s.add_argument("--filters", **filters)
    ls = cmds.add_parser("list", help="the user's facts")
    ls.add_argument("user")
    ls.add_argument("--filters", **filters)
    u = cmds.add_parser("update", help="change a fact's text (re-encodes it), metadata or expiry")
    u.add_argument("user")
    u.add_argument("fact_id")
    u.add_argument("text", nargs="?")
    u.add_argument("--metadata", type=json.loads, metavar="JSON", help="the fact's new metadata (replaced whole)")
    u.add_argument("--expires-at", metavar="TIME", help="when it expires (ISO 8601, epoch seconds, or 'never')")
    ex = cmds.add_parser("export", help="the user's memory as a portable JSON document (facts, turns, history)")
    ex.add_argument("user")
    ex.add_argument("--out", type=Path, help="write it here (default: stdout)")
    im = cmds.add_parser("import", help="import an exported document (validated whole, then encoded for --model)")
    im.add_argument("user")
    im.add_argument("file", type=Path)
    sw = cmds.add_parser("sweep", help="forget every expired fact of every user (KV, index, history texts)")
    sw.add_argument("--keep-history", action="store_true", help="keep the texts of the swept facts' history")
    d = cmds.add_parser("delete", help="forget a fact: its text, tokens, KV and the texts of its history")
    d.add_argument("user")
    d.add_argument("fact_id")
    d.add_argument("--keep-history", action="store_true", help="keep the texts of the fact's history")
    cmds.add_parser("delete-user", help="purge a user: facts, turns, history, index and KV").add_argument("user")
    h = cmds.add_parser("history", help="a fact's change history")
    h.add_argument("user")
    h.add_argument("fact_id")
    ut = cmds.add_parser("update-turn", help="edit a turn; re-encodes the facts whose window holds it")
    ut.add_argument("user")
    ut.add_argument("turn_id")
    ut.add_argument("text")
    dt = cmds.add_parser("delete-turn", help="delete a turn; re-encodes the facts whose window held it")
    dt.add_argument("user")
    dt.add_argument("turn_id")
    p.set_defaults(func=run)


def _remember(svc, args) -> dict:
    """`memory add --messages`: the messages as turns, their facts extracted by the endpoint's LLM."""
    import httpx

    from inferscale.memory.extraction import Extractor, turns_from_messages
    from inferscale.memory.extraction_llms import OpenAIJsonLLM

    if args.fact or args.file:
        raise ValueError("--messages goes alone: its facts are extracted (add --fact / --file separately)")
    if not args.llm_url:
        raise ValueError("--messages needs --llm-url: the endpoint whose model extracts the facts")
    data = json.loads(args.messages.read_text())
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        raise ValueError(f"{args.messages} must hold a list of messages (or {{\"messages\": [...]}})")
    model = args.llm_model or httpx.get(args.llm_url.rstrip("/") + "/models", timeout=30).json()["data"][0]["id"]
    t0 = time.monotonic()

    def progress(done: int, total: int, what: str) -> None:
        print(f"{done}/{total} {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    out = Extractor(svc, OpenAIJsonLLM(args.llm_url, model)).remember(args.user, turns_from_messages(messages),
                                                                      progress=progress)
    return {**out.to_dict(), "version": svc.version(args.user)}


def _facts_from_args(args) -> tuple[list, list]:
    from inferscale.common.facts import Fact, Turn
    from inferscale.common.metadata import to_epoch

    facts, turns = [], []
    if args.file:
        data = json.loads(args.file.read_text())
        turns = [Turn(t["id"], t.get("speaker", "user"), t["text"], t.get("session", 0), t.get("date"))
                 for t in data.get("turns", [])]
        facts = [Fact(f["id"], f["text"], f.get("source_turn"), f.get("date"), f.get("metadata") or {},
                      None if f.get("expires_at") is None else to_epoch(f["expires_at"], f"fact {f['id']} expires_at"))
                 for f in data.get("facts", [])]
    if args.id and len(args.id) != len(args.fact):
        raise ValueError(f"{len(args.id)} --id values for {len(args.fact)} --fact values")
    expires = None if args.expires_at is None else to_epoch(args.expires_at, "--expires-at")
    for i, text in enumerate(args.fact):
        fid = args.id[i] if args.id else f"m{abs(hash(text)) % 10**10:010d}"
        facts.append(Fact(fid, text, metadata=args.metadata or {}, expires_at=expires))
    return facts, turns


def _field_changes(args) -> dict:
    """`update`'s --metadata / --expires-at, as `MemoryService.update` takes them."""
    from inferscale.common.metadata import to_epoch

    out = {}
    if args.metadata is not None:
        out["metadata"] = args.metadata
    if args.expires_at is not None:
        out["expires_at"] = None if args.expires_at == "never" else to_epoch(args.expires_at, "--expires-at")
    if args.text is None and not out:
        raise ValueError("update needs a new text, --metadata or --expires-at")
    return out


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from inferscale.default_model import ensure_default_model
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    model = Path(args.model) if args.model else ensure_default_model()
    cfg = MemoryConfig(root=args.root, **{k: getattr(args, k) for k in MEMORY_FLAGS if hasattr(args, k)})
    svc = MemoryService(cfg, LazyEncoder(model), LazyEmbedder())
    try:
        cmd = args.memory_command
        if cmd == "add" and args.messages:
            out = _remember(svc, args)
        elif cmd == "add":
            facts, turns = _facts_from_args(args)
            t0 = time.monotonic()

            def progress(done: int, total: int) -> None:  # stderr, a line every few seconds (logs too)
                print(f"encoded {done}/{total} facts ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

            added = svc.add(args.user, facts=facts, turns=turns, progress=progress)
            out = {"added": added, "version": svc.version(args.user)}
        elif cmd == "search":
            out = [asdict(f) for f in svc.search(args.user, args.query, args.k, filters=args.filters)]
        elif cmd == "list":
            out = [asdict(f) for f in svc.list(args.user, filters=args.filters)]
        elif cmd == "update":
            out = asdict(svc.update(args.user, args.fact_id, args.text, **_field_changes(args)))
        elif cmd == "export":
            out = svc.export_memory(args.user)
            if args.out:
                args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
                out = {"exported": args.user, "facts": len(out["facts"]), "turns": len(out["turns"]),
                       "file": str(args.out)}
        elif cmd == "import":
            out = svc.import_memory(args.user, json.loads(args.file.read_text(encoding="utf-8"))).to_dict()
        elif cmd == "sweep":
            out = {"swept": svc.sweep_expired(keep_history=args.keep_history)}
        elif cmd == "delete":
            svc.delete(args.user, args.fact_id, keep_history=args.keep_history)
            out = {"deleted": args.fact_id}
        elif cmd == "delete-user":
            svc.delete_user(args.user)
            out = {"deleted_user": args.user}
        elif cmd == "history":
            out = svc.history(args.user, args.fact_id)
        elif cmd == "update-turn":
            out = {"reencoded": svc.update_turn(args.user, args.turn_id, args.text)}
        else:  # delete-turn
            out = {"reencoded": svc.delete_turn(args.user, args.turn_id)}
    finally:
        svc.close()
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0
