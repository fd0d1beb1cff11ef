"""A small thread-safe LRU bounded by entry count and bytes, whose entries may belong to an owner
object (held weakly: an entry is only served to the very object it was made for, and it goes when
that object is freed, so a released model's cached tensors are not kept)."""

from __future__ import annotations

import numbers
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


def check_bound(name: str, value: object) -> int:
    """``value`` as a whole number >= 1, else TypeError (not an int, or a bool) / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(value)


class BoundedCache(Generic[V]):
    """``key -> value`` kept least-recently-used first; ``size(value)`` gives its bytes.
    ``max_entries`` and ``max_bytes`` must be whole numbers >= 1 (TypeError / ValueError otherwise)."""

    def __init__(self, max_entries: int, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_entries = check_bound("max_entries", max_entries)
        self.max_bytes = check_bound("max_bytes", max_bytes)
        self._size = size
        self._data: OrderedDict[Hashable, tuple[weakref.ref | None, V]] = OrderedDict()
        self._lock = threading.Lock()
        self._orphans: list[tuple[Hashable, weakref.ref]] = []  # owners freed while the lock was held
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            self._drop_orphans()
            return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._orphans.clear()

    def nbytes(self) -> int:
        """The bytes of every entry (taken under the lock: another thread may be storing one)."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(self._size(v) for _, v in self._data.values())

    def _owner_freed(self, key: Hashable, ref: weakref.ref) -> None:
        """An owner died (weakref callback, possibly inside a locked section of this thread): drop
        its entry now if the lock is free, else at the next locked call."""
        self._orphans.append((key, ref))
        if self._lock.acquire(blocking=False):
            try:
                self._drop_orphans()
            finally:
                self._lock.release()

    def _drop_orphans(self) -> None:
        while self._orphans:
            key, ref = self._orphans.pop()
            entry = self._data.get(key)
            if entry is not None and entry[0] is ref:  # not a newer entry under the same key
                del self._data[key]

    def _lookup(self, key: Hashable, owner: Any = None) -> V | None:
        """The value for ``key`` if it was stored for ``owner`` (or for no owner); call under the lock."""
        self._drop_orphans()
        hit = self._data.get(key)
        if hit is None or (hit[0] is not None and hit[0]() is not owner):
            return None
        self._data.move_to_end(key)
        return hit[1]

    def _store(self, key: Hashable, owner: Any, value: V) -> None:
        """Keep ``value`` (for ``owner``, or None) as the newest entry, then drop the oldest entries
        beyond the bounds; call under the lock."""
        self._drop_orphans()
        ref = None
        if owner is not None:
            cache = weakref.ref(self)  # the callback must not keep the cache alive
            ref = weakref.ref(owner, lambda r, key=key: (c := cache()) is not None and c._owner_freed(key, r))
        self._data.pop(key, None)  # re-stored: newest, not left at its old place in the order
        self._data[key] = (ref, value)
        total = self._nbytes()
        while self._data and (len(self._data) > self.max_entries or total > self.max_bytes):
            _, (_, old) = self._data.popitem(last=False)
            total -= self._size(old)


__all__ = ["BoundedCache", "check_bound"]
