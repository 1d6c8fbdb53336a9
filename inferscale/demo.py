"""`inferscale demo --engine jax`: the research engine on the packaged demo questions, answered by
joint prefill and by KV injection. (`inferscale demo` runs the product: `inferscale.chat_demo`.)

The demo facts are encoded once with Context-Window Encoding. For every question the top-k facts
are retrieved (all-MiniLM-L6-v2, exact cosine, best first) and the question is answered twice,
once with those facts' text prefilled in the prompt ("joint") and once with their stored KV
injected into the paged cache ("inject"), and the time to first token of the two is compared.
The model's quality gate (`inferscale calibrate`, read from `memory_root`) then says what
`memory.mode: auto` serves for k facts: injection with a recovery policy, or the text; that
answer is printed with its policy and the reason.

jax and the engine are imported inside `run_demo`, so importing this module stays cheap.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.progress import track
from rich.table import Table

from inferscale.config import EngineSettings
from inferscale.default_model import default_cache_dir, default_memory_root

if TYPE_CHECKING:  # heavy imports, only for annotations
    from inferscale.common.storage.format import FactKV
    from inferscale.evaluation.datasets import QA, Sample
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import Answer

KERNELS = ("auto", "reference", "pallas")  # mirrors EngineConfig.kernels, without importing jax
ENGINES = ("vllm", "jax")  # the product (vLLM + the connector, `chat_demo`) or the JAX research engine
WARMUP_NEW_TOKENS = 2


def _default_checkpoint_dir() -> str:
    return str(default_cache_dir() / "orbax")


@dataclass(frozen=True)
class DemoConfig:
    model: str | None = None  # Hugging Face folder; None = the packaged SmolLM2-135M-Instruct
    questions: int = 5  # how many of the demo questions to answer
    max_new_tokens: int = 40
    kernels: str = "auto"  # "auto" = Pallas on GPU, jax.numpy reference on CPU
    checkpoint_dir: str | None = field(default_factory=_default_checkpoint_dir)  # None: no orbax cache
    k: int = 10  # facts retrieved per question
    memory_root: str = field(default_factory=default_memory_root)  # where the model's calibration lives
    engine: str = "vllm"  # ENGINES
    # the memory and the vLLM engine, as a server with these settings runs them (w: the context-window turns
    # each fact is encoded after; max_model_len: the engine's context); the JAX engine reads w
    settings: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self) -> None:
        _check_optional_str("model", self.model)
        if not isinstance(self.settings, EngineSettings):
            raise ValueError(f"settings must be an EngineSettings, got {type(self.settings).__name__}")
        _check_int("k", self.k, minimum=1)
        _check_optional_str("memory_root", self.memory_root)
        _check_int("questions", self.questions, minimum=1)
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        _check_optional_str("checkpoint_dir", self.checkpoint_dir)
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_optional_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")


@dataclass(frozen=True)
class QuestionResult:
    qa: "QA"
    joint: "Answer"
    inject: "Answer"
    facts: tuple[str, ...] = ()  # the retrieved fact ids, in prompt order
    served: "Answer | None" = None  # what memory.mode auto serves (joint, inject, or inject + a policy)
    decision: object = None  # the gate's Decision

    @property
    def ratio(self) -> float:
        """TTFT of joint prefill over TTFT of injection (how many times faster injection is)."""
        return self.joint.ttft_s / self.inject.ttft_s

    @property
    def identical(self) -> bool:
        return self.joint.token_ids == self.inject.token_ids


def run_demo(cfg: DemoConfig, console: Console) -> list[QuestionResult]:
    """Run the demo, printing to `console`; return the per-question results."""
    from inferscale.gate.calibration import Calibration, encoding_key
    from inferscale.evaluation.datasets import load_demo

    sample = load_demo()
    engine = load_engine(cfg, console)
    memory = encode_memory(engine, sample, cfg.settings.w, console)
    questions = select_questions(sample.questions, cfg.questions, console)
    picks = retrieve(memory, questions, cfg.k, console)
    # the calibration a server with the default settings follows (the JAX engine keeps no store)
    served = cfg.settings  # the JAX engine encodes each fact after its w turns
    calibration = Calibration.load(cfg.memory_root, engine.fingerprint,
                                   encoding_key("turns", served.w, kv_dtype=served.kv_dtype,
                                                encode_mode=served.encode_mode, dtype=served.dtype))
    console.print(f"Memory for each question: its top {min(cfg.k, len(memory))} of {len(memory)} facts. Quality "
                  f"gate: {'calibrated, ' + calibration.data if calibration else 'not calibrated (auto serves text)'}.")
    warm_up(engine, picks, questions, console)
    results = []
    for i, (qa, facts) in enumerate(zip(questions, picks), 1):
        results.append(answer_both(engine, facts, qa, cfg.max_new_tokens, calibration))
        print_result(console, i, len(questions), results[-1])
    console.print(summary_table(results))
    return results


def resolve_model_dir(model: str | None) -> Path:
    """A folder, a short name (`inferscale models list`) or None (the default model)."""
    from inferscale.models import MODELS, resolve_model

    return resolve_model(model if model is None or model in MODELS else Path(model).expanduser())


def load_engine(cfg: DemoConfig, console: Console) -> "Engine":
    with console.status("Loading the model..."):
        model_dir = resolve_model_dir(cfg.model)  # before importing jax: a bad path fails fast
        from inferscale.jax.engine import Engine
        from inferscale.jax.engine_config import EngineConfig

        t = time.perf_counter()
        config = EngineConfig(kernels=cfg.kernels, checkpoint_dir=cfg.checkpoint_dir)
        engine = Engine.from_pretrained(model_dir, config)
    console.print(f"Loaded [bold]{escape(str(model_dir))}[/] in {time.perf_counter() - t:.1f} s "
                  f"(kernels: {engine.kernels}, context: {engine.max_context} tokens)")
    return engine


def encode_memory(engine: "Engine", sample: "Sample", w: int, console: Console) -> list["FactKV"]:
    """Context-Window Encoding of every demo fact, with a progress bar."""
    conversation = sample.conversation
    progress = partial(track, description=f"Encoding facts (w={w})", console=console, transient=True)
    t = time.perf_counter()
    memory = engine.encode_facts(conversation.facts, conversation, w=w, progress=progress)
    elapsed = time.perf_counter() - t
    tokens = sum(f.num_tokens for f in memory)
    console.print(f"Encoded {len(memory)} facts ({tokens} tokens) with w={w} in {elapsed:.1f} s "
                  "(includes compilation)")
    return memory


def retrieve(memory: Sequence["FactKV"], questions: Sequence["QA"], k: int, console: Console) -> list[list["FactKV"]]:
    """Each question's top-k facts (exact cosine over all-MiniLM-L6-v2 embeddings), best first."""
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.retrieval.vector_index import ExactIndex

    with console.status("Embedding the facts and questions..."):
        embedder = MiniLMEmbedder()
        index = ExactIndex(embedder.dim)
        index.add(range(len(memory)), embedder.embed([f.text for f in memory]))
        _, idx = index.search(embedder.embed([q.question for q in questions]), min(k, len(memory)))
    return [[memory[int(i)] for i in row if i >= 0] for row in idx]


def select_questions(questions: Sequence["QA"], n: int, console: Console) -> list["QA"]:
    if n > len(questions):
        console.print(f"The demo has {len(questions)} questions; answering all of them.")
    return list(questions[:n])


def warm_up(engine: "Engine", picks: Sequence[Sequence["FactKV"]], questions: Sequence["QA"],
            console: Console) -> None:
    """Compile the jitted functions untimed, so the measured TTFTs exclude compilation.

    The engine compiles one prefill per padded prompt length, so one question is run (both modes)
    per distinct pair of padded lengths.
    """
    from inferscale.jax.encoder import bucket

    shapes: dict[tuple[int, int], tuple["QA", Sequence["FactKV"]]] = {}
    for qa, memory in zip(questions, picks):
        layout = engine.layout(qa.question, memory)
        n = len(layout)
        shapes.setdefault((bucket(n, 1), bucket(n - layout.num_injected, 1)), (qa, memory))
    t = time.perf_counter()
    with console.status("Warming up (compiling the prefill and decode steps)..."):
        for qa, memory in shapes.values():
            for mode in ("joint", "inject"):
                engine.answer(qa.question, memory, mode=mode, max_new_tokens=WARMUP_NEW_TOKENS)
    console.print(f"Warmed up in {time.perf_counter() - t:.1f} s (untimed)\n")


def answer_both(engine: "Engine", memory: Sequence["FactKV"], qa: "QA", max_new_tokens: int,
                calibration=None) -> QuestionResult:
    """Joint and plain injection, and what the gate serves (reusing either when it is one of them)."""
    from inferscale.gate.calibration import decide
    from inferscale.common.prompt.recovery import RecoveryPolicy

    joint = engine.answer(qa.question, memory, mode="joint", max_new_tokens=max_new_tokens)
    inject = engine.answer(qa.question, memory, mode="inject", max_new_tokens=max_new_tokens)
    d = decide(calibration, len(memory))
    if d.mode == "text":
        served = joint
    elif d.policy in (None, "none"):
        served = inject
    else:
        served = engine.answer(qa.question, memory, max_new_tokens=max_new_tokens,
                               policy=RecoveryPolicy.parse(d.policy))
    return QuestionResult(qa, joint, inject, tuple(f.fact_id for f in memory), served, d)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _one_line(text: str) -> str:
    """An answer on one line: line breaks shown as ⏎, so the printout stays aligned."""
    return " ⏎ ".join(line.strip() for line in text.splitlines() if line.strip())


def print_result(console: Console, i: int, n: int, r: QuestionResult) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("gold", escape(r.qa.answer))
    grid.add_row("joint", escape(_one_line(r.joint.text)))
    grid.add_row("inject", escape(_one_line(r.inject.text)))
    grid.add_row("TTFT", f"joint {_ms(r.joint.ttft_s)} | inject {_ms(r.inject.ttft_s)} | "
                         f"ratio joint/inject {r.ratio:.1f}x")
    grid.add_row("same", "identical answers (token for token)" if r.identical else "answers differ")
    if r.decision is not None:
        d = r.decision
        how = f"inject, policy {d.policy}" if d.mode == "inject" else "text"
        grid.add_row("auto", f"serves {how}, because {escape(d.reason)}")
        grid.add_row("", f"{escape(_one_line(r.served.text))} [TTFT {_ms(r.served.ttft_s)}]")
    console.print(f"[bold]Q{i}/{n}[/] {escape(r.qa.question)}")
    console.print(Padding(grid, (0, 0, 1, 2)))


def summary_table(results: Sequence[QuestionResult]) -> Table:
    def median(values) -> float:
        return statistics.median(list(values))

    table = Table(title=f"Summary over {len(results)} question{'' if len(results) == 1 else 's'}")
    table.add_column("")
    table.add_column("joint", justify="right")
    table.add_column("inject", justify="right")
    table.add_row("median TTFT", _ms(median(r.joint.ttft_s for r in results)),
                  _ms(median(r.inject.ttft_s for r in results)))
    table.add_row("median ratio joint/inject", "", f"{median(r.ratio for r in results):.1f}x")
    table.add_row("prompt tokens injected (median)", str(int(median(r.joint.num_injected for r in results))),
                  str(int(median(r.inject.num_injected for r in results))))
    table.add_row("prompt tokens prefilled (median)", str(int(median(r.joint.num_prefilled for r in results))),
                  str(int(median(r.inject.num_prefilled for r in results))))
    same = sum(r.identical for r in results)
    table.add_row("answers identical token for token", "", f"{same}/{len(results)}")
    served = [r for r in results if r.decision is not None]
    if served:
        kinds = sorted({f"inject {r.decision.policy}" if r.decision.mode == "inject" else "text" for r in served})
        table.add_row("memory.mode auto served", "", ", ".join(kinds))
    return table
