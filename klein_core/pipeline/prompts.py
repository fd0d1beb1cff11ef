"""Prompts -> embeddings: tokenize, encode with the Qwen3 encoder, and cache repeated prompts.

:class:`PromptCache` combines a bounded in-memory LRU per loaded encoder (entries own their memory)
with an optional :class:`DiskPromptCache`, keyed by the encoder file's identity (name, size,
modification time; the file is never opened), the weights' dtype and device type, the
:class:`TextOptions` and the prompt: a prompt seen before, even before a restart, needs neither the
encoder's weights nor its file. :class:`TextOptions` picks the BFL / diffusers way (model dtype,
prompts cut at 512 tokens; the default) or ComfyUI's (fp32 activations, never cut, padded to 512+),
and may trim the padding (opt-in, approximate).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..checks import Checks, is_finite
from ..errors import WeightFormatError
from ..files.loaders import as_dtype, source_stamp
from ..files.safetensors import open_safetensors
from ..lora.apply import has_loras
from ..transfer import to_device
from .bounded_cache import BoundedCache, check_bound
from .reference_kv import weights_state
from .tokenizer import MAX_LENGTH, _check_prompts, count_tokens, tokenize_prompts, warn_cut

logger = logging.getLogger(__name__)


# TextOptions.trim of the CLI's --trim-padding and the encoder node's trimmed choice: tensor-core
# friendly, and at most 8 lengths up to 512 (under compile, each its own text-encoder CUDA graph).
TRIM_MULTIPLE = 64


@dataclass(frozen=True)
class TextOptions:
    """How prompts become embeddings.

    ``max_tokens``: 512 cuts longer prompts (BFL, diffusers); None keeps every token, padding to at
    least 512 (ComfyUI). ``activations``: None computes in the model dtype (BFL, diffusers);
    ``torch.float32`` computes in fp32 with the weights cast one layer at a time (ComfyUI).

    ``trim`` (opt-in, approximate): pad only to the longest prompt's token count rounded up to a
    multiple of ``trim`` (at most ``max_tokens``), not to 512: a 40-token prompt at 1024x1024 makes
    4096 + 64 tokens per step instead of 4096 + 512. The prompt's own tokens encode as before (Qwen3
    is causal: right padding never reaches them); what changes is that the transformer no longer
    attends to the padding tokens' embeddings, and Klein was trained with them. Check the difference
    on your weights (:func:`klein_core.accel.relative_l2` against a run without it).
    """

    max_tokens: int | None = MAX_LENGTH
    activations: torch.dtype | None = None
    trim: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None (the whole prompt), got {self.max_tokens!r}")
        if self.activations is not None and (not isinstance(self.activations, torch.dtype)
                                             or not self.activations.is_floating_point):
            raise ValueError(f"activations must be None (the model dtype) or a float dtype, got {self.activations!r}")
        if self.trim is not None and (isinstance(self.trim, bool) or not isinstance(self.trim, int) or self.trim < 1):
            raise ValueError(f"trim must be None (pad to {MAX_LENGTH}) or a positive int (pad to a multiple of it), "
                             f"got {self.trim!r}")

    @property
    def truncate(self) -> bool:
        return self.max_tokens is not None

    def length(self, prompts: Sequence[str]) -> int:
        """The padded token length these prompts are encoded at."""
        if self.trim is not None:
            longest = max((count_tokens(p) for p in prompts), default=1)
            trimmed = -(-longest // self.trim) * self.trim
            return trimmed if self.max_tokens is None else min(trimmed, self.max_tokens)
        if self.max_tokens is not None:
            return self.max_tokens
        return max([MAX_LENGTH, *(count_tokens(p) for p in prompts)])

    def key(self) -> tuple:
        # ``trim`` is left out: it only chooses the length, which is part of every cache key, and a
        # prompt encoded at one length gives the same embedding however that length was chosen.
        return (self.max_tokens, str(self.activations))


COMFYUI_TEXT = TextOptions(max_tokens=None, activations=torch.float32)


def _identity(files: str | None, dtype: torch.dtype, device: torch.device | str, quantize: str | None) -> str | None:
    if files is None:
        return None
    return f"{files}|{str(dtype).removeprefix('torch.')}|{quantize}|{torch.device(device).type}"


def encoder_identity(source: str | os.PathLike, dtype: torch.dtype, device: torch.device | str,
                     quantize: str | None = None, *, component: str = "text_encoder") -> str | None:
    """What a cached embedding depends on besides the prompt and the options: the files that loading
    ``source`` reads (by ``stat``: weights, shard index and ``config.json``, a repo root's
    ``text_encoder/`` as the loader picks it; see :func:`~klein_core.files.loaders.source_stamp`), the
    dtype it is loaded in, how it is quantised and the device type it runs on. ``component="vae"``
    names a VAE the same way (the trainer's latent cache). None when ``source`` is not a file (an
    in-memory model). ``dtype`` may be named as the loaders take it (``"bf16"``): the identity is the
    same as for the dtype itself, so a prompt cached by a loaded encoder is found."""
    return _identity(source_stamp(source, component), as_dtype(dtype, "encoder_identity"), device, quantize)


def loaded_encoder_identity(encoder: Any, device: torch.device | str | None = None) -> str | None:
    """:func:`encoder_identity` of a loaded encoder computing on ``device`` (default: where its
    embedding table is), for its files as they were when it was loaded (a file replaced since keeps
    its old identity for these weights); None for encoders not loaded from a file or carrying LoRAs."""
    source = getattr(encoder, "source", None)
    if not source or has_loras(encoder):
        return None
    recorded = getattr(encoder, "source_stamp", None)  # (source, stamp) set by load_text_encoder
    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[0] == source:
        files = recorded[1]
    else:  # a source named by hand: its files as they are now
        files = source_stamp(source, "text_encoder")
    weight = encoder.embed_tokens.weight
    return _identity(files, weight.dtype, weight.device if device is None else device, getattr(encoder, "quantize", None))


_FORMAT = "klein-prompt-embedding/1"  # the ``format`` metadata of entries written by this code
_OLD_METADATA = {"encoder", "prompt"}  # all the metadata entries had before ``format`` existed
_ENTRY = re.compile(r"[0-9a-f]{64}\.safetensors")  # only such files are read, counted and evicted
_TMP_PREFIX = ".klein-prompt-"
_STALE_TMP_S = 600  # a temporary file this old was left by a killed writer
_MAX_WIDTH = 1 << 16  # far above any text encoder's width: an entry wider is not read
_READ_TRIES = 3  # a file replaced or touched while being read is read again


def _encoder_width(encoder: Any) -> int | None:
    width = getattr(getattr(encoder, "config", None), "text_dim", None)
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def _file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_stamp_lock = threading.Lock()
_last_stamp = 0


def _stamp() -> int:
    """A file time in ns, later than every one this process stamped before. The kernel's own file
    clock is coarse (one tick is a few ms), so an entry read right after another was written got the
    same time and the eviction order between them was a coin toss; stamped times keep the use order."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1)
        return _last_stamp


def _touch(path: Path) -> None:
    """Mark ``path`` as used now (raises what ``os.utime`` raises)."""
    stamp = _stamp()
    try:
        os.utime(path, ns=(stamp, stamp))
    except PermissionError:
        os.utime(path)  # setting a given time needs the owner; "now" only write access (another user's entry)


class _BadEntry(Exception):
    """An entry that is not what this key should hold; the message says why."""


class _OldEntry(Exception):
    """An entry written before entries carried their key, dtype and shape."""


class DiskPromptCache:
    """Prompt embeddings in a folder, bounded in bytes (least recently used files go first).

    One ``.safetensors`` file per (encoder identity, options, padded length, prompt), named by a
    hash of them, holding the tensor ``embedding`` and, as metadata, that hash, its dtype and its
    width. Each read checks all of them, the shape and that every value is finite; an entry that
    fails is removed with one warning naming it and counts as a miss. A hit refreshes the file's
    time. Writes are atomic (a temporary file, then a rename). A folder that cannot be written is
    logged once and then only read. Only files named like entries are read, counted or removed.
    """

    def __init__(self, folder: str | os.PathLike, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = check_bound("max_bytes", max_bytes)
        self.folder = Path(folder).expanduser()  # "~/.cache/..." (as in the docs) is the home folder, not "./~"
        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"the prompt cache folder {self.folder} is a file, not a folder",
                                     str(self.folder))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write_error: str | None = None  # why writing stopped, once it has
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._kept_bad: set[tuple[Path, tuple[int, int, int, int]]] = set()  # bad entries that could not be removed
        self._old_seen = False

    def _key(self, identity: str, prompt: str, length: int, options: TextOptions) -> str:
        key = json.dumps([identity, options.key(), length, prompt], ensure_ascii=True)
        return hashlib.sha256(key.encode()).hexdigest()

    def _path(self, identity: str, prompt: str, length: int, options: TextOptions) -> Path:
        return self.folder / (self._key(identity, prompt, length, options) + ".safetensors")

    def _cannot_write(self, exc: BaseException) -> None:
        """Stop writing to the folder, with one warning naming it and ``exc``."""
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
        with self._lock:
            if self.write_error is not None:
                return
            self.write_error = reason
        logger.warning("prompt cache: cannot write to %s (%s); prompt embeddings are no longer stored there "
                       "(entries already there are still read)", self.folder, reason)

    def get(self, identity: str, prompt: str, length: int, options: TextOptions,
            width: int | None = None) -> torch.Tensor | None:
        """The embedding ``[1, length, width]`` stored for this key, or None. ``width``: the width
        the encoder produces, if known (an entry of another width is bad)."""
        key = self._key(identity, prompt, length, options)
        path = self.folder / (key + ".safetensors")
        for _ in range(_READ_TRIES):
            try:
                before = _file_identity(os.stat(path))
            except OSError:
                break
            if (path, before) in self._kept_bad:
                break
            try:
                emb = self._read(path, key, length, width)
            except (OSError, WeightFormatError, _BadEntry, _OldEntry) as exc:
                try:
                    now = _file_identity(os.stat(path))
                except FileNotFoundError:
                    break  # removed meanwhile (evicted by another writer): a miss
                except OSError:
                    now = before
                if now != before:
                    continue  # replaced or touched meanwhile: read the file as it is now
                self._discard(path, before, exc)
                break
            if self.write_error is None:
                try:
                    _touch(path)  # recently used
                except (FileNotFoundError, PermissionError):
                    pass  # gone, or another user's file: only its place in the eviction order is lost
                except OSError as exc:
                    self._cannot_write(exc)
            self.hits += 1
            return emb
        self.misses += 1
        return None

    def _read(self, path: Path, key: str, length: int, width: int | None) -> torch.Tensor:
        """The checked embedding in ``path``; raises what is wrong with it."""
        sf = open_safetensors(path, "prompt cache entry")
        meta = sf.metadata
        if meta.get("format") != _FORMAT:
            if set(meta) == _OLD_METADATA and set(sf.tensors) == {"embedding"}:
                raise _OldEntry
            raise _BadEntry(f"it is not a prompt cache entry (format {meta.get('format')!r}, expected {_FORMAT!r})")
        if set(sf.tensors) != {"embedding"}:
            raise _BadEntry(f"it holds the tensors {sorted(sf.tensors)[:8]}, not one tensor 'embedding'")
        if meta.get("key") != key:
            raise _BadEntry("its key does not match: it was written for another prompt, encoder or options")
        info = sf.tensors["embedding"]
        if not info.dtype.is_floating_point:
            raise _BadEntry(f"dtype {str(info.dtype).removeprefix('torch.')} is not a floating-point type")
        if meta.get("dtype") != str(info.dtype).removeprefix("torch."):
            raise _BadEntry(f"dtype {str(info.dtype).removeprefix('torch.')}, but {meta.get('dtype')!r} was written")
        stored_width = meta.get("width", "")
        if not re.fullmatch(r"[0-9]{1,9}", stored_width):
            raise _BadEntry(f"its width metadata {stored_width!r} is not a number")
        expected_width = width if width is not None else int(stored_width)
        if width is not None and int(stored_width) != width:
            raise _BadEntry(f"it was written with width {stored_width}; the encoder produces {width}")
        expected = (1, length, expected_width)
        if tuple(info.shape) != expected:
            raise _BadEntry(f"shape {list(info.shape)}, expected {list(expected)}")
        if not 0 < expected_width <= _MAX_WIDTH:
            raise _BadEntry(f"width {expected_width} is not a text encoder's")
        emb = sf.read("embedding")
        if not is_finite(emb):
            raise _BadEntry("it holds NaN or infinite values")
        return emb

    def _discard(self, path: Path, seen: tuple[int, int, int, int], exc: BaseException) -> None:
        """Remove the bad (or outdated) entry ``path`` last seen as ``seen``; a warning names it."""
        removed = False
        if self.write_error is None:
            try:
                st = os.stat(path)
                if not stat.S_ISDIR(st.st_mode):  # a folder in an entry's place is left alone
                    if _file_identity(st) == seen:  # not a good entry written meanwhile
                        path.unlink()
                    removed = True
            except FileNotFoundError:
                removed = True
            except OSError as err:
                self._cannot_write(err)
        if not removed:
            self._kept_bad.add((path, seen))
        if isinstance(exc, _OldEntry):
            logger.debug("prompt cache: %s was written by an older version; encoding its prompt again", path)
            if not self._old_seen:
                self._old_seen = True
                logger.info("prompt cache: entries in %s written by an older version are encoded again once",
                            self.folder)
            return
        reason = str(exc).removeprefix(f"{path}: ").removesuffix(" Download it again.") or type(exc).__name__
        if removed:
            logger.warning("prompt cache: removing unreadable entry %s (%s); its prompt is encoded again", path, reason)
        else:
            logger.warning("prompt cache: ignoring unreadable entry %s (%s); it cannot be removed, so its prompt is "
                           "encoded each time", path, reason)

    def put(self, identity: str, prompt: str, length: int, options: TextOptions, emb: torch.Tensor) -> None:
        """Store an embedding ``[1, length, width]``. A folder that cannot be written is logged once,
        never raised, and not written again."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        if (not isinstance(emb, torch.Tensor) or emb.dim() != 3 or emb.shape[0] != 1 or emb.shape[1] != length
                or not emb.dtype.is_floating_point):
            raise ValueError(f"DiskPromptCache.put: expected a float embedding [1, {length}, width], got "
                             f"{getattr(emb, 'dtype', type(emb).__name__)} {list(getattr(emb, 'shape', []))}")
        if self.write_error is not None:
            return
        key = self._key(identity, prompt, length, options)
        tensor = emb.detach().to("cpu").contiguous()
        metadata = {"format": _FORMAT, "key": key, "dtype": str(tensor.dtype).removeprefix("torch."),
                    "width": str(tensor.shape[2]), "prompt": prompt[:2000],
                    # an encoder file name that is not UTF-8 (read with surrogate escapes): as escapes
                    "encoder": identity.encode("utf-8", "backslashreplace").decode("utf-8")}
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=_TMP_PREFIX, suffix=".tmp")
            os.close(fd)
            save_file({"embedding": tensor}, tmp, metadata=metadata)
            try:
                _touch(Path(tmp))  # ordered against the times of entries read (see _stamp)
            except OSError:
                pass  # a file system that keeps its own times: the write time stands
            path = self.folder / (key + ".safetensors")
            os.replace(tmp, path)  # atomic: a reader never sees half a file
            tmp = None
            self._evict(keep=path)
        except (OSError, SafetensorError) as exc:
            self._cannot_write(exc)
        except UnicodeError as exc:  # text the metadata cannot hold: this entry only is not kept
            logger.warning("prompt cache: not written to %s (%s)", self.folder, exc)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _entries(self, clean: bool = False) -> list[tuple[int, int, Path]]:
        """(modification time, size, path) of every entry; with ``clean``, temporary files left by
        killed writers are removed on the way."""
        found = []
        stale = time.time() - _STALE_TMP_S
        for p in self.folder.iterdir():
            is_tmp = p.name.startswith(_TMP_PREFIX) and p.name.endswith(".tmp")
            if not (is_tmp or _ENTRY.fullmatch(p.name)):
                continue
            try:
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                if is_tmp:
                    if clean and st.st_mtime < stale:
                        p.unlink()
                    continue
            except FileNotFoundError:
                continue
            found.append((st.st_mtime_ns, st.st_size, p))
        return found

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used entries until the folder is within ``max_bytes``; ``keep``
        (the entry just written) goes last, only if it alone is over the bound."""
        files = self._entries(clean=True)
        total = sum(size for _, size, _ in files)
        # Not by time alone: entries timed ahead of the clock (a folder copied from a machine whose
        # clock ran ahead, a clock set back) would make each new entry the oldest, removed as written.
        for _, size, p in sorted(files, key=lambda f: (f[2] == keep, f)):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def size_bytes(self) -> int:
        """Bytes the entries take (0 for a folder that cannot be listed)."""
        try:
            return sum(size for _, size, _ in self._entries())
        except OSError:
            return 0


class PromptCache(BoundedCache[torch.Tensor]):
    """Bounded LRU of prompt embeddings per (encoder, prompt, options), over an optional disk cache.

    Entries of an encoder loaded from a file are keyed by its identity (:func:`encoder_identity`),
    so :meth:`cached` can answer before the encoder is loaded (weights written into such an encoder
    in place are not seen: load the new weights, or :meth:`clear`); other entries hold a weak
    reference to their encoder and the token of its weights, so a freed, reloaded or changed
    encoder never serves stale embeddings. ``disk``: a :class:`DiskPromptCache`, or its folder. Entries own
    their memory; the cache is bounded by entry count and by bytes. Embeddings with NaN or infinite
    values are returned but never cached.
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 1 << 30,
                 disk: DiskPromptCache | str | os.PathLike | None = None) -> None:
        super().__init__(max_entries, max_bytes, lambda t: t.numel() * t.element_size())  # both checked there
        if isinstance(disk, (str, os.PathLike)):  # a folder: the disk cache in it
            disk = DiskPromptCache(disk)
        if disk is not None and not isinstance(disk, DiskPromptCache):
            raise TypeError(f"disk must be a DiskPromptCache or a folder, got {type(disk).__name__}")
        self.disk = disk
        self._widths: dict[str, int] = {}  # encoder identity -> the width it produced (learned by encode)

    def clear(self) -> None:
        """Forget the in-memory entries (the disk cache, if any, is kept)."""
        super().clear()

    def _store(self, key: tuple, encoder: Any, emb: torch.Tensor) -> None:
        # A copy: a slice of the batch output would keep the whole batch alive, and the byte cap
        # would count only the slice.
        super()._store(key, encoder, emb.clone())

    def _find(self, base: str | tuple, identity: str | None, encoder: Any, prompts: Sequence[str],
              options: TextOptions, length: int, width: int | None) -> dict[str, torch.Tensor | None]:
        owner = None if identity is not None else encoder
        found: dict[str, torch.Tensor | None] = {}
        with self._lock:
            for p in prompts:
                key = (base, p, length, options.key())
                emb = self._lookup(key, owner)
                if emb is not None and width is not None and emb.shape[-1] != width:
                    self._data.pop(key, None)  # read from disk before the width was known: check it there
                    emb = None
                found[p] = emb
        if identity is not None and self.disk is not None:
            for p in [p for p, e in found.items() if e is None]:
                emb = self.disk.get(identity, p, length, options, width)
                if emb is not None:
                    found[p] = emb
                    with self._lock:
                        self._store((identity, p, length, options.key()), None, emb)
        return found

    def cached(self, identity: str | None, prompts: Sequence[str], options: TextOptions = TextOptions(), *,
               width: int | None = None, labels: Sequence[str | None] | None = None,
               warn: bool = True) -> torch.Tensor | None:
        """Embeddings ``[len(prompts), length, text_dim]`` when every prompt is cached (in memory or
        on disk) for the encoder with this identity, else None; the encoder need not be loaded.
        ``width``: its text width, if known (else the width it was last seen to produce). The result is
        on the device of the entries the encoder made, or on the CPU when all were read from disk.
        A prompt cut at the length is said when found, as :meth:`encode` says it (``labels``: the
        names of the texts, see :func:`warn_cuts`; ``warn=False`` leaves that to the caller)."""
        if identity is None or not prompts:
            return None
        width = width if width is not None else self._widths.get(identity)
        found = self._find(identity, identity, None, prompts, options, options.length(prompts), width)
        embs = list(found.values())
        if any(e is None for e in embs):
            return None
        if len({(e.shape[-1], e.dtype) for e in embs}) > 1:  # type: ignore[union-attr]
            # Entries that disagree cannot all be the encoder's: the encoder, which knows its width, decides.
            logger.debug("prompt cache: cached embeddings of %d prompts differ in width or dtype", len(embs))
            return None
        self.hits += len(prompts)
        if warn:
            warn_cuts(prompts, options, options.length(prompts), labels)
        ordered = [found[p] for p in prompts]
        # Entries the encoder made are on its device, those read from disk on the CPU: one call can
        # find both (a prompt encoded this session, a negative stored by an earlier one).
        device = next((e.device for e in ordered if e.device.type != "cpu"), ordered[0].device)  # type: ignore[union-attr]
        return torch.cat([to_device(e, device) for e in ordered])  # type: ignore[arg-type]

    def encode(self, encoder: Any, prompts: Sequence[str], options: TextOptions | int = TextOptions(), *,
               identity: str | None = None, checks: Checks | None = None,
               weights: tuple | None = None, labels: Sequence[str | None] | None = None) -> torch.Tensor:
        """Embeddings ``[len(prompts), length, text_dim]``; only prompts found in neither cache are
        encoded. ``options`` may be a plain max length (the older signature). ``identity`` (see
        :func:`loaded_encoder_identity`) defaults to the encoder's own, on the device its weights are on.
        New embeddings are kept once known to be finite: at once, or when ``checks`` (a run's
        :class:`~klein_core.checks.Checks` that defers) resolves, so the host need not wait here.
        ``weights``: for an encoder without identity, the token of its weights where they live
        (:func:`~klein_core.pipeline.reference_kv.weights_state`, taken before a stage placed them);
        default: taken now. ``labels``: the names of the texts in the warning for a cut one (see
        :func:`warn_cuts`)."""
        if isinstance(options, int):
            options = TextOptions(max_tokens=options)
        prompts = _check_prompts(prompts)  # errors that name the prompt, before any lookup
        length = options.length(prompts)
        if has_loras(encoder):  # its outputs change with the LoRAs: nothing cached is valid for it
            logger.debug("prompt cache bypassed: the text encoder carries LoRAs")
            return _encode(encoder, list(prompts), options, length)
        identity = identity if identity is not None else loaded_encoder_identity(encoder)
        width = _encoder_width(encoder)
        if identity is not None and width is not None:
            with self._lock:
                self._widths.pop(identity, None)
                self._widths[identity] = width
                while len(self._widths) > 64:
                    del self._widths[next(iter(self._widths))]
        base = identity or _in_memory(encoder, weights)
        found = self._find(base, identity, encoder, prompts, options, length, width)
        device = encoder.embed_tokens.weight.device
        found = {p: None if e is None else to_device(e, device) for p, e in found.items()}
        todo = [p for p, e in found.items() if e is None]
        self.hits += len(found) - len(todo)  # distinct prompts (one repeated in the call is one)
        warn_cuts(prompts, options, length, labels)  # cached or not, a cut prompt is said
        if todo:
            self.misses += len(todo)
            embs = _encode(encoder, todo, options, length, warn=False)
            owner = None if identity is not None else encoder
            check = checks or Checks()
            for p, e in zip(todo, embs):
                found[p] = e[None]
                # garbage is returned (the caller names it), never cached
                check.when_finite(e, partial(self._keep, base, identity, owner, p, length, options, e[None]))
        return torch.cat([found[p] for p in prompts])  # type: ignore[misc]

    def _keep(self, base: str | tuple, identity: str | None, owner: Any, prompt: str, length: int,
              options: TextOptions, emb: torch.Tensor) -> None:
        """Cache a new embedding ``[1, length, width]`` known to be finite (and write it to disk)."""
        with self._lock:
            self._store((base, prompt, length, options.key()), owner, emb)
        if identity is not None and self.disk is not None:
            self.disk.put(identity, prompt, length, options, emb)


def warn_cuts(prompts: Sequence[str], options: TextOptions, length: int,
              labels: Sequence[str | None] | None = None) -> None:
    """Warn of each prompt cut at ``length`` (none when ``options`` does not truncate), by its place in
    the caller's list or by ``labels[i]`` where given ("negative prompt")."""
    if not options.truncate:
        return
    for index, p in enumerate(prompts):
        if (n := count_tokens(p)) > length:
            warn_cut(index, n, length, labels[index] if labels is not None else None)


def _in_memory(encoder: Any, weights: tuple | None = None) -> tuple:
    """The cache key of an encoder with no file identity (built in memory): the object (held
    weakly by its entries), its weights' dtype and device, which a conversion changes, and the
    token of its weights (:func:`~klein_core.pipeline.reference_kv.weights_state`), which a
    ``load_state_dict`` or any write in place changes; ``weights``: that token as the caller took it
    (before a stage placed the weights on the device: placed copies are new tensors every run)."""
    weight = encoder.embed_tokens.weight
    return id(encoder), str(weight.dtype), str(weight.device), weights_state(encoder) if weights is None else weights


def _encode(encoder: Any, prompts: list[str], options: TextOptions, length: int,
            warn: bool = True) -> torch.Tensor:
    ids, mask = tokenize_prompts(prompts, max_length=length, truncate=options.truncate, warn=warn)
    if options.activations is None:
        return encoder.encode(ids, mask)
    return encoder.encode(ids, mask, activations=options.activations)


default_prompt_cache = PromptCache()


def encode_prompts(
    text_encoder: Any, prompts: Sequence[str], *, cache: PromptCache | None = default_prompt_cache,
    max_length: int = MAX_LENGTH, options: TextOptions | None = None, identity: str | None = None,
    checks: Checks | None = None, weights: tuple | None = None, labels: Sequence[str | None] | None = None,
) -> torch.Tensor:
    """Tokenize and encode prompts: ``[len(prompts), length, text_dim]``, cached by default.

    ``options`` (:class:`TextOptions`) chooses the BFL / diffusers or the ComfyUI way; without it,
    prompts are cut at ``max_length`` and encoded in the model dtype. ``identity``: the cache key
    of the encoder (:func:`loaded_encoder_identity` with the compute device); default: derived from it.
    ``checks``: a run's :class:`~klein_core.checks.Checks`; the cache keeps new embeddings when it
    finds them finite (see :meth:`PromptCache.encode`). ``weights``: see :meth:`PromptCache.encode`.
    ``labels``: the texts' names in the warning for a cut one (default: "prompt <index>").
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings; wrap a single prompt as [prompt]")
    prompts = _check_prompts(prompts)  # errors that name the prompt
    options = options or TextOptions(max_tokens=max_length)
    if cache is None:
        length = options.length(prompts)
        warn_cuts(prompts, options, length, labels)
        return _encode(text_encoder, prompts, options, length, warn=False)
    return cache.encode(text_encoder, list(prompts), options, identity=identity, checks=checks, weights=weights,
                        labels=labels)


__all__ = ["COMFYUI_TEXT", "TRIM_MULTIPLE", "DiskPromptCache", "PromptCache", "TextOptions", "default_prompt_cache",
           "encode_prompts", "encoder_identity", "loaded_encoder_identity", "warn_cuts"]
