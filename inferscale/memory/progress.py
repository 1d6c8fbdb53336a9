"""Progress of a long add: the encoder's rows turned into facts, reported every few seconds.

    beat = Heartbeat(lambda frac: progress(done + int(frac * len(batch)), total), every_s=3.0)
    encoder.encode_windowed(facts, windows, w, progress=beat)    # where `reports_progress(encode)`
"""

from __future__ import annotations

import inspect
import time
from typing import Callable


def reports_progress(encode: Callable) -> bool:
    try:
        return "progress" in inspect.signature(encode).parameters
    except (TypeError, ValueError):
        return False


class Heartbeat:
    """A `progress(done, total)` for the encoder that calls `report(done / total)` at most every
    `every_s` seconds (never for the last row: the batch's commit reports that)."""

    def __init__(self, report: Callable[[float], None], every_s: float) -> None:
        self.report, self.every_s, self.last = report, every_s, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last >= self.every_s:
            self.last = now
            self.report(done / total)
