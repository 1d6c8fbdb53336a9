"""The quality gate: which recovery policy a model may serve injected memory with, per range of k.

Injected memory is approximate. `inferscale calibrate` measures, for a model, the answer quality of
plain injection and of each recovery policy against the same facts prefilled as text, on held-in
questions, and keeps per measured k the **cheapest** policy (the smallest share of memory tokens
recomputed) whose LoCoMo F1 is at most `tolerance` below text's; none passing means "serve text".
Measured on several conversations, a policy passes only if it passes on **every** one of them
(the worst case, not the mean): a gap measured on one conversation does not carry to the others.
The result is a `Calibration`, saved as `calibration.json` next to the model's memory (the memory
root) and keyed by the model's fingerprint and how the memory is encoded. The models the project
knows ship theirs with the package (`inferscale/common/calibrations/`, written by `inferscale
calibrate --ship`). `memory.mode: "auto"` asks the memory root's own first, then the shipped one,
then serves text:

    cal = Calibration.find(root, fingerprint, encoding_key("turns", 5))  # None: none for this model
    decision = decide(cal, k)                    # Decision(mode="inject", policy="last:2", reason=...)

A k up to the smallest measured k uses that k's choice; a k between two measured values uses the
choice of the next larger one (more facts are never easier); a k beyond the largest measured value
is not calibrated and is served as text. Plain Python and JSON; no engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inferscale.common.recovery import connector_policy
from inferscale.common.storage.atomic import atomic_write_bytes

FILE = "calibration.json"
VERSION = 1
SHIPPED = Path(__file__).with_name("calibrations")  # the known models' calibrations, in the package


def shipped_file(fingerprint: str, encoding: str) -> Path:
    """Where the package keeps a model's calibration for memory encoded `encoding`."""
    return SHIPPED / f"{fingerprint[:24]}-{encoding.replace(':', '-')}.json"


@dataclass(frozen=True)
class Decision:
    mode: str  # "inject" | "text"
    policy: str | None  # the recovery policy when mode == "inject"
    reason: str


@dataclass(frozen=True)
class Measured:
    """One (k, policy) measurement against text at the same k."""

    k: int
    policy: str
    f1: float
    text_f1: float
    recompute_share: float
    n: int
    gap_stderr: float = 0.0  # standard error of the per-question gap (paired with text), as a fraction
    data: str = ""  # the conversation it was measured on ("": not recorded)

    @property
    def gap(self) -> float:
        return self.text_f1 - self.f1


def worst_cases(measured: list[Measured]) -> list[Measured]:
    """Per (k, policy), its measurement on the conversation where it lost the most to text (its
    recompute share the largest seen)."""
    out: dict[tuple[int, str], Measured] = {}
    for m in measured:
        have = out.get((m.k, m.policy))
        if have is None or m.gap > have.gap:
            share = max(m.recompute_share, have.recompute_share) if have else m.recompute_share
            out[(m.k, m.policy)] = Measured(m.k, m.policy, m.f1, m.text_f1, share, m.n, m.gap_stderr, m.data)
    return list(out.values())


def encoding_key(context: str, w: int, boundary: bool = False) -> str:
    """How the calibrated memory was encoded and laid out ("turns:5": after 5 turns; "turns:5:boundary":
    served with the memory's boundary, `layout.BOUNDARY`); a calibration applies only to memory
    encoded and laid out the same way."""
    return f"{context}:{w}" + (":boundary" if boundary else "")


@dataclass
class Calibration:
    model_fingerprint: str
    tolerance: float  # LoCoMo F1 (as a fraction: 0.005 = half a point x100) a policy may lose to text
    choices: dict[int, str | None]  # measured k -> cheapest passing policy (None: text)
    measured: list[Measured] = field(default_factory=list)
    data: str = ""  # what it was measured on
    created: float = field(default_factory=time.time)
    encoding: str = ""  # encoding_key() of the memory it was measured with ("": not recorded)
    source: str = "memory root"  # where it was read from: "memory root" or "shipped"
    # conversation -> the settings it was measured under (`inferscale calibrate`'s, with a digest of
    # the conversation and its questions): a later calibration reuses a conversation whose settings match
    settings: dict[str, dict] = field(default_factory=dict)

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

    @classmethod
    def from_measurements(cls, fingerprint: str, measured: list[Measured], tolerance: float,
                          data: str = "", encoding: str = "", settings: dict[str, dict] | None = None
                          ) -> "Calibration":
        """Per k, the cheapest policy within `tolerance` of text on every conversation measured."""
        choices: dict[int, str | None] = {}
        for k in sorted({m.k for m in measured}):
            worst = worst_cases([m for m in measured if m.k == k])
            passing = [m for m in worst if m.gap <= tolerance]
            best = min(passing, key=lambda m: (m.recompute_share, m.policy), default=None)
            choices[k] = best.policy if best else None
        return cls(fingerprint, tolerance, choices, list(measured), data, encoding=encoding,
                   settings=dict(settings or {}))

    # -- files -----------------------------------------------------------------------------------
    def content(self) -> dict:
        """What the file says, apart from when it was written (two calibrations that measured and
        decided the same have the same content)."""
        return {"version": VERSION, "model_fingerprint": self.model_fingerprint, "tolerance": self.tolerance,
                "choices": {str(k): p for k, p in sorted(self.choices.items())},
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
        with the package for this model and encoding, else None (serve text)."""
        own = cls.load(root, fingerprint, encoding)
        if own is not None:
            return own
        return cls.load(root, fingerprint, encoding, path=shipped_file(fingerprint, encoding), source="shipped")

    @classmethod
    def load(cls, root: str | Path, fingerprint: str, encoding: str | None = None, *, path: str | Path | None = None,
             source: str = "memory root") -> "Calibration | None":
        """The calibration of this model under `root` (or in the file `path`); None if there is none,
        it is another model's, or (given `encoding`) it was measured on memory encoded otherwise."""
        path = Path(path) if path is not None else Path(root) / FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r}, expected {VERSION}")
            if raw["model_fingerprint"] != fingerprint:
                return None
            if encoding is not None and raw.get("encoding", "") != encoding:
                return None
            return cls(raw["model_fingerprint"], float(raw["tolerance"]),
                       {int(k): p for k, p in raw["choices"].items()},
                       [Measured(**m) for m in raw.get("measured", [])], raw.get("data", ""),
                       float(raw.get("created", 0.0)), raw.get("encoding", ""), source,
                       dict(raw.get("settings", {})))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"calibration file {path} is unreadable: {e}") from None


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
    if policy is None:
        return Decision("text", None,
                        f"no recovery policy came within {calibration.tolerance:g} F1 of text at k={at} ({where})")
    return Decision("inject", policy,
                    f"calibrated at k={at}: {policy} within {calibration.tolerance:g} F1 of text ({where})")
