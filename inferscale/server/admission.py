"""Bounded admission for chat requests: at most `max_concurrent` inside the engine, at most
`max_queued` waiting (first come, first served); a request beyond both is refused at once
(`Overloaded` -> 429). Waiting can be cancelled (timeout, client gone) without losing a slot.

    slot = await admission.acquire()      # raises Overloaded, or waits
    try: ...
    finally: slot.release()               # idempotent
"""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    pass


class Slot:
    __slots__ = ("_admission", "_released")

    def __init__(self, admission: "Admission") -> None:
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release()


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queued >= 0")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Slot:
        if self.in_flight < self.max_concurrent and not self._waiters:
            self.in_flight += 1
            return Slot(self)
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise Overloaded(f"server overloaded: {self.in_flight} requests running and {len(self._waiters)} "
                             f"queued (limits {self.max_concurrent} and {self.max_queued}); retry later")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # resolved by _release, which hands over its slot (in_flight unchanged)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed to us just as we were cancelled: pass it on
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:  # already skipped by _release
                    pass
            raise
        return Slot(self)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.in_flight -= 1
