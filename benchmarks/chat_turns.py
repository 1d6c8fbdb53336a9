"""Multi-turn chats with memory: time to first token by turn, and answer quality, per chat layout
and memory mode, against plain vLLM with no memory.

One `MemoryLLM` (vLLM + InferScale's connector) holds one LoCoMo conversation's memory (its turns
and facts, Context-Window Encoding). Its questions are asked one after another as the turns of one
chat after a system prompt, each answer kept in the history as the assistant's reply, so the
prompt grows turn by turn as a real chat's does. Several chats are replayed side by side, each in
its own configuration, interleaved turn by turn in rotating order (machine noise hits all alike):

* `plain`: vLLM with no memory, the chat as vLLM's own chat endpoint renders it;
* `<layout>/<mode>`: the top-k facts retrieved for each new message, served as `text` (prefilled)
  or `inject` (their stored KV injected by the connector), with the chat laid out
  `history-first` (the system prompt and the conversation so far, then the memory inside the new
  user turn: the conversation stays a prefix vLLM's prefix cache reuses from turn to turn) or
  `memory-first` (the memory first, then the whole chat).

Every request is served as the product serves it (each configuration's own prefix-cache salt, so
what its earlier turns left in vLLM's prefix cache is reused when the layout allows). Every turn,
each configuration first asks for one token (its TTFT end to end: retrieval, composition,
injection, prefill); at the measured turns (`--at`, default 1,10,30) the text-served ones then ask
the same prompt with a fresh salt ("re-prefilled": the whole prompt computed again, what a chat
without reuse pays), whose first token must be the same. Then the answer (`--max-tokens`, greedy)
joins the history. TTFT at turn t is the median of turns t-1, t and t+1 (those that exist: the
machine is noisy). Reported per configuration: TTFT at each measured turn (and its ratio to turn 1),
prompt tokens and how many vLLM did not prefill (prefix cache and connector), LoCoMo F1 and
gold-token recall of the answers over all turns, and how many answers equal another
configuration's token for token (history-first text against memory-first text: the same facts in
another place; inject against text: the approximation).

    python benchmarks/chat_turns.py --quick        # 10 turns, measured at 1, 5, 10 (a few minutes)
    python benchmarks/chat_turns.py                # 30 turns, measured at 1, 10, 30
    python benchmarks/chat_turns.py --model qwen2.5-coder-1.5b --json chat-qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench_args import int_list, memory_root, positive, print_rows, vllm_cpu_env

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

SYSTEM = "You are a helpful assistant. Answer each question in a few words."
USER = "chat"
PLAIN = "plain"


def parse_args(argv=None) -> argparse.Namespace:
    from inferscale.common.modes import CHAT_LAYOUTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default=None, help="locomo10.json (default: ../shared/data/locomo/locomo10.json)")
    p.add_argument("--quick", action="store_true", help="10 turns, measured at turns 1, 5 and 10")
    p.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation (default 0)")
    p.add_argument("--turns", type=positive, default=None, help="questions asked, one per turn (default 30)")
    p.add_argument("--at", type=int_list(1), default=None, help="turns whose TTFT is measured (default 1,10,30)")
    p.add_argument("--k", type=lambda x: x if x == "all" else positive(x), default=10,
                   help="facts retrieved per turn (default 10), or all: the whole memory, in the order it was added")
    p.add_argument("--facts", type=int, default=None, help="encode only the first N facts (default: all)")
    p.add_argument("--layouts", default="history-first,memory-first",
                   help="chat layouts (default: both; `auto` is history-first as text, memory-first injected)")
    p.add_argument("--modes", default="text,inject", help="memory modes (default: text,inject)")
    p.add_argument("--skip", default="", help="configurations left out, e.g. history-first/inject")
    p.add_argument("--max-tokens", type=positive, default=24, help="answer length (default 24)")
    p.add_argument("--model", default=None, help="model folder or registry name (default: SmolLM2-135M-Instruct)")
    add_flags(p, EngineSettings, defaults={"max_model_len": 4096, "w": 5})
    p.add_argument("--kv-cache-gib", type=positive, default=4,
                   help="vLLM CPU's KV cache (default 4 GiB: every chat's turns stay cached; the fresh-salt "
                        "requests would otherwise evict them)")
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write every measurement and the summary here")
    a = p.parse_args(argv)
    a.turns = a.turns or (10 if a.quick else 30)
    a.at = tuple(t for t in (a.at or ((1, 5, 10) if a.quick else (1, 10, 30))) if t <= a.turns)
    a.layouts = [x for x in a.layouts.split(",") if x]
    a.modes = [x for x in a.modes.split(",") if x]
    for x in a.layouts:
        if x not in CHAT_LAYOUTS or x == "auto":
            p.error(f"--layouts: {x!r} is not history-first or memory-first")
    for x in a.modes:
        if x not in ("text", "inject"):
            p.error(f"--modes: {x!r} is not text or inject")
    return a


def configurations(layouts, modes) -> list[str]:
    return [PLAIN] + [f"{layout}/{mode}" for layout in layouts for mode in modes]


def ask(llm, config: str, question: str, messages: list[dict], k: int, max_tokens: int, salt: str | None = None):
    """One request of `config` for the chat `messages` (ending with `question`). Exact prompts (text,
    plain) get a salt per configuration, as if each were its own user (the product salts them per
    user), so no configuration finds another's blocks; injected ones keep the product's salt, which
    follows the facts injected."""
    if config == PLAIN:
        return llm.generate(USER, question, mode="none", k=0, max_tokens=max_tokens, messages=messages,
                            cache_salt=salt or f"{USER}:{config}", logprobs=None)
    layout, mode = config.split("/")
    own = salt or (f"{USER}:{config}" if mode == "text" else None)
    return llm.generate(USER, question, mode=mode, k=k, max_tokens=max_tokens, messages=messages,
                        chat_layout=layout, cache_salt=own, logprobs=None)


def replay(llm, questions, configs: list[str], args, progress) -> list[dict]:
    """Every configuration's chat, turn by turn (rotating order); one row per (turn, configuration)."""
    from inferscale.evaluation.qa_metrics import locomo_f1, tokens

    chats = {c: [{"role": "system", "content": SYSTEM}] for c in configs}
    rows = []
    for turn, qa in enumerate(questions, 1):
        order = configs[turn % len(configs):] + configs[: turn % len(configs)]
        for c in order:
            msgs = chats[c] + [{"role": "user", "content": qa.question}]
            row = {"turn": turn, "config": c}
            first = ask(llm, c, qa.question, msgs, args.k, 1)
            row.update(ttft_s=first.ttft_s, prompt_tokens=first.num_prompt,
                       cached_tokens=first.cached_tokens, injected_tokens=first.num_injected)
            if turn in args.at:
                if c == PLAIN or c.endswith("/text"):
                    cold = ask(llm, c, qa.question, msgs, args.k, 1, salt=uuid.uuid4().hex)
                    row.update(cold_ttft_s=cold.ttft_s,
                               same_first_token=cold.token_ids == first.token_ids)
            out = ask(llm, c, qa.question, msgs, args.k, args.max_tokens)
            answer = out.text.strip()
            gold = set(tokens(qa.answer))
            row.update(answer=answer, token_ids=out.token_ids, gold=qa.answer, category=qa.category,
                       f1=locomo_f1(answer, qa.answer, qa.category),
                       recall=len(gold & set(tokens(answer))) / len(gold) if gold else 1.0)
            rows.append(row)
            chats[c] = msgs + [{"role": "assistant", "content": answer or "I don't know."}]
        progress(turn)
    return rows


def summarise(rows: list[dict], configs: list[str], at: tuple[int, ...]) -> dict:
    out = {}
    for c in configs:
        mine = [r for r in rows if r["config"] == c]
        by_turn = {r["turn"]: r for r in mine}
        ttft = {t: statistics.median(by_turn[u]["ttft_s"] for u in (t - 1, t, t + 1) if u in by_turn) for t in at}
        first = ttft[at[0]] if at else None
        out[c] = {
            "ttft_s": ttft,
            "cold_ttft_s": {t: by_turn[t].get("cold_ttft_s") for t in at},
            "vs_turn_1": {t: ttft[t] / first for t in at} if first else {},
            "prompt_tokens": {t: by_turn[t]["prompt_tokens"] for t in at},
            "cached_tokens": {t: by_turn[t]["cached_tokens"] for t in at},
            "same_first_token": all(by_turn[t].get("same_first_token", True) for t in at),
            "f1": statistics.mean(r["f1"] for r in mine),
            "recall": statistics.mean(r["recall"] for r in mine),
        }
    return out


def same_answers(rows: list[dict], a: str, b: str) -> tuple[int, int] | None:
    """(answers of `a` equal to `b`'s token for token, turns) while both chats are still the same
    conversation (they diverge after the first differing answer, so only the prefix is compared)."""
    ra = {r["turn"]: r for r in rows if r["config"] == a}
    rb = {r["turn"]: r for r in rows if r["config"] == b}
    if not ra or not rb:
        return None
    same = 0
    for t in sorted(ra):
        if ra[t]["token_ids"] != rb[t]["token_ids"]:
            break
        same += 1
    return same, len(ra)


def report(summary: dict, rows: list[dict], configs: list[str], args) -> None:
    at = args.at
    ms = lambda s: "-" if s is None else f"{s * 1e3:,.0f}"  # noqa: E731
    head = ("configuration",) + tuple(f"turn {t} ms" for t in at) + tuple(f"t{t}/t1" for t in at[1:]) + \
        tuple(f"re-prefilled t{t} ms" for t in at[-1:]) + (f"prompt tok t{at[-1]}", f"not prefilled t{at[-1]}",
                                                          "F1", "gold recall")
    body = []
    for c in configs:
        s = summary[c]
        body.append((c,) + tuple(ms(s["ttft_s"][t]) for t in at) + tuple(f"{s['vs_turn_1'][t]:.2f}x" for t in at[1:])
                    + tuple(ms(s["cold_ttft_s"][t]) for t in at[-1:])
                    + (str(s["prompt_tokens"][at[-1]]), str(s["cached_tokens"][at[-1]]),
                       f"{s['f1']:.3f}", f"{s['recall']:.3f}"))
    print_rows(f"\nTTFT end to end by turn (ms, median of the turn and its neighbours; {args.turns} turns, "
               f"k={args.k}, answers of {args.max_tokens} tokens kept in the history)", head, body)
    print("not prefilled: prompt tokens vLLM took from its prefix cache or the connector injected; re-prefilled: "
          "the same prompt with a fresh prefix-cache salt (text and plain only).")
    pairs = [("history-first/text", "memory-first/text"), ("history-first/inject", "history-first/text"),
             ("memory-first/inject", "memory-first/text")]
    for a, b in pairs:
        same = same_answers(rows, a, b)
        if same is not None:
            print(f"{a} answers equal {b}'s token for token: the first {same[0]} of {same[1]} turns")
    for c in configs:
        if not summary[c]["same_first_token"]:
            print(f"WARNING: {c}: a warm prefix cache changed a first token")
    hf = summary.get("history-first/text")
    if hf and len(at) > 1:
        r = hf["vs_turn_1"][at[-1]]
        print(f"target: history-first/text turn {at[-1]} TTFT <= 1.5x turn {at[0]}'s: {r:.2f}x "
              f"({'met' if r <= 1.5 else 'missed'})")


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.demo import resolve_model_dir
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    sample = load_locomo(args.path or DEFAULT_LOCOMO_PATH)[args.conversation]
    conv = sample.conversation
    facts = conv.facts[: args.facts] if args.facts else conv.facts
    questions = sample.questions[: args.turns]
    configs = [c for c in configurations(args.layouts, args.modes) if c not in args.skip.split(",")]
    model_dir = resolve_model_dir(args.model)
    root, tmp = memory_root(args.memory_root, "inferscale-chat-")
    print(f"{model_dir.name}: LoCoMo {conv.id}, {len(facts)} facts, {len(questions)} turns, "
          f"configurations: {', '.join(configs)}", flush=True)
    llm = MemoryLLM(MemoryLLMConfig(model=str(model_dir), memory_root=root, w=args.w, kv_dtype="float32",
                                    max_model_len=args.max_model_len, cpu_kv_cache_gib=args.kv_cache_gib),
                    embedder=MiniLMEmbedder())
    try:
        t = time.perf_counter()
        shown = [-1]

        def encoded(done: int, n: int) -> None:  # a line per tenth: readable in a log file too
            if done * 10 // max(n, 1) > shown[0]:
                shown[0] = done * 10 // max(n, 1)
                print(f"encoded {done}/{n} facts ({time.perf_counter() - t:.0f} s)", flush=True)

        llm.memory.add(USER, turns=conv.turns, facts=facts, progress=encoded)
        for c in configs:  # untimed: each path's first request compiles and allocates
            ask(llm, c, "Hello?", [{"role": "user", "content": "Hello?"}], args.k, 1, salt=uuid.uuid4().hex)
        t = time.perf_counter()
        rows = replay(llm, questions, configs, args,
                      lambda turn: print(f"turn {turn}/{len(questions)} ({time.perf_counter() - t:.0f} s)", flush=True))
    finally:
        llm.close()
        if tmp is not None:
            tmp.cleanup()
    summary = summarise(rows, configs, args.at)
    report(summary, rows, configs, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "summary": summary,
                                               "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
