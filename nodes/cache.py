"""Loaded klein_core models and prompt embeddings, shared with ComfyUI's model management.

At most one model per role (transformer, text encoder, VAE) is held. Node outputs carry a
:class:`ModelRef` (file, device, dtype), never the model, so ComfyUI's output cache cannot keep weights
alive: after :func:`release_all` the memory is free, and the next node reloads the model from its file.

Every loaded model is registered with ComfyUI's model management (``nodes/host.py``): ComfyUI is asked
for the memory before a load and gets the model through ``load_models_gpu`` before each use, so it can
offload ours when another model needs the GPU. Where the weights live is klein_core's planner's choice
(``kc.weights_home``); what runs where during a generation, its engine's.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import klein_core as kc
from klein_core.files.loaders import LOADERS, meta_model
from klein_core.memory import pinned
from klein_core.memory.placement import module_bytes, pin_memory_
from klein_core.pipeline.reference_kv import ReferenceKVCache

from . import host

logger = logging.getLogger(__name__)

ROLES = ("transformer", "text_encoder", "vae")

_lock = threading.RLock()
_resident: dict[str, tuple[ModelRef, torch.nn.Module, object]] = {}  # role -> (ref, model, host handle)
# Models dropped from the cache that something else may still hold (Klein Model to MODEL's native
# MODEL, in ComfyUI's output cache, holds its transformer): asked for again, such a model is taken
# back rather than read from its file a second time beside it.
_released: weakref.WeakValueDictionary[ModelRef, torch.nn.Module] = weakref.WeakValueDictionary()
loads: Counter[str] = Counter()  # loads per role since start (tests and logs)
prompts = kc.PromptCache(max_entries=32)  # the pack's prompt-embedding cache (in memory)
kv = ReferenceKVCache(max_entries=1)  # KV models: the last edit's reference keys/values (on the GPU)

# Opt-in disk cache of prompt embeddings: a folder, and its size bound in MiB. Set before (or while)
# ComfyUI runs; read at each encode, so a change takes effect without a restart.
PROMPT_CACHE_ENV = "KLEIN_PROMPT_CACHE"
PROMPT_CACHE_MB_ENV = "KLEIN_PROMPT_CACHE_MB"
PROMPT_CACHE_MB = 2048


def prompt_cache() -> kc.PromptCache:
    """The pack's prompt cache, backed by the folder named in ``$KLEIN_PROMPT_CACHE`` if set (bounded
    by ``$KLEIN_PROMPT_CACHE_MB``, default 2048): embeddings there survive restarts, so a repeated
    prompt never loads the text encoder. A folder that cannot be used is logged and skipped."""
    folder = os.environ.get(PROMPT_CACHE_ENV, "").strip()
    if not folder:
        prompts.disk = None
        return prompts
    try:
        mb = float(os.environ.get(PROMPT_CACHE_MB_ENV, "") or PROMPT_CACHE_MB)
        if not (0 < mb < float("inf")):
            raise ValueError
    except ValueError:
        logger.warning("Klein: %s=%r is not a positive number of MiB; using %d", PROMPT_CACHE_MB_ENV,
                       os.environ.get(PROMPT_CACHE_MB_ENV), PROMPT_CACHE_MB)
        mb = PROMPT_CACHE_MB
    disk = prompts.disk
    max_bytes = max(1 << 20, int(mb * 2**20))  # at least 1 MiB: a smaller bound holds no embedding
    if disk is None or str(disk.folder) != str(Path(folder).expanduser()) or disk.max_bytes != max_bytes:
        try:
            prompts.disk = kc.DiskPromptCache(Path(folder).expanduser(), max_bytes=max_bytes)
        except OSError as exc:
            logger.warning("Klein: the prompt cache folder %s=%s cannot be used (%s); caching in memory only",
                           PROMPT_CACHE_ENV, folder, exc.strerror or exc)
            prompts.disk = None
        else:
            logger.info("Klein: prompt embeddings cached on disk in %s (up to %d MiB)", folder, mb)
    return prompts


@dataclass(frozen=True)
class ModelRef:
    """What to load and where: the cache key, and what the socket types carry between nodes.

    ``device`` is where the weights live between uses (the GPU, or the CPU when klein_core streams
    them in); ``str()`` gives only the file name, since ComfyUI shows node inputs to API clients.
    """

    role: str
    name: str  # the file name as listed in its models folder
    path: str
    mtime_ns: int
    device: str
    dtype: torch.dtype
    quantize: str | None = None  # "fp8": quantise the block Linears while loading

    def __str__(self) -> str:
        return f"{self.name} ({self.role}, {self.device}, {str(self.dtype).removeprefix('torch.')})"

    __repr__ = __str__

    def get(self) -> torch.nn.Module:
        """The loaded model, on its device; loaded or moved back on demand (the engine asks ComfyUI for
        its activations' memory when it plans, through :func:`room_for`)."""
        return acquire(self)


def model_ref(role: str, path: str, name: str, device: torch.device, dtype: torch.dtype,
              quantize: str | None = None) -> ModelRef:
    return ModelRef(role, name, path, os.stat(path).st_mtime_ns, str(device), dtype, quantize)


def weight_bytes(ref: ModelRef) -> int:
    """Device bytes the model of ``ref`` will take (its weights' real dtypes, fp8 included), from
    the file header alone."""
    return module_bytes(meta_model(ref.path, ref.role, dtype=ref.dtype, quantize=ref.quantize))


def acquire(ref: ModelRef) -> torch.nn.Module:
    """Return the model for ``ref`` on ``ref.device``, loading it (and dropping the previous one of
    its role) if needed; ComfyUI makes room for its weights first."""
    with _lock:
        held = _resident.get(ref.role)
        if held is None or held[0] != ref:
            if held is not None:
                logger.info("Klein: dropping the %s %s for %s", ref.role, held[0].name, ref.name)
                _released[held[0]] = held[1]
                del _resident[ref.role], held
            device = torch.device(ref.device)
            t0 = time.perf_counter()
            model = _released.pop(ref, None)
            if model is not None:  # still alive, held by a node output: taken back, not read again
                logger.info("Klein: took back the %s %s (still held by a node output; not read again)",
                            ref.role.replace("_", " "), ref.name)
            else:
                host.make_room(weight_bytes(ref), device)  # ComfyUI frees its models first
                extra = {"quantize": ref.quantize} if ref.quantize else {}
                model = LOADERS[ref.role](ref.path, device=ref.device, dtype=ref.dtype, **extra)
                loads[ref.role] += 1
                logger.info("Klein: loaded %s %s on %s as %s in %.2fs", ref.role.replace("_", " "), ref.name,
                            ref.device, str(ref.dtype).removeprefix("torch."), time.perf_counter() - t0)
            if device.type == "cpu" and host.torch_device().type == "cuda":
                # Homed in CPU memory to be streamed or copied onto the GPU: page-locked now rather
                # than at its first stage, so the LoRA'd copies (Klein LoRA Loader), which share its
                # tensors, share the page-locked ones instead of each locking a copy of its own.
                pin_memory_(model)
            handle = host.register_model(model, ref.role, device)
            _resident[ref.role] = (ref, model, handle)
        _, model, handle = _resident[ref.role]
        host.use_models([handle])  # back on its device if ComfyUI offloaded it
        return model


def room_for(refs: list) -> Callable[[int, torch.device], None]:
    """The engine's ``make_room`` hook for a node run: ComfyUI frees ``nbytes`` on the device by
    unloading other models, keeping the models of ``refs`` (model refs, or handles over one, such as
    a LoRA's, with ``.base``) where they are."""
    bases = []
    for ref in refs:
        while not isinstance(ref, ModelRef) and hasattr(ref, "base"):
            ref = ref.base
        bases.append(ref)

    def make_room(nbytes: int, device: torch.device) -> None:
        with _lock:
            handles = [held[2] for ref in bases if isinstance(ref, ModelRef)
                       and (held := _resident.get(ref.role)) is not None and held[0] == ref]
        host.use_models(handles, nbytes)

    return make_room


def resident() -> dict[str, str]:
    """Role -> file name of every model held now."""
    with _lock:
        return {role: entry[0].name for role, entry in _resident.items()}


def release_all(reason: str = "ComfyUI unloaded all models") -> int:
    """Drop every cached model and prompt embedding; returns how many models were held."""
    with _lock:
        names = [f"{role} {entry[0].name}" for role, entry in _resident.items()]
        for ref, model, _ in _resident.values():
            _released[ref] = model  # freed below unless a node output still holds it
        _resident.clear()
        prompts.clear()
        kv.clear()
        host.release_native_vaes()
    # The models' page-locked CPU homes (streamed blocks, components copied in per stage) go back
    # to torch's page-locked cache, still locked, until it is emptied.
    gc.collect()
    unlocked = pinned.release_cached()
    logger.info("Klein: released %d cached model(s) (%s): %s; cache empty%s", len(names),
                ", ".join(names) or "none", reason, "; page-locked CPU memory returned" if unlocked else "")
    return len(names)


def install_free_hook() -> None:
    """Release the caches whenever ComfyUI unloads all its models (``POST /free`` and others)."""
    if host.install_unload_hook(release_all):
        logger.debug("Klein: hooked comfy.model_management.unload_all_models")
