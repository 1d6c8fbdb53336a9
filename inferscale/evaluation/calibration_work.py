"""A calibration's work folder: what `inferscale calibrate --work-dir DIR` keeps between runs.

A calibration of a 1.5B model on CPU takes about an hour per conversation, so it is kept in
pieces a rerun picks up: the conversations' memory (ingested once), each question's answers
as soon as it is answered, and each conversation's measurements once it is done. A rerun with the
same settings measures only the conversations it lacks, and a conversation stopped part-way from
its first unanswered question; a rerun whose settings differ (k, policies, questions, encoding,
answer length, or the conversation's own text) measures that conversation again.

    DIR/model.json            the model fingerprint the folder belongs to (one model per folder)
    DIR/memory/               the calibration's memory root (a user per conversation, its text and encoding)
    DIR/measured/<conv>.json  {"settings": ..., "measured": [Measured, ...]}
    DIR/answers/<conv>.json   {"settings": ..., "answers": [row per question answered, ...]}
    DIR/ttft.json             {"settings": ..., "ttft": [[k, method, ms], ...]}

Plain Python: no model or array libraries.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from inferscale.gate.calibration import Measured


def memory_digest(conversation) -> str:
    """sha256 over what the memory holds of a conversation: its turns and facts."""
    body = {"turns": [[t.id, t.speaker, t.text, t.date] for t in conversation.turns],
            "facts": [[f.id, f.text, f.source_turn] for f in conversation.facts]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def conversation_digest(sample, questions) -> str:
    """sha256 over what a calibration reads of a conversation: its memory and the questions asked."""
    body = {"memory": memory_digest(sample.conversation),
            "questions": [[q.question, q.answer, q.category] for q in questions]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class CalibrationWork:
    def __init__(self, root: str | Path, fingerprint: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        owner = self.root / "model.json"
        if owner.exists():
            have = json.loads(owner.read_text())["model_fingerprint"]
            if have != fingerprint:
                raise ValueError(f"work_dir {str(self.root)!r} holds another model's calibration "
                                 f"({have[:12]}...); give each model its own work_dir")
        else:
            _write_json(owner, {"model_fingerprint": fingerprint})
        (self.root / "measured").mkdir(exist_ok=True)
        (self.root / "answers").mkdir(exist_ok=True)

    @property
    def memory_root(self) -> str:
        return str(self.root / "memory")

    def measured(self, conversation: str, settings: dict) -> list[Measured] | None:
        """The conversation's measurements under exactly these settings, or None."""
        saved = _read_json(self.root / "measured" / f"{conversation}.json")
        if saved is None or saved.get("settings") != settings:
            return None
        return [Measured(**m) for m in saved["measured"]]

    def save_measured(self, conversation: str, settings: dict, measured: list[Measured]) -> None:
        _write_json(self.root / "measured" / f"{conversation}.json",
                    {"settings": settings, "measured": [asdict(m) for m in measured]})

    def answers(self, conversation: str, settings: dict) -> list:
        """The rows of the questions of a conversation answered under exactly these settings
        (`calibrate.measure`'s rows, in question order; all of them once it is measured); [] if none."""
        saved = _read_json(self.root / "answers" / f"{conversation}.json")
        return saved["answers"] if saved is not None and saved.get("settings") == settings else []

    def save_answers(self, conversation: str, settings: dict, rows: list) -> None:
        _write_json(self.root / "answers" / f"{conversation}.json", {"settings": settings, "answers": rows})

    def ttft(self, settings: dict) -> dict[tuple[int, str], float] | None:
        saved = _read_json(self.root / "ttft.json")
        if saved is None or saved.get("settings") != settings:
            return None
        return {(k, method): ms for k, method, ms in saved["ttft"]}

    def save_ttft(self, settings: dict, ttft: dict[tuple[int, str], float]) -> None:
        _write_json(self.root / "ttft.json",
                    {"settings": settings, "ttft": [[k, method, ms] for (k, method), ms in sorted(ttft.items())]})


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, obj) -> None:
    """Write whole or not at all (a run stopped mid-write leaves the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
