"""Anonymous batch lookups answered at a bounded share of a service process's time.

A service process serves lookups on two cores' worth of threads that share one GIL. An
anonymous batch of 500 untuned problems costs it about half a second of CPU (parsing each
problem, the nearest index, the cost model); run in one piece beside valid lookups it holds
the GIL and the cores for that half second, and the valid lookups' p99 grows by as much
(``bench/load.py --anonymous-flood``). A count of problems per address
(:mod:`service.ratelimit`) bounds how many such batches pass, not what one costs the others
while it runs. So the work of the anonymous batches a process admits goes through one
:class:`Pacer`: in slices of ``AUTOTUNER_ANON_BATCH_SLICE`` problems, one slice at a time
across all of them, each run in the thread pool and followed by a rest that keeps the slices
to ``AUTOTUNER_ANON_BATCH_SHARE`` of the wall time (a slice waits out the rest its predecessor
left, so a small batch on an idle pacer is answered at once). A valid lookup then waits for at
most one slice, and while other lookups are being answered anonymous batches together take no
more than that share of the process (an anonymous caller waits longer for its answer instead);
when none was for 0.1 s (``service.fastpath.IDLE_SECONDS``), a slice skips its rest, so a
process with nothing else to do answers them at full speed. Lookups with a valid token are never paced.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

T = TypeVar("T")

SCOPE_KEY = "autotuner.pacer"  # where the limiter leaves the pacer for the fast path


class Pacer:
    """Runs functions one at a time in the thread pool, the next starting no sooner than
    ``1 / share - 1`` times as long after one ends as that one took (wall time: what it held
    the process for); a pacer idle for that long, or one whose ``busy()`` says no other work
    waits, runs the next at once.
    ``size`` is the number of problems a caller puts in one slice. ``sleep`` and ``clock``
    for tests."""

    def __init__(self, share: float, size: int, *, busy: Callable[[], bool] | None = None,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a pacer's share must be in (0, 1], not {share!r}")
        if size < 1:
            raise ValueError(f"a pacer's slice must be at least 1 problem, not {size!r}")
        self.share = share
        self.size = size
        self.busy = busy  # whether other work waits (None: always): no rest while nothing does
        self.sleep = sleep
        self.clock = clock
        self.slices = 0  # slices run so far
        self.busy_seconds = 0.0  # wall time they took
        self._lock: asyncio.Lock | None = None
        self._next = float("-inf")  # when the next slice may start
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread pool, once every slice before it has run and rested."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # one lock per event loop (tests start several)
            self._lock, self._loop = asyncio.Lock(), loop
        async with self._lock:
            rest = self._next - self.clock()
            if rest > 0 and (self.busy is None or self.busy()):
                await self.sleep(rest)
            start = self.clock()
            try:
                return await run_in_threadpool(fn, *args)
            finally:
                end = self.clock()
                self.slices += 1
                self.busy_seconds += end - start
                self._next = end + (end - start) * (1 / self.share - 1)

    def slices_of(self, items: list[T]) -> list[list[T]]:
        """``items`` in slices of ``size``."""
        return [items[lo:lo + self.size] for lo in range(0, len(items), self.size)]
