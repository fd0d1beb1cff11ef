"""Every use of the ComfyUI host (``comfy.*``, ``folder_paths``) in one place.

The imports happen inside the functions, at call time, so the other modules import without touching
the host's model management (no CUDA initialisation at import or schema time), and tests can patch
``comfy.model_management`` attributes and see the patch take effect.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import sys
from collections.abc import Callable

import torch

from klein_core.accel.text_graph import release_text_graphs
from klein_core.transfer import to_host

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


# Node outputs larger than this cross to the host the ordinary way: a page-locked copy is faster,
# but ComfyUI keeps outputs in its cache, and page-locked memory is locked RAM.
PINNED_OUTPUT_MAX_BYTES = 256 << 20


def to_intermediate(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a node output: on :func:`intermediate_device`, cast to ``dtype`` (where ``t`` is,
    before the copy). A GPU tensor bound for the CPU crosses through page-locked memory
    (``klein_core.transfer.to_host``): a copy to ordinary memory runs at a fraction of the bus speed
    (the engine's decoded pixels: 6.1 ms, H100), and the node waits for it. The result is then
    page-locked CPU memory, an ordinary CPU tensor to every other node."""
    if dtype is not None:
        t = t.to(dtype)
    device = intermediate_device()
    if t.device.type == "cuda" and device.type == "cpu" and t.nbytes <= PINNED_OUTPUT_MAX_BYTES:
        (out,) = to_host(t)
        return out
    return t.to(device)


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

        def detach(self, unpatch_all=True, *args, **kwargs):
            # The text encoder's CUDA graphs hold device memory that ComfyUI does not count as the
            # model's: dropped with the weights, so offloading frees what ComfyUI expects. Only
            # then: load_models_gpu also detaches a model it is about to use again, with
            # unpatch_all=False, which leaves the weights where they are (every node run would
            # otherwise drop the graphs, record them again, and soon give replay up).
            if unpatch_all:
                release_text_graphs(self.model)
            return super().detach(unpatch_all, *args, **kwargs)

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


def comfy_pinned_bytes() -> int:
    """Page-locked memory ComfyUI holds for its own models (registered with cudaHostRegister,
    outside torch's allocator): ``comfy.model_management.TOTAL_PINNED_MEMORY``, 0 where absent."""
    try:
        return max(0, int(getattr(_mm(), "TOTAL_PINNED_MEMORY", 0) or 0))
    except (TypeError, ValueError):
        return 0


def install_unload_hook(on_unload: Callable[[], object]) -> bool:
    """Call ``on_unload()`` whenever ComfyUI unloads all models (``POST /free``, OOM recovery,
    ``--disable-smart-memory``). Wraps ``comfy.model_management.unload_all_models`` once, chaining to
    the original; a later call adds its callback to that wrapper (the pack loaded again under another
    module name, whose nodes ComfyUI then keeps, must be released too). Returns False if
    ``on_unload`` was hooked already."""
    mm = _mm()
    hooks = getattr(mm.unload_all_models, "_klein_unload_hooks", None)
    if hooks is not None:
        if on_unload in hooks:
            return False
        hooks.append(on_unload)
        return True
    original = mm.unload_all_models
    hooks = [on_unload]

    @functools.wraps(original)
    def unload_all_models(*args, **kwargs):
        for hook in hooks[:]:  # a copy: a hook may be added while they run
            try:
                hook()
            except Exception:  # never let the pack break ComfyUI's own unloading
                logger.exception("Klein: releasing cached models failed")
        return original(*args, **kwargs)

    unload_all_models._klein_unload_hooks = hooks
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


def temp_path(name: str) -> str:
    """``name`` inside ComfyUI's temp folder (emptied when the server starts)."""
    import folder_paths

    return os.path.join(folder_paths.get_temp_directory(), name)


def output_dir_path(name: str) -> str:
    """``name`` inside ComfyUI's output folder (kept across restarts, unlike the temp folder)."""
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), name)


def input_dir() -> str:
    """ComfyUI's input folder (``--input-directory``, ``--base-directory``, or ``ComfyUI/input``)."""
    import folder_paths

    return folder_paths.get_input_directory()


def folder_paths_of(folder: str) -> list[str]:
    import folder_paths

    return folder_paths.get_folder_paths(folder)


# ----- native MODEL bridge (nodes/native_model.py) --------------------------------------------------
# A Klein transformer as ComfyUI's own MODEL: a ModelPatcher over a model_base.Flux2 whose
# diffusion_model is the pack's adapter. Only names present in ComfyUI 0.3.75 and current ComfyUI.


def _native_patcher_class() -> type:
    """A ModelPatcher that always loads the bridged model whole: klein_core's layers are not
    ``comfy.ops`` layers, so ComfyUI's low-VRAM partial loading could not cast them per layer."""
    base = _patcher_class()

    class KleinNativeModelPatcher(base):
        def partially_load(self, device_to, extra_memory=0, *args, **kwargs):
            return super().partially_load(device_to, 1e32, *args, **kwargs)

        def patch_model(self, device_to=None, lowvram_model_memory=0, *args, **kwargs):
            return super().patch_model(device_to, 0, *args, **kwargs)

        def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
            # A packed layer (GGUF, NVFP4) takes its patches as they are and applies them at each
            # call (nodes/native_model.py); ComfyUI's own path would merge them into a dense weight.
            layer = _packed_layer(self.model, key)
            if layer is None:
                return super().patch_weight_to_device(key, device_to, *args, **kwargs)
            if key not in self.patches:  # nothing to apply; never ComfyUI's cast of the placeholder
                return layer.weight
            if kwargs.get("return_weight"):  # current ComfyUI's lazy copies for saving
                return layer.klein_weight(layer.compute_dtype, self.patches[key], key)
            if key not in self.backup:  # what unpatch_model puts back
                self.backup[key] = _Backup(layer.weight, False)
            layer.klein_patch_weight(self.patches[key], key)
            return None

        def unpatch_model(self, *args, **kwargs):
            restored = set(self.backup)
            try:
                return super().unpatch_model(*args, **kwargs)
            finally:
                _restored(self.model, restored - set(self.backup))

        def unpatch_hooks(self, *args, **kwargs):
            restored = set(getattr(self, "hook_backup", ()))
            try:
                return super().unpatch_hooks(*args, **kwargs)
            finally:
                _restored(self.model, restored - set(getattr(self, "hook_backup", ())))

    return KleinNativeModelPatcher


# ComfyUI's record of a weight to put back on unpatching: the namedtuple it builds inline in
# ModelPatcher.patch_weight_to_device (named "Dimension" there too; not importable)
_Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


def _layer_of(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    """The module owning the parameter ``key`` (``diffusion_model.<...>.weight``), or None."""
    owner, _, _ = key.rpartition(".")
    try:
        return model.get_submodule(owner)
    except AttributeError:
        return None


def _packed_layer(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    """The bridged view of a packed layer whose ``weight`` ``key`` names, or None."""
    layer = _layer_of(model, key) if key.endswith(".weight") else None
    return layer if hasattr(layer, "klein_patch_weight") else None


def _restored(model: torch.nn.Module, keys: set) -> None:
    """Tell the layers whose weights ComfyUI just put back (``klein_restored``): what they kept for
    the patch (a re-quantised weight's scale, patches applied per call) must go with it."""
    for key in keys:
        layer = _layer_of(model, key)
        if hasattr(layer, "klein_restored"):
            layer.klein_restored()


def native_flux2_model(diffusion_model: torch.nn.Module, unet_config: dict, dtype: torch.dtype,
                       device: torch.device) -> object:
    """``comfy.model_base.Flux2`` (FLUX.2 latent format, flow sampling, Flux conditioning: context
    padded to 512, ``reference_latents`` as ``ref_latents``) around ``diffusion_model``, wrapped in a
    ModelPatcher that reports its weights to ComfyUI's model management; returns the MODEL."""
    import comfy.model_base
    import comfy.supported_models

    config = comfy.supported_models.Flux2({"image_model": "flux2", **unet_config,
                                           "disable_unet_model_creation": True})
    config.set_inference_dtype(dtype, None)
    base = _klein_flux2_class()(config, device=device)
    base.diffusion_model = diffusion_model
    return _native_patcher_class()(base, load_device=device, offload_device=offload_device())


# In the options of the pack encoder's CONDITIONING: the encoder file. ComfyUI passes the options on
# to the model's extra_conds, where it marks text that must not be padded (_klein_flux2_class).
NATIVE_ENCODER_KEY = "klein_encoder"


@functools.cache
def _klein_flux2_class() -> type:
    """``comfy.model_base.Flux2`` that leaves the pack encoder's text as it is. ComfyUI pads any text
    under 512 tokens to 512 with zero rows in front (its own encoder gives fewer); the pack's encoder
    gives the Klein Sampler's embeddings (512 tokens, trimmed, or the whole prompt), and its
    "padding trimmed" prompts padded so ran as neither (0.025 from the Klein Sampler at 4 steps).
    Conditioning from ComfyUI's own encoders is padded as ComfyUI pads it."""
    import comfy.model_base

    class KleinFlux2(comfy.model_base.Flux2):
        def extra_conds(self, **kwargs):
            if NATIVE_ENCODER_KEY in kwargs:  # the pack's encoder: its length as the Klein Sampler uses it
                return comfy.model_base.Flux.extra_conds(self, **kwargs)
            return super().extra_conds(**kwargs)

    return KleinFlux2


def run_diffusion_model_wrappers(fn: Callable, owner: object, transformer_options: dict, *args, **kwargs):
    """``fn(*args, **kwargs)`` through the DIFFUSION_MODEL wrappers in ``transformer_options`` (what
    EasyCache and other model patches install), as ComfyUI's own Flux.forward runs them."""
    import comfy.patcher_extension as ext

    wrappers = ext.get_all_wrappers(ext.WrappersMP.DIFFUSION_MODEL, transformer_options)
    return ext.WrapperExecutor.new_class_executor(fn, owner, wrappers).execute(*args, **kwargs)


# ----- native interop: ComfyUI's own VAE (issue #32) ------------------------------------------------
# The pack's VAE nodes take a native VAE (``comfy.sd.VAE``, e.g. from VAELoader) as well as KLEIN_VAE,
# and Klein Model Loader gives one. Only ``VAE.decode`` / ``.encode`` / ``.latent_channels`` /
# ``.downscale_ratio`` are used: ComfyUI 0.3.75 and current ComfyUI both have them.

_NATIVE_VAES: dict[tuple, object] = {}

# Where current ComfyUI asks every node output whether it holds a model, ``getattr(output,
# "patcher", None)`` and ``"get_models"`` (its prompt's model tracker, its RAM-pressure cache):
# (module, function). Asked there, a native VAE not read yet says no rather than read its file.
_MODEL_PROBES = frozenset({("comfy.model_patcher", "is_model_patcher_output"), ("comfy.model_patcher", "add")})


def is_native_vae(vae: object) -> bool:
    """Whether ``vae`` is ComfyUI's own VAE object (what VAELoader gives)."""
    import comfy.sd

    return isinstance(vae, comfy.sd.VAE)


def native_vae_geometry(vae: object) -> tuple[int, int]:
    """(latent channels, pixels per latent position) of a native VAE; (0, 0) when it has none (a video
    or audio VAE: its ratio is a tuple or a function)."""
    channels, ratio = getattr(vae, "latent_channels", 0), getattr(vae, "downscale_ratio", 0)
    return (int(channels), int(ratio)) if isinstance(channels, int) and isinstance(ratio, int) else (0, 0)


def native_vae_decode(vae: object, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, C, h, w]`` -> IMAGE ``[B, H, W, 3]`` in 0..1 through ComfyUI's VAE (as VAEDecode)."""
    return vae.decode(latents)


def native_vae_encode(vae: object, pixels: torch.Tensor) -> torch.Tensor:
    """IMAGE ``[B, H, W, 3]`` in 0..1 -> latents through ComfyUI's VAE (as VAEEncode)."""
    return vae.encode(pixels[..., :3])


def _flux2_ddconfig(config) -> dict:
    """ComfyUI's AutoencoderKL ``ddconfig`` for a klein_core ``VAEConfig`` (the FLUX.2 VAE's shape)."""
    base = config.block_channels[0]
    if tuple(config.decoder_block_channels) != tuple(config.block_channels) or any(c % base for c in config.block_channels):
        raise ValueError("ComfyUI's VAE needs an encoder and a decoder of the same widths (BFL's small-decoder "
                         "file has none in ComfyUI); load flux2-vae.safetensors with VAELoader instead")
    return {"double_z": True, "z_channels": config.z_channels, "resolution": 256, "in_channels": config.in_channels,
            "out_ch": config.out_channels, "ch": base, "ch_mult": [c // base for c in config.block_channels],
            "num_res_blocks": config.num_res_blocks, "attn_resolutions": [], "dropout": 0.0,
            "batch_norm_latent": True}


def _native_vae_class() -> type:
    import comfy.sd
    import comfy.utils

    class KleinNativeVAE(comfy.sd.VAE):
        """ComfyUI's VAE over a FLUX.2 VAE file, read on first use: a loader output that nothing
        uses costs no memory."""

        def __init__(self, path: str, config) -> None:  # comfy.sd.VAE.__init__ runs on first use
            self.__dict__["_klein_pending"] = (path, config)

        def __getattr__(self, name: str):
            pending = self.__dict__.get("_klein_pending")
            if pending is None or name.startswith("__"):
                raise AttributeError(name)
            caller = sys._getframe(1)
            if (caller.f_globals.get("__name__"), caller.f_code.co_name) in _MODEL_PROBES:
                raise AttributeError(name)  # no model yet; a use reads it
            self.__dict__["_klein_pending"] = None
            path, config = pending
            try:
                sd = comfy.utils.load_torch_file(path)
                if config == type(config)():  # the published FLUX.2 VAE: ComfyUI's own detection
                    comfy.sd.VAE.__init__(self, sd=sd)
                else:  # another FLUX.2 shape (test files): the same model, its sizes from klein_core's config
                    ddconfig = _flux2_ddconfig(config)
                    sd = comfy.utils.state_dict_prefix_replace(sd, {"decoder.post_quant_conv.": "post_quant_conv.",
                                                                    "encoder.quant_conv.": "quant_conv."})
                    comfy.sd.VAE.__init__(self, sd=sd, config={"params": {
                        "ddconfig": ddconfig, "embed_dim": config.z_channels}})
                    self.latent_channels = config.z_channels * 4
                    self.downscale_ratio = self.upscale_ratio = config.downscale
                self.throw_exception_if_invalid()
            except BaseException:
                # A read that failed (an I/O error, an interrupt): the next use reads the file again,
                # or this half-made VAE would fail every later run under a misleading message.
                self.__dict__.clear()  # what __init__ set before it failed, too
                self.__dict__["_klein_pending"] = pending
                raise
            logger.info("Klein: %s loaded as ComfyUI's VAE", os.path.basename(path))
            return getattr(self, name)

    return KleinNativeVAE


def release_native_vaes() -> None:
    """Forget the native VAEs made for the loader's ``native_vae`` output (ComfyUI unloaded everything)."""
    _NATIVE_VAES.clear()


def native_flux2_vae(path: str, config) -> object:
    """ComfyUI's own VAE (``comfy.sd.VAE``) for the FLUX.2 VAE file at ``path`` whose klein_core
    ``VAEConfig`` is ``config``; one object per file state, its weights read when first used."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    vae = _NATIVE_VAES.get(key)
    if vae is None:
        _NATIVE_VAES.clear()  # one file at a time, as the pack's own model cache keeps one VAE
        vae = _NATIVE_VAES[key] = _native_vae_class()(path, config)
    return vae
