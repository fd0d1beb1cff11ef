"""Reference keys/values kept across runs (Klein 9B-KV).

In KV mode the references run alone through the transformer, modulated at timestep 0 and attending
only among themselves (:meth:`~klein_core.models.transformer.Flux2Transformer.reference_kv`): their
keys and values depend on the weights and the reference tokens (and positions), never on the prompt,
the seed, the noise or the step. So a second edit of the same pictures, with another prompt or seed,
can skip the reference pass: :class:`ReferenceKVCache` keeps the last results, keyed by the model
object and a digest of the reference tokens.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from .bounded import BoundedCache
from .lora.apply import has_loras
from .models.transformer import Flux2Transformer, ReferenceKV
from .sampling import ReferenceTokens

logger = logging.getLogger(__name__)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReferenceKVCache(BoundedCache[ReferenceKV]):
    """The last reference keys/values, bounded by entries and bytes; entries live on the device
    they were computed on. A model carrying LoRAs is never served from it (its outputs change with
    them); a freed or reloaded model never sees another model's entries (weak reference check).
    """

    def __init__(self, max_entries: int = 1, max_bytes: int = 8 << 30) -> None:
        super().__init__(max_entries, max_bytes, lambda kv: kv.nbytes())

    def get(self, model: Flux2Transformer, refs: ReferenceTokens, timestep: float = 0.0) -> ReferenceKV:
        """The keys/values of ``refs`` under ``model``: from the cache, or computed and kept."""
        if has_loras(model) or self.max_entries < 1:
            return model.reference_kv(refs.tokens, refs.ids, timestep=timestep)
        key = (id(model), str(model.dtype), str(model.device), float(timestep), _digest(refs.tokens, refs.ids))
        with self._lock:
            hit = self._lookup(key, model)
        if hit is not None:
            self.hits += 1
            logger.debug("reference keys/values from the cache (%d tokens)", hit.tokens)
            return hit
        self.misses += 1
        kv = model.reference_kv(refs.tokens, refs.ids, timestep=timestep)
        with self._lock:
            self._store(key, model, kv)
        return kv


default_kv_cache = ReferenceKVCache()

__all__ = ["ReferenceKVCache", "default_kv_cache"]
