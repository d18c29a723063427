"""Cache coherence across service processes and hosts: the winners' generation, polled.

Every transaction that writes a winner or a calibration increments the database's generation
counter and logs what it changed (:mod:`db._changes`), whichever process writes it (a tuning
worker, another service process, a tuner writing to the database directly). A
:class:`ChangeWatcher` in each service process asks for the changes after the last generation
it saw every ``interval`` seconds (one indexed query that returns nothing while nothing
changes; ``AUTOTUNER_LOOKUP_POLL_SECONDS``, default 0.2 s) and hands them to the lookup
engine, which drops exactly the answers they affect. So a winner stored anywhere is served by
every process within about one interval, and answers can stay cached until they change. The
same counter serves SQLite and PostgreSQL (no LISTEN/NOTIFY connection to keep alive).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from db import Database, StorageError
from db import repository as repo

log = logging.getLogger("service.coherence")

# (device key, problem key or None for every answer of the device); None: drop everything
OnChanges = Callable[[tuple[tuple[str, str | None], ...] | None], None]


class ChangeWatcher:
    """Polls ``database`` for changed winners and calls ``on_changes`` (see the module docs)."""

    def __init__(self, database: Database, on_changes: OnChanges, interval: float = 0.2) -> None:
        self.database = database
        self.on_changes = on_changes
        self.interval = interval
        self.generation: int | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None

    def poll(self) -> int:
        """One poll; returns how many changes it applied (-1: dropped everything)."""
        with self.database.session(read_only=True) as s:
            if self.generation is None:  # first poll: nothing cached can predate it
                self.generation = repo.current_generation(s)
                self.on_changes(None)
                return -1
            got = repo.changes_since(s, self.generation)
        self.polls += 1
        if got.generation == self.generation:
            return 0
        self.generation = got.generation
        if not got.complete:
            self.on_changes(None)
            return -1
        self.on_changes(got.items)
        return len(got.items)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        try:
            self.poll()
        except StorageError as e:  # e.g. not migrated yet: the thread keeps trying
            self._failing_since = time.monotonic()
            log.warning("cannot read winner changes yet: %s", e)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autotuner-coherence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
                if self._failing_since is not None:
                    log.warning("winner changes readable again")
                    self._failing_since = None
            except StorageError as e:
                # keep serving what is cached (the database may be briefly away); say so once
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    log.warning("cannot read winner changes (cached answers may be stale): %s", e)
            except Exception:  # noqa: BLE001 - the thread must survive anything
                log.exception("winner change poll failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
