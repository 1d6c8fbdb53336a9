"""The quality gate: which recovery policy a model may serve injected memory with, per range of k.

Injected memory is approximate. `inferscale calibrate` answers held-in questions with the facts
as text and injected under each recovery policy, on several conversations, and keeps each
question's scores. A policy at a k is **kept only if it is non-inferior to text** within the
operator's tolerance delta (`--tolerance`, points of the correctness measures as a fraction:
0.05 = 5 points), tested by `gate.noninferiority` on the per-question paired gaps (text's score
minus the policy's):

- the gap pooled over the conversations by a hierarchical paired bootstrap (conversations, then
  questions within each; seeded) has its one-sided 95% upper bound at or below delta, at the
  level Holm's step-down gives it among the policies tried at that k (so trying six policies does
  not make a bad one likelier to pass);
- no single conversation is significantly worse than delta (its own one-sided 95% lower bound is
  not above delta);
- on every **correctness** measure the calibration recorded for every question: gold-token recall
  (`evaluation.qa_metrics.gold_recall`: wording does not count, the gold answer's words do) and
  J, a judge's verdict, when a judge scored them. LoCoMo F1 is reported beside them, never decided on.

Per k the **cheapest** passing policy (the smallest share of memory tokens recomputed) is kept;
none passing means "serve text". The result is a `Calibration`, saved as `calibration.json` next
to the model's memory (the memory root) and keyed by the model's fingerprint and how the memory
is encoded and served (`encoding_key`: context, w, boundary, store dtype, encode mode, engine
dtype). The models the project knows ship theirs with the package (`inferscale/gate/calibrations/`,
written by `inferscale calibrate --ship`). `memory.mode: "auto"` asks the memory root's own first,
then the shipped one, then serves text:

    key = encoding_key("turns", 5, kv_dtype="bfloat16", encode_mode="one-pass", dtype="float32")
    cal = Calibration.find(root, fingerprint, key)  # None: none for this model and encoding
    decision = decide(cal, k)                    # Decision(mode="inject", policy="last:2", reason=...)

A k up to the smallest measured k uses that k's choice; a k between two measured values uses the
choice of the next larger one (more facts are never easier); a k beyond the largest measured value
is not calibrated and is served as text.

Files of version 1 (written before the gate tested non-inferiority) keep only each conversation's
mean F1, so no test can run on them: they still load, and every k is served as text, the reason
saying why. Their key lacks the store dtype, encode mode and engine dtype: it is read as the
settings `inferscale calibrate` measured every such file with (`LEGACY_ENCODING`: bfloat16 stores,
one-pass encoding, a float32 engine), so it applies to no other. Plain Python, JSON and numpy; no engine.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inferscale.gate import noninferiority as ni
from inferscale.common.prompt.recovery import connector_policy
from inferscale.common.storage.atomic import atomic_write_bytes

FILE = "calibration.json"
VERSION = 2  # 2: per-question scores, decided by the non-inferiority test; 1: mean F1 per conversation
SHIPPED = Path(__file__).with_name("calibrations")  # the known models' calibrations, in the package

# The correctness measures a gate decides on (per question, in [0, 1]), and the one it reports beside
MEASURES = {"recall": "gold-token recall", "judge": "J (judge)"}
REPORTED = {"f1": "LoCoMo F1"}
DEFAULT_TOLERANCE = 0.05  # points of the correctness measures, as a fraction (0.05 = 5 points)
# What a key written before the store dtype, encode mode and engine dtype were recorded means: the
# settings every such file was measured with (`inferscale calibrate`'s MemoryLLMConfig defaults
# then; the shipped files of 2026-12-06/07 among them)
LEGACY_ENCODING = {"kv_dtype": "bfloat16", "encode_mode": "one-pass", "dtype": "float32"}


def encoding_key(context: str, w: int, boundary: bool = False, *, kv_dtype: str, encode_mode: str,
                 dtype: str) -> str:
    """How the calibrated memory was encoded, kept and served ("turns:5:store=bfloat16:encode=one-pass:
    engine=float32": after 5 turns, bfloat16 stores, one-pass encoding, a float32 engine;
    ":boundary" after the w when served with the memory's boundary, `layout.BOUNDARY`): a
    calibration applies only to memory encoded, kept and served the same way (an fp8 store never
    follows a bf16 calibration)."""
    return (f"{context}:{w}" + (":boundary" if boundary else "")
            + f":store={kv_dtype}:encode={encode_mode}:engine={dtype}")


def settings_key(settings) -> str:
    """`encoding_key` of an `EngineSettings` (or any config that extends it): how memory served with
    these settings is encoded, kept and served."""
    return encoding_key(settings.context, settings.w, settings.memory_boundary, kv_dtype=settings.kv_dtype,
                        encode_mode=settings.encode_mode, dtype=settings.dtype)


_LEGACY_SUFFIX = ":store={kv_dtype}:encode={encode_mode}:engine={dtype}".format(**LEGACY_ENCODING)


def complete_key(key: str) -> str:
    """`key` with the store dtype, encode mode and engine dtype: a key written before they were
    recorded ("turns:5") gets `LEGACY_ENCODING`'s."""
    return key if ":store=" in key else key + _LEGACY_SUFFIX


def legacy_key(key: str) -> str | None:
    """The key a file written before the store dtype, encode mode and engine dtype were recorded
    carries for memory encoded `key`; None unless `key` names `LEGACY_ENCODING`'s."""
    return key[: -len(_LEGACY_SUFFIX)] if key.endswith(_LEGACY_SUFFIX) else None


def shipped_file(fingerprint: str, encoding: str) -> Path:
    """Where the package keeps a model's calibration for memory encoded `encoding`."""
    return SHIPPED / f"{fingerprint[:24]}-{re.sub('[:=]', '-', encoding)}.json"


@dataclass(frozen=True)
class Decision:
    mode: str  # "inject" | "text"
    policy: str | None  # the recovery policy when mode == "inject"
    reason: str


@dataclass(frozen=True)
class Measured:
    """One (k, policy) measurement against text at the same k, on one conversation."""

    k: int
    policy: str
    f1: float
    text_f1: float
    recompute_share: float
    n: int
    gap_stderr: float = 0.0  # standard error of the per-question F1 gap (paired with text), as a fraction
    data: str = ""  # the conversation it was measured on ("": not recorded)
    # per question, in question order: measure ("recall", "judge", "f1") -> [text's score, the policy's]
    scores: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """The mean LoCoMo F1 gap (reported, not decided on)."""
        return self.text_f1 - self.f1

    def gaps(self, measure: str) -> list[float]:
        """Per question, text's score minus the policy's on `measure`."""
        return [t - x for t, x in self.scores[measure]]


@dataclass(frozen=True)
class MethodVerdict:
    """What the gate found for one policy at one k."""

    k: int
    policy: str
    recompute_share: float
    passed: bool
    reason: str
    tests: dict[str, ni.Verdict] = field(default_factory=dict)  # per correctness measure decided on
    reported: dict[str, ni.Verdict] = field(default_factory=dict)  # F1, beside them


def decision_measures(measured: list[Measured]) -> tuple[str, ...]:
    """The correctness measures every measurement has per-question scores of (recall always once
    recorded; J when a judge scored every question), in `MEASURES`' order."""
    return tuple(m for m in MEASURES if measured and all(
        len(x.scores.get(m, ())) == x.n and x.n > 0 for x in measured))


def _points(x: float) -> str:
    return f"{100 * x:g}"


@dataclass
class Calibration:
    model_fingerprint: str
    # how much worse than text a policy may be, in points of the correctness measures (`measures`) as
    # a fraction: 0.05 = 5 points (version-1 files: LoCoMo F1, under their own rule)
    tolerance: float
    choices: dict[int, str | None]  # measured k -> cheapest passing policy (None: text)
    measured: list[Measured] = field(default_factory=list)
    data: str = ""  # what it was measured on
    created: float = field(default_factory=time.time)
    encoding: str = ""  # encoding_key() of the memory it was measured with ("": not recorded)
    source: str = "memory root"  # where it was read from: "memory root" or "shipped"
    # conversation -> the settings it was measured under (`inferscale calibrate`'s, with a digest of
    # the conversation and its questions): a later calibration reuses a conversation whose settings match
    settings: dict[str, dict] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)  # measured k -> why its choice
    measures: tuple[str, ...] = ()  # the correctness measures decided on (() : none could be)
    alpha: float = ni.ALPHA
    resamples: int = ni.RESAMPLES
    seed: int = 0
    version: int = VERSION  # of the file it was read from
    # per (k, policy): the test's outcome (computed by `from_measurements`; not kept in the file)
    verdicts: dict[tuple[int, str], MethodVerdict] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        for k, p in self.choices.items():
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"calibrated k must be a positive integer, got {k!r}")
            if p is not None:
                try:
                    connector_policy(p)
                except ValueError:
                    raise ValueError(f"calibrated policy {p!r} at k={k} cannot be served by vLLM") from None
        unknown = set(self.measures) - set(MEASURES)
        if unknown:
            raise ValueError(f"measures must be among {', '.join(MEASURES)}, got {sorted(unknown)}")

    @classmethod
    def from_measurements(cls, fingerprint: str, measured: list[Measured], tolerance: float,
                          data: str = "", encoding: str = "", settings: dict[str, dict] | None = None,
                          alpha: float = ni.ALPHA, resamples: int = ni.RESAMPLES, seed: int = 0) -> "Calibration":
        """Per k, the cheapest policy non-inferior to text within `tolerance` (module docstring)."""
        measures = decision_measures(measured)
        choices: dict[int, str | None] = {}
        reasons: dict[int, str] = {}
        verdicts: dict[tuple[int, str], MethodVerdict] = {}
        for k in sorted({m.k for m in measured}):
            found = _decide_k(k, [m for m in measured if m.k == k], measures, tolerance, alpha, resamples, seed)
            verdicts.update({(k, v.policy): v for v in found})
            choices[k], reasons[k] = _choose(k, found, measures, tolerance, len(found))
        return cls(fingerprint, tolerance, choices, list(measured), data, encoding=encoding,
                   settings=dict(settings or {}), reasons=reasons, measures=measures, alpha=alpha,
                   resamples=resamples, seed=seed, verdicts=verdicts)

    def at_tolerance(self, tolerance: float) -> "Calibration":
        """The same measurements decided within another `tolerance` (the operator's, e.g. `serve
        --tolerance`): the answers it kept are tested again, nothing is measured. A version-1 file,
        which kept no per-question scores, is returned as it is (it serves text)."""
        if self.version != VERSION or tolerance == self.tolerance:
            return self
        cal = Calibration.from_measurements(self.model_fingerprint, self.measured, tolerance, self.data, self.encoding,
                                            self.settings, self.alpha, self.resamples, self.seed)
        cal.created, cal.source = self.created, self.source
        return cal

    # -- files -----------------------------------------------------------------------------------
    def content(self) -> dict:
        """What the file says, apart from when it was written (two calibrations that measured and
        decided the same have the same content)."""
        return {"version": VERSION, "model_fingerprint": self.model_fingerprint, "tolerance": self.tolerance,
                "measures": list(self.measures), "alpha": self.alpha, "resamples": self.resamples,
                "seed": self.seed, "choices": {str(k): p for k, p in sorted(self.choices.items())},
                "reasons": {str(k): r for k, r in sorted(self.reasons.items())},
                "measured": [asdict(m) for m in self.measured], "data": self.data,
                "encoding": self.encoding, "settings": self.settings}

    def save(self, root: str | Path, path: str | Path | None = None) -> Path:
        """Write it as `root/calibration.json` (or to `path`), atomically."""
        path = Path(path) if path is not None else Path(root) / FILE
        atomic_write_bytes(path, json.dumps({**self.content(), "created": self.created}, indent=1).encode())
        return path

    def kept(self, conversation: str, settings: dict) -> list[Measured] | None:
        """The measurements of `conversation` if it was measured under exactly `settings`, else None."""
        if self.settings.get(conversation) != settings:
            return None
        return [m for m in self.measured if m.data == conversation] or None

    @classmethod
    def find(cls, root: str | Path, fingerprint: str, encoding: str) -> "Calibration | None":
        """The calibration `memory.mode: auto` follows: the memory root's own, else the one shipped
        with the package for this model and encoding (under its key, or a file written before the
        key named the store dtype, encode mode and engine dtype when `encoding` names the ones such
        files were measured with), else None (serve text)."""
        own = cls.load(root, fingerprint, encoding)
        if own is not None:
            return own
        for key in (encoding, legacy_key(encoding)):
            if key is not None:
                got = cls.load(root, fingerprint, encoding, path=shipped_file(fingerprint, key), source="shipped")
                if got is not None:
                    return got
        return None

    @classmethod
    def load(cls, root: str | Path, fingerprint: str, encoding: str | None = None, *, path: str | Path | None = None,
             source: str = "memory root") -> "Calibration | None":
        """The calibration of this model under `root` (or in the file `path`); None if there is none,
        it is another model's, or (given `encoding`) it was measured on memory encoded otherwise
        (a key without the store dtype, encode mode and engine dtype is read as `LEGACY_ENCODING`'s)."""
        path = Path(path) if path is not None else Path(root) / FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            version = raw.get("version")
            if version not in (1, VERSION):
                raise ValueError(f"version {version!r}, expected {VERSION} (or 1)")
            if raw["model_fingerprint"] != fingerprint:
                return None
            if encoding is not None and complete_key(raw.get("encoding", "")) != complete_key(encoding):
                return None
            measured = [Measured(**m) for m in raw.get("measured", [])]
            cal = cls(raw["model_fingerprint"], float(raw["tolerance"]),
                      {int(k): p for k, p in raw["choices"].items()}, measured, raw.get("data", ""),
                      float(raw.get("created", 0.0)), raw.get("encoding", ""), source,
                      dict(raw.get("settings", {})), {int(k): r for k, r in raw.get("reasons", {}).items()},
                      tuple(raw.get("measures", ())), float(raw.get("alpha", ni.ALPHA)),
                      int(raw.get("resamples", ni.RESAMPLES)), int(raw.get("seed", 0)), version)
            return cal if version == VERSION else _legacy(cal)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"calibration file {path} is unreadable: {e}") from None


def _decide_k(k: int, here: list[Measured], measures: tuple[str, ...], tolerance: float, alpha: float,
              resamples: int, seed: int) -> list[MethodVerdict]:
    """Every policy measured at k, tested together (Holm over them) on each measure."""
    by: dict[str, list[Measured]] = {}
    for m in here:
        by.setdefault(m.policy, []).append(m)
    share = {p: max(m.recompute_share for m in ms) for p, ms in by.items()}
    if not measures:
        why = ("no per-question scores of a correctness measure (gold-token recall or J) were kept, "
               "so non-inferiority cannot be tested")
        return [MethodVerdict(k, p, share[p], False, why) for p in by]

    def gaps(measure: str) -> dict[str, dict[str, list[float]]]:
        return {p: {m.data or f"#{i}": m.gaps(measure) for i, m in enumerate(ms)} for p, ms in by.items()}

    tests = {ms: ni.noninferior(gaps(ms), tolerance, alpha, resamples, ni.seed_of(seed, k, ms)) for ms in measures}
    f1 = {}
    if all(len(m.scores.get("f1", ())) == m.n and m.n > 0 for m in here):
        f1 = ni.noninferior(gaps("f1"), tolerance, alpha, resamples, ni.seed_of(seed, k, "f1"))
    out = []
    for p in by:
        failed = [ms for ms in measures if not tests[ms][p].passed]
        why = "; ".join(f"{MEASURES[ms]}: {tests[ms][p].reason}" for ms in (failed or measures))
        out.append(MethodVerdict(k, p, share[p], not failed, why, {ms: tests[ms][p] for ms in measures},
                                 {"f1": f1[p]} if f1 else {}))
    return out


def _choose(k: int, found: list[MethodVerdict], measures: tuple[str, ...], tolerance: float, tried: int
            ) -> tuple[str | None, str]:
    """(the cheapest passing policy or None, why)."""
    names = " and ".join(MEASURES[m] for m in measures)
    within = f"within {_points(tolerance)} points of text in {names}"
    passing = [v for v in found if v.passed]
    best = min(passing, key=lambda v: (v.recompute_share, v.policy), default=None)
    if best is not None:
        return best.policy, (f"calibrated at k={k}: {best.policy} is non-inferior to text {within} "
                             f"(the cheapest of {len(passing)} passing of {tried} tried; {best.reason})")
    if not measures:
        return None, f"at k={k}: {found[0].reason}; text is served"
    closest = min(found, key=lambda v: max(t.bound for t in v.tests.values()))
    return None, (f"no recovery policy came {within} at k={k} (Holm over {tried}; closest {closest.policy}: "
                  f"{closest.reason})")


def _legacy(cal: Calibration) -> Calibration:
    """A version-1 file: its choices came from a rule on mean F1 that controls no error rate and it
    kept no per-question scores, so every k is served as text, and the reason says so."""
    why = ("this calibration is of version 1: it kept only each conversation's mean LoCoMo F1 (tolerance "
           f"{_points(cal.tolerance)} F1 points, on point estimates), no per-question scores of a correctness "
           "measure, so non-inferiority to text cannot be tested; text is served (rerun `inferscale calibrate`)")
    cal.choices = {k: None for k in cal.choices}
    cal.reasons = {k: f"at k={k}: {why}" for k in cal.choices}
    cal.measures = ()
    return cal


def decide(calibration: Calibration | None, k: int) -> Decision:
    """What `memory.mode: "auto"` serves for k facts."""
    if calibration is None:
        return Decision("text", None, "the model is not calibrated (run `inferscale calibrate`)")
    where = f"{calibration.source} calibration"
    ks = sorted(calibration.choices)
    at = next((m for m in ks if m >= k), None)
    if at is None:
        return Decision("text", None, f"k={k} is beyond the calibrated k (up to {ks[-1]}; {where})")
    policy = calibration.choices[at]
    why = calibration.reasons.get(at)
    if policy is None:
        return Decision("text", None, f"{why or f'no recovery policy passed at k={at}'} ({where})")
    return Decision("inject", policy, f"{why or f'calibrated at k={at}: {policy}'} ({where})")
