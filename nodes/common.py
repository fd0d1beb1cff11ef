"""Small helpers shared by the nodes: model files by folder, errors that name the node input, and
the engine a node runs (:func:`open_engine`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

import klein_core as kc
from klein_core.files.identify import FileInfo, probe

from . import cache, host

logger = logging.getLogger(__name__)

# What a file picked in the wrong place is, for a one-line hint (catalog kinds -> where it belongs).
_KINDS = {
    "transformer": ("a Klein diffusion model", "Klein Model Loader's model_name"),
    "text_encoder": ("a Qwen3 text encoder", "Qwen3 Layer-Concat Encoder's text_encoder"),
    "vae": ("a FLUX.2 VAE", "Klein Model Loader's vae_name"),
}


def model_file(node: str, input_name: str, folder: str, name: str, expect: str) -> str:
    """Absolute path of ``name`` in the ``folder`` models folder; ``expect`` is the catalog kind wanted.

    Raises a ValueError naming the node, the input and the fix when the file is missing or is another
    kind of Klein component (read from the safetensors header only).
    """
    path = host.full_path(folder, name)
    if path is None:
        # The folders themselves go to the server log only: API clients see no server paths.
        logger.info("%s: %s '%s' is in none of the %s folders: %s", node, input_name, name, folder,
                    ", ".join(host.folder_paths_of(folder)) or "(none configured)")
        raise ValueError(f"{node}: {input_name} '{name}' was not found in models/{folder} (or the {folder} "
                         f"folders added in extra_model_paths.yaml). Put the file there and refresh, or pick "
                         f"another file.")
    info = _probe(path)
    if info.kind in _KINDS and info.kind != expect:
        (noun, where), wanted = _KINDS[info.kind], _KINDS[expect][0]
        raise ValueError(f"{node}: {input_name} '{name}' is {noun} ({info.description}), not {wanted}: "
                         f"use it in {where}, and pick {wanted} here.")
    return path


def _probe(path: str) -> FileInfo:
    """:func:`probe` of ``path``, remembered while the file keeps its size and modification time: the
    encoder node checks its file on every new prompt, and parsing a header of a few hundred tensors
    costs about a millisecond each time (CPU, measured), while the GPU waits for the node."""
    try:
        st = os.stat(path)
    except OSError:
        return probe(path)  # says "unreadable" itself
    return _probe_state(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _probe_state(path: str, size: int, mtime_ns: int) -> FileInfo:
    """:func:`probe` of ``path`` as it is at ``size`` and ``mtime_ns`` (the cache's key)."""
    return probe(path)


def file_state(folder: str, name: object) -> tuple | None:
    """What identifies the file ``name`` of a models folder on disk now (its name, size and
    modification time), for a node's ``fingerprint_inputs``: ComfyUI reuses a node's cached output
    while its widget values stay the same, so a file replaced under the same name (a re-downloaded or
    converted model) would otherwise keep being served from the old output. None when not found."""
    if not isinstance(name, str) or not name:
        return None
    path = host.full_path(folder, name)
    try:
        stat = os.stat(path) if path else None
    except OSError:  # deleted since it was listed: the node reports that by name when it runs
        stat = None
    return (name, stat.st_size, stat.st_mtime_ns) if stat else (name, None, None)


@contextlib.contextmanager
def errors_named(node: str, input_name: str, name: str) -> Iterator[None]:
    """Re-raise loader errors (wrong format, missing tensors) with the node and input in front."""
    try:
        yield
    except (ValueError, OSError) as exc:
        raise ValueError(f"{node}: {input_name} '{name}': {exc}") from exc


def check_choices(node: type, folders: dict[str, str], **values: object) -> bool | str:
    """A ``validate_inputs`` for combo inputs: ComfyUI 0.3.75 does not check V3 combo values against
    their options, so a wrong file name would only fail at run time. ``folders`` maps file inputs to
    their models folder, for the hint."""
    inputs = node.define_schema().inputs
    options = {i.id: i.options for i in inputs if getattr(i, "options", None) is not None}
    for name, value in values.items():
        choices = options.get(name)
        if value is None or choices is None or value in choices:
            continue
        listed = ", ".join(map(str, choices[:8])) + (", ..." if len(choices) > 8 else "") or "none"
        where = f"; files are listed from models/{folders[name]} (add the file there, then refresh)" \
            if name in folders else ""
        return f"{name} '{value}' is not available (choices: {listed}){where}"
    return True


def check_widget(node: str, input_name: str, value: object, choices: object) -> None:
    """Refuse a combo value that is not one of ``choices`` (ComfyUI 0.3.75 does not check V3 combos
    when a prompt is queued), naming the node, the input and the choices."""
    if value not in choices:  # type: ignore[operator]
        raise ValueError(f"{node}: {input_name} '{value}' is not one of {', '.join(map(str, choices))}.")  # type: ignore[call-overload]


def flux2_samples(latent: object, channels: int, node: str, input_name: str, hint: str) -> torch.Tensor:
    """``latent["samples"]``, checked to be FLUX.2 latents ``[B, channels, h, w]``; the error names
    ``node`` and ``input_name`` and ends with ``hint`` (where such latents come from)."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.ndim != 4 or samples.shape[1] != channels:
        shape = list(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"{node}: {input_name} must be FLUX.2 latents [batch, {channels}, height/16, width/16]"
                         f"{hint}, got {shape}.")
    return samples


def resize_image(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE ``[B, H, W, C]`` resized (antialiased bicubic), kept in 0..1; as given at its size."""
    if images.shape[1:3] == (height, width):
        return images
    x = images.movedim(-1, 1).float()
    x = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return x.clamp(0, 1).movedim(1, -1).to(images.dtype)


def open_engine(node: str, models: Mapping[str, tuple[str, cache.ModelRef]], **engine_kw: Any) -> kc.Engine:
    """The one way a node runs klein_core: load ``models`` (role -> (node input, model ref)), errors
    named by node and input, and an :class:`~klein_core.Engine` over them whose memory plan (made once
    per stage call) asks ComfyUI to make room through its model management."""
    loaded = {}
    for role, (input_name, ref) in models.items():
        with errors_named(node, input_name, ref.name):
            loaded[role] = ref.get()
    refs = [ref for _, ref in models.values()]
    return kc.Engine(**loaded, make_room=cache.room_for(refs), check_cancel=host.check_interrupt, **engine_kw)
