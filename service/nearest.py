"""Nearest tuned shapes in memory: per (device, pattern, dtype, mesh size), the log-shape
features of every tuned problem as one numpy array, so a lookup of an untuned shape (and a
batch of them) costs a vectorised distance computation, not a database search.

Every group with a winner is read at startup (:meth:`NearestIndex.preload`;
``repository.tuned_group``, one indexed query each) by a background thread, and a group not
read yet the first time a shape of it is asked about; until it is read, the lookups of that
group are answered by the database search (``repository.nearest_winners``). When a winner of a
device changes (:meth:`NearestIndex.drop`, called from the engine's invalidation) its groups
are dropped and read again the same way. The answers are the same either way: Euclidean distance over log2 of (m, n, k, b),
within the maximum distance, the problem itself left out, closest first, ties by lower
problem id.

The index holds at most ``max_groups`` groups and ``max_bytes`` bytes of them (settings
``nearest_max_groups`` / ``nearest_max_bytes``): past either, the least recently asked group
goes (and is read again when asked again). At most ``max_groups`` reads wait at a time; a
group asked for beyond that is answered by the database search until asked again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy.orm import Session

from autotuner import Problem
from db import Database
from db import repository as repo
from service.bounded import BoundedDict

log = logging.getLogger("service.nearest")

GroupKey = tuple[str, str, str, int]  # device key, pattern, dtype, mesh size
Found = list[tuple[str, float]]  # (neighbour key, distance), closest first


@dataclass(frozen=True)
class Group:
    ids: np.ndarray  # problem ids, ascending
    keys: list[str]
    features: np.ndarray  # (n, 4): lm, ln, lk, lb


def _nbytes(group: Group) -> int:
    """About what a group takes in memory: its arrays, its keys (str objects), a fixed overhead."""
    return 512 + group.ids.nbytes + group.features.nbytes + sum(49 + len(k) for k in group.keys) \
        + 8 * len(group.keys)


def features(problem: Problem) -> np.ndarray:
    f = problem.features()
    return np.array([repo.log_feature(f[e]) for e in ("m", "n", "k", "b")])


class NearestIndex:
    """``database``: where a background thread reads the groups (None: read them in the asking
    call's session, at once - for tests and one-off use)."""

    def __init__(self, max_distance: float, limit: int = 5, database: Database | None = None, *,
                 max_groups: int = 4096, max_bytes: int = 256 * 2**20) -> None:
        self.max_distance = max_distance
        self.limit = limit
        self.database = database
        self.max_groups = max_groups
        self._groups: BoundedDict[GroupKey, Group] = BoundedDict(max_groups, max_bytes, lru=True)
        self._lock = threading.Lock()
        # +1 on every drop (all groups / one group): a group read before its drop is not kept
        self._epoch = 0
        self._dropped: dict[GroupKey, int] = {}
        self._queued: set[GroupKey] = set()
        self._queue: queue.Queue[GroupKey | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.loads = 0

    def _version(self, key: GroupKey) -> tuple[int, int]:
        return self._epoch, self._dropped.get(key, 0)

    def drop(self, device_key: str | None = None, groups: set[GroupKey] | None = None) -> None:
        """Forget some groups - ``groups``, else the device's, else all - and, with a database,
        read them again in the background at once (until then the database search answers
        for them)."""
        with self._lock:
            if device_key is None and groups is None:
                self._epoch += 1
                gone = self._groups.discard_if(lambda k, g: True)
            else:
                gone = self._groups.discard_if(lambda k, g: k in groups) if groups is not None \
                    else self._groups.discard_if(lambda k, g: k[0] == device_key)
                for k in (groups if groups is not None else gone):
                    self._dropped[k] = self._dropped.get(k, 0) + 1
                if len(self._dropped) > max(self.max_groups, 64):  # keep it bounded: a new epoch
                    self._epoch += 1  # also makes every read under way stale, as a drop would
                    self._dropped.clear()
        if self.database is not None:
            for key in gone:
                self._request(key)

    def changed(self, changes: Sequence[tuple[str, str | None]]) -> None:
        """Drop the groups that changed winners belong to (a device's all for a None problem)."""
        whole = {d for d, p in changes if p is None}
        pkeys = sorted({p for d, p in changes if p is not None and d not in whole})
        for d in whole:
            self.drop(d)
        if not pkeys:
            return
        if self.database is None:
            for d in {d for d, p in changes if p is not None}:
                self.drop(d)
            return
        with self.database.session(read_only=True) as s:
            found = repo.problem_groups(s, pkeys)
        self.drop(groups={(d, *found[p]) for d, p in changes if p in found and d not in whole})

    def preload(self) -> int:
        """Ask the background thread to read every group that has a winner (the service does
        at startup); returns how many."""
        assert self.database is not None
        with self.database.session(read_only=True) as s:
            keys = repo.tuned_groups(s)
        for key in keys:
            self._request(key)
        return len(keys)

    def _read(self, s: Session, key: GroupKey, version: tuple[int, int]) -> Group:
        dkey, pattern, dtype, mesh_size = key
        rows = repo.tuned_group(s, dkey, pattern=pattern, dtype=dtype, mesh_size=mesh_size)
        got = Group(ids=np.array([r[0] for r in rows], dtype=np.int64), keys=[r[1] for r in rows],
                    features=np.array([r[2:] for r in rows], dtype=np.float64).reshape(-1, 4))
        with self._lock:
            self.loads += 1
            if version == self._version(key):
                self._groups.put(key, got, _nbytes(got))
        return got

    # -- the background reader -------------------------------------------------------------------
    def _request(self, key: GroupKey) -> None:
        with self._lock:
            if key in self._queued or len(self._queued) >= max(self.max_groups, 1):
                return
            self._queued.add(key)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="autotuner-nearest", daemon=True)
                self._thread.start()
        self._queue.put(key)

    def _run(self) -> None:
        assert self.database is not None
        while (key := self._queue.get()) is not None:
            try:
                version = self._version(key)  # before the session's first read (its snapshot)
                with self.database.session(read_only=True) as s:
                    self._read(s, key, version)
            except Exception:  # noqa: BLE001 - the lookups fall back to the database search
                log.exception("could not read the nearest-shape group %s", key[1:])
            finally:
                with self._lock:
                    self._queued.discard(key)
                self._queue.task_done()

    def wait(self) -> None:
        """Until every group asked for so far has been read."""
        self._queue.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self._thread = None

    # -- queries ---------------------------------------------------------------------------------
    def neighbors(self, s: Session, device_key: str, problems: Sequence[tuple[str, Problem]]
                  ) -> dict[str, Found]:
        """For each ``(key, problem)``: up to ``limit`` ``(neighbour key, distance)``, closest
        first; the problems of one group in one array operation (of a group not read yet: the
        database search in ``s``, and the group is read in the background). Call it before
        anything else reads in ``s``'s transaction."""
        versions = {}  # before the session's first read (its snapshot)
        by_group: dict[GroupKey, list[tuple[str, Problem]]] = {}
        for pkey, p in problems:
            gk = (device_key, p.pattern.label, p.dtype, p.axis_size)
            by_group.setdefault(gk, []).append((pkey, p))
            versions[gk] = self._version(gk)
        out: dict[str, Found] = {}
        for gk, members in by_group.items():
            group = self._groups.get(gk)
            if group is None and self.database is None:
                group = self._read(s, gk, versions[gk])
            if group is None:
                self._request(gk)
                out.update({pkey: self._search(s, device_key, pkey, p) for pkey, p in members})
            else:
                out.update(self._nearest_in(group, members))
        return out

    def _search(self, s: Session, device_key: str, pkey: str, p: Problem) -> Found:
        f = p.features()
        return [(nb.winner.problem_key, nb.distance) for nb in repo.nearest_winners(
            s, device_key, pattern=p.pattern.label, dtype=p.dtype, mesh_size=p.axis_size,
            m=f["m"], n=f["n"], k=f["k"], b=f["b"], limit=self.limit, exclude_key=pkey,
            max_distance=self.max_distance)]

    def _nearest_in(self, group: Group, members: list[tuple[str, Problem]]) -> dict[str, Found]:
        out: dict[str, Found] = {}
        if not group.keys:
            return {pkey: [] for pkey, _ in members}
        r2 = self.max_distance * self.max_distance
        targets = np.stack([features(p) for _, p in members])  # (m, 4)
        d2 = ((group.features[None, :, :] - targets[:, None, :]) ** 2).sum(axis=2)  # (m, n)
        for row, (pkey, _) in enumerate(members):
            inside = np.flatnonzero(d2[row] <= r2)
            # closest first, ties by lower problem id (ids ascend with the index)
            order = inside[np.argsort(d2[row, inside], kind="stable")]
            found: Found = []
            for i in order:
                if group.keys[i] != pkey:
                    found.append((group.keys[i], float(np.sqrt(max(d2[row, i], 0.0)))))
                    if len(found) == self.limit:
                        break
            out[pkey] = found
        return out
