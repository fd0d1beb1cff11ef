"""Reference keys/values kept across runs (Klein 9B-KV).

In KV mode the references run alone through the transformer, modulated at timestep 0 and attending
only among themselves (:meth:`~klein_core.models.transformer.Flux2Transformer.reference_kv`): their
keys and values depend on the weights and the reference tokens (and positions), never on the prompt,
the seed, the noise or the step. So a second edit of the same pictures, with another prompt or seed,
can skip the reference pass: :class:`ReferenceKVCache` keeps the last results, keyed by the model
object, the state of its weights (:func:`weights_state`), the block ops it computes with and a digest
of the reference tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import weakref

import torch

from ..lora.apply import has_loras
from ..models.transformer import Flux2Transformer, ReferenceKV, kv_bytes
from .bounded_cache import BoundedCache
from .sampling import ReferenceTokens

logger = logging.getLogger(__name__)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# A serial number per weight storage, for as long as it lives: a storage freed and another one made
# at the same address (the CUDA allocator reuses them at once) gets a new number, so a key made of
# serials is never matched by other weights. Weakly keyed: nothing is kept alive.
_serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_next_serial = itertools.count(1)
_serials_lock = threading.Lock()


def _serial(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    with _serials_lock:
        n = _serials.get(storage)
        if n is None:
            n = _serials[storage] = next(_next_serial)
        return n


def weights_state(model: torch.nn.Module) -> tuple | None:
    """A cheap token that changes whenever ``model``'s parameters or buffers change: new tensors
    (``load_state_dict(assign=True)``, ``.data =``, ``.to()``) or writes in place (``load_state_dict``,
    ``copy_``, which bump the tensors' version counters). No weights are read. Inference tensors
    (made under ``torch.inference_mode``, as in ComfyUI) have no version counter: their in-place
    writes are not seen, new tensors are. None when a tensor has no storage to follow (such a model
    is not cached)."""
    try:
        return tuple((_serial(t), t.data_ptr(), -1 if t.is_inference() else t._version)
                     for t in itertools.chain(model.parameters(), model.buffers()))
    except (RuntimeError, NotImplementedError, TypeError):  # storage-less tensor subclasses
        return None


class _Identity:
    """A key part that equals only the very same object, and keeps it alive: while an entry's key
    holds it, its ``id`` cannot be given to another object (ops need not be hashable)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


class ReferenceKVCache(BoundedCache[ReferenceKV]):
    """The last reference keys/values, bounded by entries and bytes; entries live on the device
    they were computed on. An entry is served only to the very model it was made for (weak
    reference check) with the very weights it had (:func:`weights_state`: a reload or in-place
    change misses, and drops that model's older entries) and the very block ops it ran with
    (``model.ops``: another speed's kernels round differently); a model carrying LoRAs is never
    served. On a miss, the entries that the new one would push out are dropped before it is
    computed, so the device never holds both (the memory planner counts one set).
    ``max_entries`` / ``max_bytes``: whole numbers >= 1 (TypeError / ValueError otherwise).
    """

    def __init__(self, max_entries: int = 1, max_bytes: int = 8 << 30) -> None:
        super().__init__(max_entries, max_bytes, lambda kv: kv.nbytes())  # the bounds are checked there

    def get(self, model: Flux2Transformer, refs: ReferenceTokens, timestep: float = 0.0, *,
            weights: tuple | None = None) -> ReferenceKV:
        """The keys/values of ``refs`` under ``model``: from the cache, or computed and kept.
        ``weights``: :func:`weights_state` of the model where its weights live between runs, taken
        before a stage places them (default: of ``model`` as it is). A staged or streamed model's
        device copies are new tensors every run: keyed by them, nothing was ever served again."""
        if has_loras(model):  # branches: their factors are buffers the key follows; not cached all the same
            return model.reference_kv(refs.tokens, refs.ids, timestep=timestep)
        weights = weights_state(model) if weights is None else weights
        if weights is None:
            logger.debug("reference keys/values not cached: the model's weights cannot be followed")
            return model.reference_kv(refs.tokens, refs.ids, timestep=timestep)
        # The ops are part of the key: the same weights give other keys/values under other kernels
        # (a speed switched on the same model object), which a fresh run would not reproduce.
        key = (id(model), str(model.dtype), str(model.device), float(timestep), weights,
               _digest(refs.tokens, refs.ids), _Identity(model.ops))
        with self._lock:
            hit = self._lookup(key, model)
            if hit is None:
                self._drop_stale(model, weights)
                # Free now what storing the new entry would evict anyway: otherwise the old keys/values
                # (GiBs for 9B-KV) stay on the device through the reference pass, next to the new ones.
                self._make_room(kv_bytes(model.config, refs.tokens.shape[1], model.dtype.itemsize))
        if hit is not None:
            self.hits += 1
            logger.debug("reference keys/values from the cache (%d tokens)", hit.tokens)
            return hit
        self.misses += 1
        kv = model.reference_kv(refs.tokens, refs.ids, timestep=timestep)
        with self._lock:
            self._store(key, model, kv)
        return kv

    def _make_room(self, nbytes: int) -> None:
        """Drop the oldest entries until one more of ``nbytes`` fits the bounds (all of them when it
        cannot fit at all, as storing it would); under the lock."""
        self._drop_orphans()
        total = self._nbytes()
        dropped = 0
        while self._data and (len(self._data) >= self.max_entries or total + nbytes > self.max_bytes):
            _, (_, old) = self._data.popitem(last=False)
            total -= self._size(old)
            dropped += 1
        if dropped:
            logger.debug("dropped %d reference key/value entries to make room before the reference pass", dropped)

    def _drop_stale(self, model: Flux2Transformer, weights: tuple) -> None:
        """Forget ``model``'s entries made with other weights (they can never hit again); under the lock."""
        stale = [k for k, (ref, _) in self._data.items()
                 if k[0] == id(model) and k[4] != weights and ref is not None and ref() is model]
        for k in stale:
            del self._data[k]
        if stale:
            logger.debug("dropped %d reference key/value entries made with the model's previous weights", len(stale))


default_kv_cache = ReferenceKVCache()

__all__ = ["ReferenceKVCache", "default_kv_cache", "weights_state"]
