"""`inferscale calibrate`: measure recovery policies against text and write the model's gate.

    inferscale calibrate --model qwen2.5-coder-1.5b --memory-root mem   # LoCoMo's first 3 + the assistant's 2
    inferscale calibrate --data demo --k 5 --policies none,last:2 --memory-root mem
    inferscale calibrate --quick --model DIR --memory-root mem                   # minutes: 12 questions, k=10
    inferscale calibrate --ship                                                   # the package's own, for a known model
    inferscale calibrate --ship --model qwen2.5-coder-1.5b --questions 60 --ttft-questions 3   # + TTFT per method
    inferscale calibrate --model DIR --conversation conv-26,conv-30,conv-41 --memory-root mem   # pooled over three
    inferscale calibrate --model DIR --kv-dtype float8_e4m3 --tolerance 0.03 --memory-root mem  # an fp8 store, 3 points
    inferscale calibrate --ship --model qwen2.5-coder-1.5b --work-dir runs/cal-qwen   # hours: rerun to resume

Held-in questions (the first `questions` of categories 1-4 of each conversation) are answered on
one vLLM engine with the same retrieved facts (retrieval order, as the server serves them) by every
method: the facts as text, and injection under each policy. The conversations come from `data`
(`modes.CALIBRATION_DATA`: LoCoMo's friends chatting, the packaged user-and-assistant
conversations, the demo, or LoCoMo-format files): by default the first three of each of LoCoMo and
the assistant conversations, so a gate is learned on two kinds of conversation.
Every answer is scored per question: gold-token recall (the correctness measure the gate decides
on; `qa_metrics.gold_recall`) and LoCoMo F1 (reported beside it), and kept with its text. The gate
(`inferscale.gate.calibration`) keeps per k the cheapest policy non-inferior to text within `tolerance`
(points of gold-token recall as a fraction, 0.05 = 5 points): the per-question gaps to text,
pooled over the conversations by a hierarchical paired bootstrap, have a one-sided 95% upper bound
at or below the tolerance at Holm's level among the policies tried, and no conversation is
significantly worse than it (`gate.noninferiority`). The run prints, per method, the pooled gap,
the upper bound, each conversation's gap, the decision and the reason, and writes
`calibration.json` into `memory_root`. The memory is encoded, kept and served as `kv_dtype`,
`encode_mode` and `dtype` say, and the file is keyed by them (`gate.encoding_key`): a server with
other settings does not follow it. The conversations are ingested into a temporary memory root, so
no calibration data mixes with users'; with `work_dir` that memory and each conversation's
measurements are kept there (`calibration_work`), so a calibration of hours can be stopped and
rerun, measuring only what it lacks (a conversation stopped part-way, from its first unanswered
question). The calibration file itself records the settings each
conversation was measured under, so a rerun with more conversations (or a later `--ship` of the
same model) measures only the new ones and reuses the rest (`--remeasure`: all again). A server
reads the file when it starts (`memory.mode: auto`).
`--ship` writes the file into the package instead
(`inferscale/gate/calibrations/`), where every memory root of that model finds it.
`ttft_questions` > 0 also times, in the same run and on the same engine, end-to-end time to the
first token of every method (one token; the methods interleaved per question, after one warm-up
round; medians), so each row of the printed table carries its quality and its speed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from inferscale.gate.calibration import (
    DEFAULT_TOLERANCE,
    FILE,
    Calibration,
    Measured,
    settings_key,
    shipped_file,
)
from inferscale.common.modes import CALIBRATION_DATA
from inferscale.config import EngineSettings
from inferscale.gate.noninferiority import PLANNING_SD, resolvable_delta
from inferscale.common.prompt.recovery import RecoveryPolicy, connector_policy, recompute_share
from inferscale.evaluation.calibration_tables import pooled, table, verdict_table


@dataclass(frozen=True)
class CalibrateConfig:
    memory_root: str  # where calibration.json goes (the served model's memory root)
    model: str | None = None  # a folder or a short name; None: the default model
    data: str | None = None  # comma-separated: CALIBRATION_DATA names or LoCoMo-format files (None: DEFAULT_DATA)
    conversations: tuple[str, ...] = ()  # sample ids (default: each source's first three); a policy must pass on each
    questions: int = 40
    k: tuple[int, ...] = (10, 50)
    # the most relevant facts next to the question, recomputed or not (docs/quality.md, "top:N")
    policies: tuple[str, ...] = ("none", "near:5", "top:2", "top:5", "heads:4", "heads:8")
    # how much worse than text a policy may be: points of gold-token recall (and J when judged) as a
    # fraction (0.05 = 5 points); non-inferiority is tested against it (`gate.calibration`)
    tolerance: float = DEFAULT_TOLERANCE
    # the memory and engine calibrated, as the server will run them: how facts are encoded (w, context,
    # encode_mode), kept (kv_dtype) and served (memory_boundary), the engine's dtype and context; the
    # calibration's key (`gate.calibration.encoding_key`) is made of them
    settings: EngineSettings = field(default_factory=EngineSettings)
    max_tokens: int = 32
    ship: bool = False  # write into the package's shipped calibrations instead of memory_root
    ttft_questions: int = 0  # > 0: also time each method's end-to-end TTFT on this many questions
    work_dir: str | None = None  # keep the calibration's memory and measurements here; a rerun resumes
    remeasure: bool = False  # measure every conversation again (default: reuse those kept under the same settings)

    QUICK = {"questions": 12, "k": (10,), "policies": ("none", "top:2")}  # `--quick`: minutes, not hours

    def __post_init__(self) -> None:
        if not self.memory_root and not self.ship:
            raise ValueError("memory_root must name the directory the calibration is written to (or ship it)")
        if self.questions < 1:
            raise ValueError(f"questions must be >= 1, got {self.questions}")
        if not self.k or min(self.k) < 1:
            raise ValueError(f"k must be positive integers, got {self.k}")
        if not self.policies:
            raise ValueError("name at least one policy")
        for p in self.policies:
            connector_policy(p)  # ValueError naming the policy
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.ttft_questions < 0:
            raise ValueError(f"ttft_questions must be >= 0, got {self.ttft_questions}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.settings, EngineSettings):
            raise ValueError(f"settings must be an EngineSettings, got {type(self.settings).__name__}")
        sources = data_sources(self.data)
        if not sources:
            raise ValueError("data must name at least one source")
        for src in sources:
            if src not in CALIBRATION_DATA and not Path(src).is_file():
                raise ValueError(f"data: {src!r} is neither one of {', '.join(CALIBRATION_DATA)} nor a file")


DEFAULT_DATA = "locomo,assistant"  # two kinds of conversation: friends chatting, a user and an assistant
DEFAULT_CONVERSATIONS = 3  # per source


def data_sources(data: str | None) -> list[str]:
    return [x.strip() for x in (DEFAULT_DATA if data is None else data).split(",") if x.strip()]


def load_samples(cfg: CalibrateConfig) -> list[tuple[str, object]]:
    """(source, `Sample`) of every conversation calibrated on: those named in `conversations`, else
    the first three of each source (a gate learned on one conversation does not transfer,
    docs/quality.md)."""
    from inferscale.evaluation.datasets import load_demo
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo

    files = {"locomo": DEFAULT_LOCOMO_PATH,
             "assistant": str(resources.files("inferscale.evaluation") / "data" / "assistant_conversations.json")}
    loaded = [(src, [load_demo()] if src == "demo" else load_locomo(files.get(src, src)))
              for src in data_sources(cfg.data)]
    if not cfg.conversations:
        return [(src, s) for src, samples in loaded for s in samples[:DEFAULT_CONVERSATIONS]]
    by: dict[str, tuple[str, object]] = {}
    for src, samples in loaded:
        for s in samples:
            if s.conversation.id in by:
                raise ValueError(f"conversation {s.conversation.id!r} is in both {by[s.conversation.id][0]} and {src}")
            by[s.conversation.id] = (src, s)
    missing = [c for c in cfg.conversations if c not in by]
    if missing:
        raise ValueError(f"no conversation {missing[0]!r} in {', '.join(data_sources(cfg.data))}; have {', '.join(by)}")
    return [by[c] for c in cfg.conversations]


def measure(llm, user: str, questions, ks, policies, max_tokens: int, log=print, data: str = "",
            answered=(), keep=None) -> list[Measured]:
    """Per-question gold-token recall and LoCoMo F1 of text and of injection under each policy,
    per k, on these questions of `user` (`data`: the conversation they come from). `answered`: the
    rows of the first questions, kept by an earlier run that stopped (answers are greedy, so a
    resumed run measures what an unbroken one does); `keep(rows)` is called with every row so far
    after each question."""
    methods = [("text", None)] + [("inject", str(RecoveryPolicy.parse(p))) for p in policies]
    rows = list(answered)
    if rows:
        log(f"  {len(rows)}/{len(questions)} questions answered already")
    for i, q in enumerate(questions[len(rows):], start=len(rows)):
        rows.append(_answer(llm, user, q, ks, methods, max_tokens))
        if keep is not None:
            keep(rows)
        log(f"  {i + 1}/{len(questions)} questions")
    return measured_from_rows(rows, ks, [p for _, p in methods[1:]], data)


def measured_from_rows(rows, ks, policies, data: str = "") -> list[Measured]:
    """`Measured` per k and policy from the rows of `_answer` (one per question, in order): the
    means of LoCoMo F1, the standard error of its paired gap, and every question's scores of
    text and of the policy (`Measured.scores`: "recall", "f1")."""
    out = []
    for k in ks:
        at = [row[str(k)] for row in rows]
        for p in policies:
            scores = {ms: [[a["text"][ms], a[p][ms]] for a in at] for ms in SCORED}
            gaps = [t - x for t, x in scores["f1"]]  # paired: the same question, facts and k
            stderr = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
            out.append(Measured(k, p, statistics.fmean(x for _, x in scores["f1"]),
                                statistics.fmean(t for t, _ in scores["f1"]),
                                statistics.fmean(a[p]["share"] for a in at), len(rows), stderr, data, scores))
    return out


SCORED = ("recall", "f1")  # what every answer is scored with (`_answer`), the gate's measure first


def _answer(llm, user: str, q, ks, methods, max_tokens: int) -> dict[str, dict[str, dict]]:
    """One question's row: per k (a string, as JSON keeps it) and method, its gold-token recall,
    LoCoMo F1, recomputed share (text recomputes everything: share 1) and the answer itself (kept,
    so it can be judged later)."""
    from inferscale.evaluation.qa_metrics import gold_recall, locomo_f1
    from inferscale.serving.memory_llm import MemoryRequest

    row: dict[str, dict[str, dict]] = {}
    for k in ks:
        ids = tuple(f.fact_id for f in llm.memory.search(user, q.question, k))
        reqs = [MemoryRequest(user, q.question, k=k, mode=m, fact_ids=ids, max_tokens=max_tokens, policy=p)
                for m, p in methods]
        for (m, p), out in zip(methods, llm.generate_many(reqs)):
            share = 1.0
            if p is not None:
                layout, _ = llm.composer.compose(user, q.question, list(ids), policy=p)
                share = recompute_share(layout, RecoveryPolicy.parse(p).mask(layout))
            row.setdefault(str(k), {})[p or "text"] = {
                "recall": gold_recall(out.text, q.answer, q.category), "f1": locomo_f1(out.text, q.answer, q.category),
                "share": share, "answer": out.text}
    return row


def time_to_first_token(llm, user: str, questions, ks, policies, log=print) -> dict[tuple[int, str], float]:
    """Median end-to-end TTFT in ms of text and of injection under each policy, per k: one token
    per request, one request at a time, every method once per question in turn (so a slow
    moment of a shared machine hits every method alike), after a warm-up round that is not kept."""
    from inferscale.serving.memory_llm import MemoryRequest

    methods = [("text", None)] + [("inject", str(RecoveryPolicy.parse(p))) for p in policies]
    times: dict[tuple[int, str], list[float]] = {}
    for i, q in enumerate([questions[0], *questions]):
        for k in ks:
            ids = tuple(f.fact_id for f in llm.memory.search(user, q.question, k))
            for m, p in methods:
                (out,) = llm.generate_many([MemoryRequest(user, q.question, k=k, mode=m, fact_ids=ids, max_tokens=1,
                                                          policy=p)])
                if i > 0:
                    times.setdefault((k, p or "text"), []).append(1000 * out.ttft_s)
        log(f"  TTFT {i}/{len(questions)} questions" + (" (warm-up)" if i == 0 else ""))
    return {key: statistics.median(v) for key, v in times.items()}


def calibrate(cfg: CalibrateConfig, log=print) -> Calibration:
    from inferscale.common.model.spec import ModelSpec, model_fingerprint
    from inferscale.evaluation.calibration_work import CalibrationWork, conversation_digest
    from inferscale.models import resolve_model

    started = time.monotonic()
    samples = load_samples(cfg)
    asked = {s.conversation.id: [q for q in s.questions if q.category in (1, 2, 3, 4)][: cfg.questions]
             for _, s in samples}
    empty = [c for c, qs in asked.items() if not qs]
    if empty:
        raise ValueError(f"conversation {empty[0]!r} has no questions of categories 1-4")
    model = str(resolve_model(cfg.model))
    spec = ModelSpec.from_pretrained(model)
    log(f"hashing {Path(model).name}'s weights (the calibration is keyed by them)")
    fingerprint = model_fingerprint(model, spec)
    work = CalibrationWork(cfg.work_dir, fingerprint) if cfg.work_dir else None
    e = cfg.settings
    encoding = settings_key(e)
    target = shipped_file(fingerprint, encoding) if cfg.ship else Path(cfg.memory_root) / FILE
    same = {"k": list(cfg.k), "policies": list(cfg.policies), "w": e.w, "context": e.context,
            "memory_boundary": e.memory_boundary, "kv_dtype": e.kv_dtype, "encode_mode": e.encode_mode,
            "dtype": e.dtype}
    settings = {s.conversation.id: dict(same, max_tokens=cfg.max_tokens, scores=list(SCORED),
                                        conversation=conversation_digest(s, asked[s.conversation.id]))
                for _, s in samples}
    first = samples[0][1].conversation.id  # TTFT: on the first conversation (speed does not depend on it)
    ttft_settings = dict(same, questions=cfg.ttft_questions, conversation=settings[first]["conversation"])
    # the file this run replaces (not read with --remeasure, which writes it whatever it holds)
    before = None if cfg.remeasure else Calibration.load(target.parent, fingerprint, encoding, path=target)
    measured_of = {} if cfg.remeasure else _kept(work, before, target, settings, log)
    ttft: dict[tuple[int, str], float] = {}
    if work is not None and cfg.ttft_questions and not cfg.remeasure:
        ttft = work.ttft(ttft_settings) or {}
    timing = ttft_settings if cfg.ttft_questions and not ttft else None  # TTFT still to measure
    if timing is not None or len(measured_of) < len(asked):
        timed = _run(cfg, model, spec, samples, asked, work, measured_of, settings, timing, log)
        ttft = timed if timed is not None else ttft
    measured = [m for _, s in samples for m in measured_of[s.conversation.id]]
    source = {s.conversation.id: src for src, s in samples}
    data = ", ".join(f"{source[c]}:{c}:{len(qs)} questions" for c, qs in asked.items())
    cal = Calibration.from_measurements(fingerprint, measured, cfg.tolerance, data=data, encoding=encoding,
                                        settings=settings)
    if before is not None and before.content() == cal.content():  # nothing new: the file keeps its time
        done = f"kept {target} as it was (nothing new measured or decided)"
    else:
        done = f"wrote {cal.save(cfg.memory_root, target)}"
    for m in measured:
        recall = pooled([m], "recall", False)
        text_recall = pooled([m], "recall", True)
        log(f"{m.data} k={m.k:<3} {m.policy:<8} gold recall {recall:.3f} vs text {text_recall:.3f}, LoCoMo F1 "
            f"{m.f1:.3f} vs text {m.text_f1:.3f} over {m.n} questions, recomputes {100 * m.recompute_share:.0f}%"
            if recall is not None and text_recall is not None else
            f"{m.data} k={m.k:<3} {m.policy:<8} LoCoMo F1 {m.f1:.3f} vs text {m.text_f1:.3f} over {m.n} questions "
            "(no per-question scores)")
    log(table(cal, ttft))
    log(f"non-inferiority within {100 * cfg.tolerance:g} points of text (pooled gap and its one-sided 95% upper "
        f"bound at Holm's level over the policies tried at each k; gaps in points, positive: below text):")
    log(verdict_table(cal))
    for k, p in sorted(cal.choices.items()):
        log(f"k <= {k}: {'inject with ' + p if p else 'text'}: {cal.reasons[k]}")
    log(f"{done} in {time.monotonic() - started:,.0f} s (a server reads it when it starts; memory.mode auto)")
    questions = sum(len(qs) for qs in asked.values())
    resolved = resolvable_delta(max(1, questions // len(asked)), len(asked), PLANNING_SD, len(cfg.policies))
    if resolved > cfg.tolerance:
        log(f"{questions} questions resolve a tolerance of about {100 * resolved:.1f} points (an equivalent policy "
            f"passes 90% of the time, per-question SD {100 * PLANNING_SD:.0f} points, Holm over {len(cfg.policies)}), "
            f"more than the {100 * cfg.tolerance:g} asked: ask more questions (docs/quality.md)")
    return cal


def _kept(work, before: Calibration | None, target: Path, settings: dict, log) -> dict[str, list[Measured]]:
    """The conversations already measured under exactly these settings, by id: from the work folder,
    else from `before`, the calibration file `target` this run writes (so a calibration is extended
    by rerunning it with more conversations, and a shipped one by a later `--ship`)."""
    kept: dict[str, list[Measured]] = {}
    for c, wanted in settings.items():
        if work is not None and (m := work.measured(c, wanted)) is not None:
            kept[c], where = m, str(work.root)
        elif before is not None and (m := before.kept(c, wanted)) is not None:
            kept[c], where = m, str(target)
        else:
            continue
        log(f"{c}: measured already in {where} (same settings), not measured again")
    return kept


def _run(cfg, model, spec, samples, asked, work, measured_of, settings, timing, log):
    """Start the engine, ingest and measure the conversations not in `measured_of` (filling it and,
    with a work folder, saving each as it is done) and, if `timing` (TTFT's settings) is given,
    time TTFT on the first conversation; the TTFT, or None."""
    ttft = None
    from inferscale.evaluation.calibration_work import memory_digest
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    e = cfg.settings
    max_len = min(e.max_model_len, spec.max_position)
    with nullcontext(work.memory_root) if work else tempfile.TemporaryDirectory(prefix="inferscale-calibrate-") as root:
        llm = MemoryLLM(MemoryLLMConfig(**{**e.engine_settings(), "max_model_len": max_len,
                                           "enable_prefix_caching": False}, model=model, memory_root=root),
                        embedder=MiniLMEmbedder())
        try:
            for i, (_, s) in enumerate(samples):
                conv, questions = s.conversation, asked[s.conversation.id]
                timed = timing is not None and i == 0
                if conv.id in measured_of and not timed:
                    continue
                # a user per conversation text and encoding: a kept memory is reused only as it was encoded
                # and kept (bfloat16 stores encoded in one pass are named as before those were named)
                stored = "" if (e.kv_dtype, e.encode_mode) == ("bfloat16", "one-pass") else \
                    f"-{e.kv_dtype}-{e.encode_mode}"
                user = f"cal-{conv.id}-{memory_digest(conv)[:12]}-{e.context}-w{e.w}{stored}"
                began = time.monotonic()
                log(f"calibrating {Path(model).name} on {conv.id}: {len(conv.turns)} turns, {len(conv.facts)} facts, "
                    f"{len(questions)} questions, k={','.join(map(str, cfg.k))}, policies={','.join(cfg.policies)}")
                _ingest(llm, user, conv, log)
                if conv.id not in measured_of:
                    answered = work.answers(conv.id, settings[conv.id]) if work and not cfg.remeasure else []
                    keep = (lambda rows, c=conv.id: work.save_answers(c, settings[c], rows)) if work else None
                    measured_of[conv.id] = measure(llm, user, questions, cfg.k, cfg.policies, cfg.max_tokens, log,
                                                   conv.id, answered=answered, keep=keep)
                    if work is not None:
                        work.save_measured(conv.id, settings[conv.id], measured_of[conv.id])
                    log(f"{conv.id}: ingested and measured in {time.monotonic() - began:,.0f} s")
                if timed:
                    ttft = time_to_first_token(llm, user, questions[: cfg.ttft_questions], cfg.k, cfg.policies, log)
                    if work is not None:
                        work.save_ttft(timing, ttft)
            return ttft
        finally:
            llm.close()


def _ingest(llm, user: str, conv, log) -> None:
    """The conversation in `user`'s memory: kept from an earlier run if all its facts are there."""
    if user in llm.memory.users():
        if len(llm.memory.list(user)) == len(conv.facts):
            log(f"  {len(conv.facts)} facts in memory already")
            return
        llm.memory.delete_user(user)  # an ingest stopped part-way: start it again
    llm.memory.add(user, turns=conv.turns, facts=conv.facts,
                   progress=lambda done, n: log(f"  {done}/{n} facts encoded"))
