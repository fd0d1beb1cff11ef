"""Module-level caches of loaded klein_core models and prompt embeddings, released on ``POST /free``.

At most one model per role (transformer, text encoder, VAE) is held. Node outputs carry a
:class:`ModelRef` (file, device, dtype), never the model itself, so ComfyUI's own output cache
cannot keep weights alive: after :func:`release_all` the memory is really free, and the next node
that needs the model reloads it from its file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

import klein_core as kc

from . import host

logger = logging.getLogger(__name__)

ROLES = ("transformer", "text_encoder", "vae")
# When the GPU is short of memory, our own idle models leave it in this order.
_OFFLOAD_ORDER = ("text_encoder", "vae", "transformer")

_lock = threading.RLock()
_resident: dict[str, tuple[ModelRef, torch.nn.Module]] = {}
loads: Counter[str] = Counter()  # loads per role since start (tests and logs)
prompts = kc.PromptCache(max_entries=32)  # the pack's prompt-embedding cache


@dataclass(frozen=True)
class ModelRef:
    """What to load and where: the cache key, and what the socket types carry between nodes."""

    role: str
    name: str  # the file name as listed in its models folder
    path: str
    mtime_ns: int
    device: str
    dtype: torch.dtype
    quantize: str | None = None  # "fp8": quantise the block Linears while loading

    def get(self) -> torch.nn.Module:
        """The loaded model on its device; loaded (or moved back) on demand."""
        return acquire(self)


def model_ref(role: str, path: str, name: str, device: torch.device, dtype: torch.dtype,
              quantize: str | None = None) -> ModelRef:
    return ModelRef(role, name, path, os.stat(path).st_mtime_ns, str(device), dtype, quantize)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def weight_bytes(ref: ModelRef) -> int:
    """Device bytes the model of ``ref`` will take (its weights' real dtypes, fp8 included), from
    the file header alone."""
    return kc.module_bytes(kc.weightless(ref.path, ref.role, dtype=ref.dtype, quantize=ref.quantize))


def _make_room(ref: ModelRef, nbytes: int) -> None:
    device = torch.device(ref.device)
    if device.type == "cpu":
        return
    host.make_room(nbytes, device)  # ComfyUI's own models first
    for role in _OFFLOAD_ORDER:
        if host.free_bytes(device) >= nbytes:
            return
        held = _resident.get(role)
        if role == ref.role or held is None or not _same_device(_device_of(held[1]), device):
            continue
        logger.info("Klein: moving the %s %s to %s to make room", role, held[0].name, host.offload_device())
        held[1].to(host.offload_device())
        host.empty_cache()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def acquire(ref: ModelRef) -> torch.nn.Module:
    """Return the model for ``ref``, loading it (and dropping the previous one of its role) if needed."""
    with _lock:
        held = _resident.get(ref.role)
        if held is not None and held[0] == ref:
            model = held[1]
            if not _same_device(_device_of(model), torch.device(ref.device)):
                _make_room(ref, _nbytes(model))
                model.to(ref.device)
            return model
        if held is not None:
            logger.info("Klein: dropping the %s %s for %s", ref.role, held[0].name, ref.name)
            del _resident[ref.role], held
        _make_room(ref, weight_bytes(ref))
        t0 = time.perf_counter()
        extra = {"quantize": ref.quantize} if ref.quantize else {}
        model = kc.LOADERS[ref.role](ref.path, device=ref.device, dtype=ref.dtype, **extra)
        loads[ref.role] += 1
        _resident[ref.role] = (ref, model)
        logger.info("Klein: loaded %s %s on %s as %s in %.2fs", ref.role.replace("_", " "), ref.name,
                    ref.device, str(ref.dtype).removeprefix("torch."), time.perf_counter() - t0)
        return model


def resident() -> dict[str, str]:
    """Role -> file name of every model held now."""
    with _lock:
        return {role: ref.name for role, (ref, _) in _resident.items()}


def release_all(reason: str = "ComfyUI unloaded all models") -> int:
    """Drop every cached model and prompt embedding; returns how many models were held."""
    with _lock:
        names = [f"{role} {ref.name}" for role, (ref, _) in _resident.items()]
        _resident.clear()
        prompts.clear()
    logger.info("Klein: released %d cached model(s) (%s): %s; cache empty", len(names),
                ", ".join(names) or "none", reason)
    return len(names)


def install_free_hook() -> None:
    """Release the caches whenever ComfyUI unloads all its models (``POST /free`` and others)."""
    if host.install_unload_hook(release_all):
        logger.debug("Klein: hooked comfy.model_management.unload_all_models")
