"""A dict bounded in entries and in (estimated) bytes: what every cache and memo of the service
keeps its entries in (README "Limits and bounds").

Each entry is stored with its size in bytes as its owner estimates it (:func:`estimate`: the
length of its JSON text times a factor, plus a fixed overhead, measured with ``tracemalloc`` on
parsed problems and cached answers). Storing an entry that takes the dict past
``max_entries`` or ``max_bytes`` removes the oldest entries (``lru=True``: the least recently
read) until it fits; an entry larger than ``max_bytes`` on its own is not stored.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["BoundedDict", "estimate"]


def estimate(text_chars: int, factor: int = 8, overhead: int = 512) -> int:
    """The bytes an entry built from ``text_chars`` characters of JSON takes, roughly (a parsed
    problem takes about 7.4 bytes per character of its JSON, an answer about 6)."""
    return overhead + factor * text_chars


class BoundedDict(OrderedDict[K, V]):
    """An ordered dict of at most ``max_entries`` entries and ``max_bytes`` bytes; thread-safe.
    Write it through :meth:`put`, :meth:`discard`, :meth:`discard_if` and :meth:`clear` (a plain
    ``d[k] = v`` bypasses the bounds); read it as a dict (``get``, ``len``, ``values``)."""

    def __init__(self, max_entries: int, max_bytes: int, *, lru: bool = False) -> None:
        super().__init__()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.lru = lru
        self.nbytes = 0
        self._sizes: dict[Any, int] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        if not self.lru:
            return super().get(key, default)
        with self._lock:
            try:
                self.move_to_end(key)
            except KeyError:
                return default
            return super().get(key, default)

    def put(self, key: K, value: V, size: int) -> None:
        with self._lock:
            self._pop(key)
            if size > self.max_bytes or self.max_entries < 1:
                return
            self[key] = value
            self._sizes[key] = size
            self.nbytes += size
            while len(self) > self.max_entries or self.nbytes > self.max_bytes:
                self._pop(next(iter(self)))

    def _pop(self, key: Any) -> V | None:
        value = super().pop(key, None)
        self.nbytes -= self._sizes.pop(key, 0)
        return value

    def discard(self, key: Any) -> V | None:
        with self._lock:
            return self._pop(key)

    def discard_if(self, drop: Callable[[K, V], bool]) -> list[K]:
        """Remove every entry ``drop(key, value)`` is true of; returns their keys. ``drop`` runs
        on a snapshot of the keys, without the lock (a long scan does not hold up readers); an
        entry stored meanwhile may be removed too, or kept."""
        with self._lock:
            keys = list(self)
        missing = object()
        gone = [k for k in keys if (v := OrderedDict.get(self, k, missing)) is not missing and drop(k, v)]
        with self._lock:
            for k in gone:
                self._pop(k)
        return gone

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self._sizes.clear()
            self.nbytes = 0
