"""Every use of the ComfyUI host (``comfy.*``, ``folder_paths``) in one place.

The imports happen inside the functions, at call time, so the other modules import without touching
the host's model management (no CUDA initialisation at import or schema time), and tests can patch
``comfy.model_management`` attributes and see the patch take effect.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def _mm():
    import comfy.model_management

    return comfy.model_management


# ----- devices and dtypes ---------------------------------------------------------------------------


def torch_device() -> torch.device:
    """Where the transformer computes (the GPU, or the CPU under ``--cpu``)."""
    return _mm().get_torch_device()


def text_encoder_device() -> torch.device:
    return _mm().text_encoder_device()


def vae_device() -> torch.device:
    return _mm().vae_device()


def vae_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the host would use it for a VAE, else fp32 (honours --fp32-vae / --bf16-vae)."""
    return _mm().vae_dtype(device, [torch.bfloat16])


def intermediate_device() -> torch.device:
    """Where IMAGE and LATENT outputs live (the CPU unless ``--gpu-only``)."""
    return _mm().intermediate_device()


def offload_device() -> torch.device:
    return _mm().unet_offload_device()


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 natively: CUDA GPUs from Ampere (sm_80) on, ROCm, other devices.

    Not ``torch.cuda.is_bf16_supported()``: that asks about the current device rather than
    ``device`` (``cuda:1`` may be another GPU), and by default it also says yes on older GPUs,
    where bf16 only runs emulated (slowly); those compute in fp16 instead."""
    if device.type == "cuda":
        if torch.version.hip is not None:
            return True  # what torch answers for ROCm devices
        return torch.cuda.get_device_properties(device).major >= 8
    return True


# ----- memory ---------------------------------------------------------------------------------------


def free_bytes(device: torch.device) -> int:
    return int(_mm().get_free_memory(device))


def make_room(nbytes: int, device: torch.device) -> None:
    """Ask ComfyUI to unload its own models until ``nbytes`` fit on ``device``."""
    if device.type != "cpu":
        _mm().free_memory(nbytes, device)


def empty_cache() -> None:
    _mm().soft_empty_cache()


_HOLDERS: dict[str, type] = {}


def _holder(role: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` inside a plain module named after its role ("KleinTransformer"...), which ComfyUI
    logs and may set attributes on (our models' ``device`` is a read-only property)."""
    cls = _HOLDERS.get(role)
    if cls is None:
        def __init__(self, inner: torch.nn.Module) -> None:
            torch.nn.Module.__init__(self)
            self.inner = inner

        name = "Klein" + "".join(part.title() for part in role.split("_"))
        cls = _HOLDERS[role] = type(name, (torch.nn.Module,), {"__init__": __init__})
    return cls(model)


def _patcher_class() -> type:
    import comfy.model_patcher

    class KleinModelPatcher(comfy.model_patcher.ModelPatcher):
        """A ModelPatcher that offloads a Klein model whole: klein_core's modules run on one device
        (or are streamed by klein_core itself), never split across devices by ComfyUI."""

        def partially_unload(self, *args, **kwargs):
            return 0  # nothing freed partially: ComfyUI then detaches (offloads) the whole model

    return KleinModelPatcher


def register_model(model: torch.nn.Module, role: str, device: torch.device) -> object:
    """Hand a loaded model to ComfyUI's model management; returns its handle (a ModelPatcher), to be
    kept exactly as long as the model. ComfyUI may then offload the model when another one needs the
    GPU, and ``use_models`` brings it back."""
    return _patcher_class()(_holder(role, model), load_device=device, offload_device=offload_device())


def use_models(handles: list, memory_required: int = 0) -> None:
    """Before a node runs its models: ComfyUI frees ``memory_required`` bytes beyond them (unloading
    other models) and puts every one wholly on its device."""
    _mm().load_models_gpu(list(handles), memory_required=int(memory_required), force_full_load=True)


def install_unload_hook(on_unload: Callable[[], object]) -> bool:
    """Call ``on_unload()`` whenever ComfyUI unloads all models (``POST /free``, OOM recovery,
    ``--disable-smart-memory``). Wraps ``comfy.model_management.unload_all_models`` once, chaining to
    the original; returns False if it was already wrapped."""
    mm = _mm()
    original = mm.unload_all_models
    if getattr(original, "_klein_unload_hook", False):
        return False

    @functools.wraps(original)
    def unload_all_models(*args, **kwargs):
        try:
            on_unload()
        except Exception:  # never let the pack break ComfyUI's own unloading
            logger.exception("Klein: releasing cached models failed")
        return original(*args, **kwargs)

    unload_all_models._klein_unload_hook = True
    mm.unload_all_models = unload_all_models
    return True


# ----- progress, interrupt, previews ----------------------------------------------------------------


def check_interrupt() -> None:
    """Raise ComfyUI's InterruptProcessingException if Cancel was pressed (``POST /interrupt``)."""
    _mm().throw_exception_if_processing_interrupted()


def progress_bar(total: int):
    import comfy.utils

    return comfy.utils.ProgressBar(total)


def show_node_text(text: str) -> None:
    """``text`` on the executing node in the frontend (``PromptServer.send_progress_text``, which both
    host versions have); nothing on an older or headless host (the caller logs the text anyway)."""
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer

        context = get_executing_context()
        server = getattr(PromptServer, "instance", None)
        if context is None or server is None:
            return
        server.send_progress_text(text, context.node_id, getattr(server, "client_id", None))
    except (ImportError, AttributeError, OSError, RuntimeError, TypeError, ValueError):
        logger.debug("could not send a node's text to the frontend", exc_info=True)


def previews_enabled() -> bool:
    """True when a progress hook is installed and the host's --preview-method is not "none"."""
    import comfy.utils
    from comfy.cli_args import LatentPreviewMethod, args

    return comfy.utils.PROGRESS_BAR_HOOK is not None and args.preview_method != LatentPreviewMethod.NoPreviews


def preview_size() -> int:
    from comfy.cli_args import args

    return int(args.preview_size)


def latent_previewer(device: torch.device) -> Callable[[torch.Tensor], tuple] | None:
    """ComfyUI's own previewer for FLUX.2 latents, as its samplers use it: TAEF2 with
    ``--preview-method taesd`` and a ``taef2_decoder*`` file in models/vae_approx (hosts that know
    TAEF2), else the latent->RGB map. Returns ``x0 [B, 128, h, w] -> ("JPEG", image, max size)``,
    or None when the host has no previewer for FLUX.2 (or previews are off). Built once per run:
    the host loads the TAEF2 weights each time it is asked."""
    try:
        import comfy.latent_formats
        import latent_preview

        previewer = latent_preview.get_previewer(device, comfy.latent_formats.Flux2())
    except Exception:  # an older host without Flux2 previews, or a broken approx file
        logger.warning("Klein: ComfyUI's FLUX.2 previewer is unavailable; using the pack's own latent preview",
                       exc_info=logger.isEnabledFor(logging.DEBUG))
        return None
    if previewer is None:
        return None
    return lambda x0: previewer.decode_latent_to_preview_image("JPEG", x0[:1])


def flux2_latent_rgb() -> tuple[torch.Tensor, torch.Tensor] | None:
    """ComfyUI's Flux2 latent->RGB factors ``([32, 3], [3])`` for un-patchified latents, if it has them."""
    try:
        import comfy.latent_formats

        fmt = comfy.latent_formats.Flux2()
        factors = torch.tensor(fmt.latent_rgb_factors, dtype=torch.float32)
        bias = torch.tensor(fmt.latent_rgb_factors_bias or [0.0, 0.0, 0.0], dtype=torch.float32)
    except (ImportError, AttributeError, TypeError):
        return None
    return (factors, bias) if factors.shape == (32, 3) else None


# ----- model folders --------------------------------------------------------------------------------


def filename_list(folder: str, extra_extensions: tuple[str, ...] = ()) -> list[str]:
    """The files ComfyUI lists for a models folder, plus files with ``extra_extensions`` (e.g.
    ".gguf", which ComfyUI's own lists leave out) found in the same folders."""
    import folder_paths

    names = list(folder_paths.get_filename_list(folder))
    if extra_extensions:
        seen = set(names)
        for root in folder_paths.get_folder_paths(folder):
            if not os.path.isdir(root):
                continue
            for dirpath, _, files in os.walk(root, followlinks=True):
                for f in files:
                    if f.lower().endswith(extra_extensions):
                        rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                        if rel not in seen:
                            seen.add(rel)
                            names.append(rel)
        names.sort()
    return names


def full_path(folder: str, name: str) -> str | None:
    import folder_paths

    return folder_paths.get_full_path(folder, name)


def folder_paths_of(folder: str) -> list[str]:
    import folder_paths

    return folder_paths.get_folder_paths(folder)
