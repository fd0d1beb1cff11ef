"""Prompts -> embeddings: tokenize, encode with the Qwen3 encoder, and cache repeated prompts.

Two caches, used together by :class:`PromptCache`:

* in memory, a bounded LRU per loaded encoder (entries own their memory);
* optionally on disk (:class:`DiskPromptCache`), keyed by the encoder *file's* identity (name,
  size, modification time: read with ``stat``, the file is never opened), the weights' dtype and
  device type, the :class:`TextOptions` and the prompt. A prompt seen before, also before a restart,
  needs neither the text encoder's weights nor its file.

:class:`TextOptions` chooses between the BFL / diffusers way (the model dtype, prompts cut at 512
tokens; the default) and ComfyUI's way (fp32 activations, prompts never cut, padded to at least 512).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .bounded import BoundedCache
from .errors import WeightFormatError
from .files.safetensors import open_safetensors
from .lora.apply import has_loras
from .tokenizer import MAX_LENGTH, count_tokens, tokenize_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextOptions:
    """How prompts become embeddings.

    ``max_tokens``: 512 cuts longer prompts (BFL, diffusers); None keeps every token, padding to at
    least 512 (ComfyUI). ``activations``: None computes in the model dtype (BFL, diffusers);
    ``torch.float32`` computes in fp32 with the weights cast one layer at a time (ComfyUI).
    """

    max_tokens: int | None = MAX_LENGTH
    activations: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None (the whole prompt), got {self.max_tokens!r}")
        if self.activations is not None and (not isinstance(self.activations, torch.dtype)
                                             or not self.activations.is_floating_point):
            raise ValueError(f"activations must be None (the model dtype) or a float dtype, got {self.activations!r}")

    @property
    def truncate(self) -> bool:
        return self.max_tokens is not None

    def length(self, prompts: Sequence[str]) -> int:
        """The padded token length these prompts are encoded at."""
        if self.max_tokens is not None:
            return self.max_tokens
        return max(MAX_LENGTH, *(count_tokens(p) for p in prompts))

    def key(self) -> tuple:
        return (self.max_tokens, str(self.activations))


COMFYUI_TEXT = TextOptions(max_tokens=None, activations=torch.float32)


def _source_identity(source: str | os.PathLike) -> str | None:
    """File name, size and modification time of an encoder's file (or its folder's shards): what
    changes when the file is replaced. ``stat`` only: the file is not opened."""
    path = Path(source)
    try:
        files = sorted(path.glob("**/*.safetensors")) if path.is_dir() else [path]
        parts = [f"{f.name}:{(st := f.stat()).st_size}:{st.st_mtime_ns}" for f in files]
    except OSError:
        return None
    return "|".join(parts) if parts else None


def encoder_identity(source: str | os.PathLike, dtype: torch.dtype, device: torch.device | str,
                     quantize: str | None = None) -> str | None:
    """What a cached embedding depends on besides the prompt and the options: the encoder file (by
    ``stat``), the dtype it is loaded in, how it is quantised and the device type it runs on.
    None when ``source`` is not a file (an in-memory model)."""
    files = _source_identity(source)
    if files is None:
        return None
    return f"{files}|{str(dtype).removeprefix('torch.')}|{quantize}|{torch.device(device).type}"


def identity_of(encoder: Any, device: torch.device | str | None = None) -> str | None:
    """:func:`encoder_identity` of a loaded encoder computing on ``device`` (default: where its
    embedding table is); None for encoders not loaded from a file or carrying LoRAs."""
    source = getattr(encoder, "source", None)
    if not source or has_loras(encoder):
        return None
    weight = encoder.embed_tokens.weight
    return encoder_identity(source, weight.dtype, weight.device if device is None else device,
                            getattr(encoder, "quantize", None))


class DiskPromptCache:
    """Prompt embeddings in a folder, bounded in bytes (least recently used files go first).

    One ``.safetensors`` file per (encoder identity, options, padded length, prompt), named by a
    hash of them; a hit refreshes the file's time. Files that cannot be read are removed and
    counted as misses. Safe to share between processes (files are written atomically).
    """

    def __init__(self, folder: str | os.PathLike, max_bytes: int = 2 << 30) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.hits = 0
        self.misses = 0

    def _path(self, identity: str, prompt: str, length: int, options: TextOptions) -> Path:
        key = json.dumps([identity, options.key(), length, prompt], ensure_ascii=True)
        return self.folder / (hashlib.sha256(key.encode()).hexdigest() + ".safetensors")

    def get(self, identity: str, prompt: str, length: int, options: TextOptions) -> torch.Tensor | None:
        """The embedding ``[1, length, text_dim]`` stored for this key, or None."""
        path = self._path(identity, prompt, length, options)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            emb = open_safetensors(path).read("embedding")
            os.utime(path)  # recently used
        except (OSError, WeightFormatError, KeyError) as exc:
            logger.warning("prompt cache: removing unreadable %s (%s)", path.name, exc)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return emb

    def put(self, identity: str, prompt: str, length: int, options: TextOptions, emb: torch.Tensor) -> None:
        """Store an embedding; a folder that cannot be written is logged, never raised (the
        embedding was computed and is returned either way)."""
        from safetensors.torch import save_file

        path = self._path(identity, prompt, length, options)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            os.close(fd)
            save_file({"embedding": emb.detach().to("cpu").contiguous()}, tmp,
                      metadata={"prompt": prompt[:2000], "encoder": identity.split("|", 1)[0]})
            os.replace(tmp, path)  # atomic: a reader never sees half a file
            self._evict()
        except OSError as exc:
            logger.warning("prompt cache: cannot write to %s (%s); this prompt is cached in memory only",
                           self.folder, exc.strerror or exc)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _evict(self) -> None:
        files = []
        for p in self.folder.glob("*.safetensors"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))


class PromptCache(BoundedCache[torch.Tensor]):
    """Bounded LRU of prompt embeddings per (encoder, prompt, options), over an optional disk cache.

    Entries of an encoder loaded from a file are keyed by its identity (:func:`encoder_identity`),
    so :meth:`cached` can answer before the encoder is loaded; other entries hold a weak reference
    to their encoder, so a freed or reloaded encoder never serves stale embeddings. Entries own
    their memory; the cache is bounded by entry count and by bytes.
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 1 << 30, disk: DiskPromptCache | None = None) -> None:
        super().__init__(max_entries, max_bytes, lambda t: t.numel() * t.element_size())
        self.disk = disk

    def clear(self) -> None:
        """Forget the in-memory entries (the disk cache, if any, is kept)."""
        super().clear()

    def _store(self, key: tuple, encoder: Any, emb: torch.Tensor) -> None:
        # A copy: a slice of the batch output would keep the whole batch alive, and the byte cap
        # would count only the slice.
        super()._store(key, encoder, emb.clone())

    def _find(self, identity: str | None, encoder: Any, prompts: Sequence[str], options: TextOptions,
              length: int) -> dict[str, torch.Tensor | None]:
        owner = None if identity is not None else encoder
        found: dict[str, torch.Tensor | None] = {}
        with self._lock:
            for p in prompts:
                found[p] = self._lookup((identity or id(encoder), p, length, options.key()), owner)
        if identity is not None and self.disk is not None:
            for p in [p for p, e in found.items() if e is None]:
                emb = self.disk.get(identity, p, length, options)
                if emb is not None:
                    found[p] = emb
                    with self._lock:
                        self._store((identity, p, length, options.key()), None, emb)
        return found

    def cached(self, identity: str | None, prompts: Sequence[str],
               options: TextOptions = TextOptions()) -> torch.Tensor | None:
        """Embeddings ``[len(prompts), length, text_dim]`` when every prompt is cached (in memory or
        on disk) for the encoder with this identity, else None; the encoder need not be loaded.
        Embeddings read from disk are on the CPU."""
        if identity is None or not prompts:
            return None
        found = self._find(identity, None, prompts, options, options.length(prompts))
        if any(e is None for e in found.values()):
            return None
        self.hits += len(prompts)
        return torch.cat([found[p] for p in prompts])  # type: ignore[misc]

    def encode(self, encoder: Any, prompts: Sequence[str], options: TextOptions | int = TextOptions(), *,
               identity: str | None = None) -> torch.Tensor:
        """Embeddings ``[len(prompts), length, text_dim]``; only prompts found in neither cache are
        encoded. ``options`` may be a plain max length (the older signature). ``identity`` (see
        :func:`identity_of`) defaults to the encoder's own, on the device its weights are on."""
        if isinstance(options, int):
            options = TextOptions(max_tokens=options)
        length = options.length(prompts)
        if has_loras(encoder):  # its outputs change with the LoRAs: nothing cached is valid for it
            logger.debug("prompt cache bypassed: the text encoder carries LoRAs")
            return _encode(encoder, list(prompts), options, length)
        identity = identity if identity is not None else identity_of(encoder)
        found = self._find(identity, encoder, prompts, options, length)
        device = encoder.embed_tokens.weight.device
        found = {p: None if e is None else e.to(device) for p, e in found.items()}
        todo = [p for p, e in found.items() if e is None]
        self.hits += len(prompts) - len(todo)
        if todo:
            self.misses += len(todo)
            embs = _encode(encoder, todo, options, length)
            owner = None if identity is not None else encoder
            with self._lock:
                for p, e in zip(todo, embs):
                    found[p] = e[None]
                    self._store((identity or id(encoder), p, length, options.key()), owner, e[None])
            if identity is not None and self.disk is not None:
                for p in todo:
                    self.disk.put(identity, p, length, options, found[p])  # type: ignore[arg-type]
        return torch.cat([found[p] for p in prompts])  # type: ignore[misc]


def _encode(encoder: Any, prompts: list[str], options: TextOptions, length: int) -> torch.Tensor:
    ids, mask = tokenize_prompts(prompts, max_length=length, truncate=options.truncate)
    if options.activations is None:
        return encoder.encode(ids, mask)
    return encoder.encode(ids, mask, activations=options.activations)


default_prompt_cache = PromptCache()


def encode_prompts(
    text_encoder: Any, prompts: Sequence[str], *, cache: PromptCache | None = default_prompt_cache,
    max_length: int = MAX_LENGTH, options: TextOptions | None = None, identity: str | None = None,
) -> torch.Tensor:
    """Tokenize and encode prompts: ``[len(prompts), length, text_dim]``, cached by default.

    ``options`` (:class:`TextOptions`) chooses the BFL / diffusers or the ComfyUI way; without it,
    prompts are cut at ``max_length`` and encoded in the model dtype. ``identity``: the cache key
    of the encoder (:func:`identity_of` with the compute device); default: derived from it.
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings; wrap a single prompt as [prompt]")
    options = options or TextOptions(max_tokens=max_length)
    if cache is None:
        return _encode(text_encoder, list(prompts), options, options.length(prompts))
    return cache.encode(text_encoder, list(prompts), options, identity=identity)


__all__ = ["COMFYUI_TEXT", "DiskPromptCache", "PromptCache", "TextOptions", "default_prompt_cache", "encode_prompts",
           "encoder_identity", "identity_of"]
