"""`inferscale demo`: the product on the embedded model, as a short chat with a system prompt.

The serving path end to end: the memory service encodes the demo conversation's facts once
(Context-Window Encoding, with progress), then vLLM with InferScale's connector answers a few
turns of a chat: a system prompt, then one demo question per turn, each turn carrying the earlier
ones. Every turn is answered twice by the composer the server uses (`MemoryComposer.compose_chat`,
as `chat_layout: auto` lays chats out): with the same facts prefilled as text (history-first: the
system prompt and the turns so far, then the retrieved memory inside the new user turn) and with
the memory's KV injected (memory-first: the memory, then the whole chat). Their times to
first token are measured side by side: text as the chat serves it (the conversation so far found
in vLLM's prefix cache, which the previous turn left there), text with the whole prompt prefilled
again (a fresh prefix-cache salt), and injected. The model's quality gate says what
`memory.mode: auto` serves, and why; that answer is appended to the chat as the assistant's reply.
Last, the whole memory (`k: "all"`) is served from the user's memory chain (its facts' KV encoded
jointly, in the order they were added: `inferscale.memory.chain`) and as text, side by side: the
same answer token for token, and the chain's time to first token against the text's re-prefilled.

vLLM and torch are imported inside `run_chat_demo`, so importing this module stays cheap.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.progress import Progress
from rich.table import Table

SYSTEM_PROMPT = "You are a friendly assistant. Answer in one short sentence."


@dataclass(frozen=True)
class Turn:
    question: str
    gold: str
    inject: object  # MemoryOutput of the answer with the memory injected
    text: object  # ... with the same facts prefilled as text
    inject_ttft_s: float
    text_ttft_s: float  # the conversation so far from the prefix cache
    cold_ttft_s: float  # the whole prompt prefilled again
    cached_tokens: int  # of the text prompt's, found in the prefix cache
    auto: tuple[str, str | None, str]  # what memory.mode auto serves: (mode, policy, why)
    served: object  # the answer auto serves (joins the chat)
    facts: tuple[str, ...] = ()


@dataclass(frozen=True)
class WholeMemory:
    """The whole memory (k "all") of the last question, from the chain and as text."""

    chain: object  # MemoryOutput: mode chain, every link stored (loaded from the store: a fresh salt)
    text: object  # ... the same prompt prefilled as text
    chain_ttft_s: float
    text_ttft_s: float  # re-prefilled (a fresh salt)
    auto: tuple[str, str | None, str]  # what memory.mode auto serves for k "all"


@dataclass
class ChatDemoResult:
    turns: list[Turn] = field(default_factory=list)
    whole: WholeMemory | None = None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _one_line(text: str) -> str:
    return " ⏎ ".join(line.strip() for line in text.splitlines() if line.strip())


def _ttft(llm, user: str, question: str, mode: str, messages: list[dict], k: int, warm: bool = False):
    """Request in -> first token out (search, composition, injection, prefill): from a prompt the
    prefix cache has not seen (a fresh salt), or `warm`, with the chat's own salt (what the earlier
    turns left in the prefix cache is reused). The output (`ttft_s`, `cached_tokens`)."""
    return llm.generate(user, question, k=k, mode=mode, max_tokens=1, messages=messages,
                        cache_salt=None if warm else uuid.uuid4().hex)


def run_chat_demo(cfg, console: Console) -> ChatDemoResult:
    """The demo on `cfg` (a `DemoConfig`), printing to `console`."""
    from inferscale.demo import resolve_model_dir
    from inferscale.evaluation.datasets import load_demo
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    sample = load_demo()
    conv = sample.conversation
    model_dir = resolve_model_dir(cfg.model)
    with tempfile.TemporaryDirectory(prefix="inferscale-demo-") as root:
        t = time.perf_counter()
        with console.status("Starting vLLM with InferScale's connector..."):
            llm = MemoryLLM(MemoryLLMConfig(**cfg.settings.engine_settings(), model=str(model_dir), memory_root=root),
                            embedder=MiniLMEmbedder())
        try:
            console.print(f"Serving [bold]{escape(model_dir.name)}[/] through vLLM + the InferScale connector "
                          f"(started in {time.perf_counter() - t:.1f} s)")
            if cfg.memory_root:  # the server's memory root: its own calibration, if it has one
                from inferscale.gate.calibration import Calibration, settings_key

                own = Calibration.load(cfg.memory_root, llm.encoder.fingerprint, settings_key(llm.config))
                if own is not None:
                    llm.composer.calibration = own
            cal = llm.composer.calibration
            console.print("Quality gate: " + (f"{cal.source} calibration ({escape(cal.data)})" if cal else
                                              "not calibrated (memory.mode auto serves text)"))
            t = time.perf_counter()
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"Encoding {len(conv.facts)} facts (w={llm.config.w})", total=len(conv.facts))
                llm.memory.add("demo", turns=conv.turns, facts=conv.facts,
                               progress=lambda done, n: bar.update(task, completed=done))
            console.print(f"Encoded {len(conv.facts)} facts of a {len(conv.turns)}-turn conversation once, "
                          f"in {time.perf_counter() - t:.1f} s\n")
            questions = sample.questions[: cfg.questions]
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            # untimed: vLLM's first requests of each mode compile and allocate
            warm = messages + [{"role": "user", "content": questions[0].question}]
            for mode in ("inject", "text"):
                _ttft(llm, "demo", questions[0].question, mode, warm, cfg.k)
            console.print("Each turn's time to first token: [bold]text[/] as the chat serves it (the conversation "
                          "so far from vLLM's prefix cache), [bold]re-prefilled[/] (the whole prompt again), and "
                          "[bold]inject[/] (the memory's KV injected).\n")
            result = ChatDemoResult()
            for i, qa in enumerate(questions, 1):
                messages.append({"role": "user", "content": qa.question})
                result.turns.append(_turn(llm, qa, messages, cfg))
                _print_turn(console, i, len(questions), result.turns[-1], len(messages))
                messages.append({"role": "assistant", "content": result.turns[-1].served.text.strip()})
            console.print(_summary(result))
            result.whole = _whole_memory(llm, questions[-1].question, messages[:-1], cfg)
            _print_whole(console, result.whole)
            return result
        finally:
            llm.close()


def _turn(llm, qa, messages: list[dict], cfg) -> Turn:
    cold = _ttft(llm, "demo", qa.question, "text", messages, cfg.k)
    warm = _ttft(llm, "demo", qa.question, "text", messages, cfg.k, warm=True)
    inject_ttft = _ttft(llm, "demo", qa.question, "inject", messages, cfg.k).ttft_s
    kw = dict(k=cfg.k, max_tokens=cfg.max_new_tokens, messages=messages)
    inject = llm.generate("demo", qa.question, mode="inject", **kw)
    text = llm.generate("demo", qa.question, mode="text", **kw)
    auto = llm.resolve("auto", cfg.k)
    mode, policy, _ = auto
    if mode == "text":
        served = text
    elif policy in (None, "none"):
        served = inject
    else:
        served = llm.generate("demo", qa.question, mode="inject", policy=policy, **kw)
    return Turn(qa.question, qa.answer, inject, text, inject_ttft, warm.ttft_s, cold.ttft_s, warm.cached_tokens, auto,
                served, tuple(inject.facts))


def _whole_memory(llm, question: str, messages: list[dict], cfg) -> WholeMemory:
    """The last question with the whole memory: its chain built (the first request prefills what
    the chain lacks and encodes it in the background), then served from the chain and as text."""
    llm.generate("demo", question, mode="chain", max_tokens=1, messages=messages)
    llm.chain.drain()
    kw = dict(max_tokens=cfg.max_new_tokens, messages=messages, cache_salt=None)
    chain_ttft = _ttft(llm, "demo", question, "chain", messages, "all").ttft_s
    text_ttft = _ttft(llm, "demo", question, "text", messages, "all").ttft_s
    chain = llm.generate("demo", question, mode="chain", **{**kw, "cache_salt": uuid.uuid4().hex})
    text = llm.generate("demo", question, k="all", mode="text", **{**kw, "cache_salt": uuid.uuid4().hex})
    return WholeMemory(chain, text, chain_ttft, text_ttft, llm.resolve("auto", "all"))


def _print_whole(console: Console, w: WholeMemory) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("chain", escape(_one_line(w.chain.text)))
    grid.add_row("text", escape(_one_line(w.text.text)))
    same = "identical token for token" if w.chain.token_ids == w.text.token_ids else "DIFFERENT"
    grid.add_row("answers", f"{same} ({len(w.chain.token_ids)} tokens)")
    grid.add_row("TTFT", f"chain {_ms(w.chain_ttft_s)} ({w.chain.num_injected} of {w.chain.num_prompt} prompt tokens "
                         f"loaded from the chain's store) | text re-prefilled {_ms(w.text_ttft_s)}")
    grid.add_row("auto", f"serves {w.auto[0]}, because {escape(w.auto[2])}")
    console.print(f"\n[bold]The whole memory[/] ({len(w.chain.facts)} facts, k all) for the last question")
    console.print(Padding(grid, (0, 0, 1, 2)))


def _print_turn(console: Console, i: int, n: int, t: Turn, n_messages: int) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("gold", escape(t.gold))
    grid.add_row("inject", escape(_one_line(t.inject.text)))
    grid.add_row("text", escape(_one_line(t.text.text)))
    grid.add_row("TTFT", f"text {_ms(t.text_ttft_s)} ({t.cached_tokens} of {t.text.num_prompt} prompt tokens "
                         f"from the prefix cache) | re-prefilled {_ms(t.cold_ttft_s)} | inject {_ms(t.inject_ttft_s)} "
                         f"({t.inject.num_injected} tokens injected)")
    mode, policy, why = t.auto
    how = f"inject, policy {policy}" if mode == "inject" else "text"
    grid.add_row("auto", f"serves {how}, because {escape(why)}")
    console.print(f"[bold]Turn {i}/{n}[/] ({n_messages} messages with the system prompt) {escape(t.question)}")
    console.print(Padding(grid, (0, 0, 1, 2)))


def _summary(result: ChatDemoResult) -> Table:
    turns = result.turns
    table = Table(title=f"Summary over {len(turns)} turn{'' if len(turns) == 1 else 's'}")
    table.add_column("")
    table.add_column("inject", justify="right")
    table.add_column("text", justify="right")
    table.add_column("text re-prefilled", justify="right")
    table.add_row("median TTFT", _ms(statistics.median(t.inject_ttft_s for t in turns)),
                  _ms(statistics.median(t.text_ttft_s for t in turns)),
                  _ms(statistics.median(t.cold_ttft_s for t in turns)))
    later = turns[1:] or turns
    table.add_row("median TTFT from turn 2", _ms(statistics.median(t.inject_ttft_s for t in later)),
                  _ms(statistics.median(t.text_ttft_s for t in later)),
                  _ms(statistics.median(t.cold_ttft_s for t in later)))
    table.add_row("prompt tokens from the prefix cache (last turn)", "",
                  f"{turns[-1].cached_tokens} of {turns[-1].text.num_prompt}", "0")
    table.add_row("prompt tokens injected (median)", str(int(statistics.median(t.inject.num_injected for t in turns))),
                  "0", "0")
    same = sum(t.inject.token_ids == t.text.token_ids for t in turns)
    table.add_row("answers identical token for token", f"{same}/{len(turns)}", "")
    kinds = sorted({f"inject {t.auto[1]}" if t.auto[0] == "inject" else "text" for t in turns})
    table.add_row("memory.mode auto served", ", ".join(kinds), "")
    return table
