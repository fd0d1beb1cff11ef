"""A small thread-safe LRU bounded by entry count and bytes, whose entries may belong to an owner
object (held weakly: an entry is only served to the very object it was made for)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class BoundedCache(Generic[V]):
    """``key -> value`` kept least-recently-used first; ``size(value)`` gives its bytes."""

    def __init__(self, max_entries: int, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size = size
        self._data: OrderedDict[Hashable, tuple[weakref.ref | None, V]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def nbytes(self) -> int:
        return sum(self._size(v) for _, v in self._data.values())

    def _lookup(self, key: Hashable, owner: Any = None) -> V | None:
        """The value for ``key`` if it was stored for ``owner`` (or for no owner); call under the lock."""
        hit = self._data.get(key)
        if hit is None or (hit[0] is not None and hit[0]() is not owner):
            return None
        self._data.move_to_end(key)
        return hit[1]

    def _store(self, key: Hashable, owner: Any, value: V) -> None:
        """Keep ``value`` (for ``owner``, or None), then drop the oldest entries beyond the bounds;
        call under the lock."""
        self._data[key] = (None if owner is None else weakref.ref(owner), value)
        total = self.nbytes()
        while self._data and (len(self._data) > self.max_entries or total > self.max_bytes):
            _, (_, old) = self._data.popitem(last=False)
            total -= self._size(old)


__all__ = ["BoundedCache"]
