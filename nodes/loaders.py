"""Klein Model Loader: the transformer and the FLUX.2 VAE from ComfyUI's model folders."""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

from klein_core.files.loaders import meta_model, quantize_for
from klein_core.memory.placement import module_bytes
from klein_core.memory.planner import weights_home
from klein_core.pipeline.inputs import check_compatible
from klein_core.pipeline.request import guess_model_kind
from klein_core.quant.formats import describe_formats, prequantized_layers
from klein_core.quant.fp8 import scaled_mm_available

from . import cache, host, notices
from .common import check_choices, check_widget, errors_named, file_state, model_file
from .types import KleinModel, KleinModelType, KleinVAE, KleinVAEType

logger = logging.getLogger(__name__)

NODE = "Klein Model Loader"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16,
          "q8": torch.bfloat16, "q4": torch.bfloat16}
QUANTIZE = {"fp8": "fp8", "q8": "q8", "q4": "q4"}  # weight_dtype -> klein_core quantize= (the rest compute as named)
GGUF = (".gguf",)
KINDS = ("auto", "distilled", "base", "kv")
MEMORY_MODES = ("auto", "resident", "swap", "blocks", "minimum")
SPEEDS = {"fast": "fast", "fast + compile": "compile", "plain": "plain"}  # widget -> klein_core speed


def weight_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """The chosen compute dtype, unless the device cannot run it (bf16 on pre-Ampere GPUs -> fp16).
    "fp8" stores the block weights in float8 and computes in bf16."""
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and not host.bf16_supported(device):
        logger.warning("%s: %s does not support bf16; using fp16 instead", NODE, device)
        return torch.float16
    if device.type == "cpu" and dtype != torch.float32:
        logger.info("%s: computing on the CPU in %s as chosen (fp32 is often faster on CPUs)", NODE,
                    str(dtype).removeprefix("torch."))
    return dtype


def report_weight_choice(weight_dtype: str, model_name: str, transformer: torch.nn.Module,
                         device: torch.device) -> None:
    """Say (as node warnings) where ``weight_dtype`` does not do what its name says for this file on
    this GPU: a storage choice (fp8 / q8 / q4) that leaves a quantised file's layers as stored, or
    fp8 on a GPU without fp8 matmuls (memory saved, but every layer upcast when it runs)."""
    kept = prequantized_layers(transformer, QUANTIZE.get(weight_dtype))
    if kept:
        logger.warning("%s: %s stores %s; weight_dtype %s re-quantises only float weights, so those stay as "
                       "stored (choose bf16 to silence this)", NODE, model_name, describe_formats(kept),
                       weight_dtype)
    if weight_dtype == "fp8" and device.type == "cuda" and not scaled_mm_available(device):
        major, minor = torch.cuda.get_device_capability(device)
        logger.warning("%s: weight_dtype fp8 on %s (compute capability %d.%d, fp8 matmuls need 8.9): the block "
                       "weights take half the memory of bf16 but are upcast to bf16 layer by layer when they "
                       "run, which is slower than bf16 where bf16 fits", NODE, torch.cuda.get_device_name(device),
                       major, minor)


def transformer_home(memory_mode: str, device: torch.device, path: str, dtype: torch.dtype,
                     quantize: str | None) -> torch.device:
    """Where the transformer's weights live between runs, as klein_core's planner decides it: the
    compute device, or CPU memory when its stages will copy or stream it in. ComfyUI frees its own
    models first so the decision sees the memory it can have."""
    if device.type == "cpu":
        return device
    meta = meta_model(path, "transformer", dtype=dtype, quantize=quantize)
    host.make_room(module_bytes(meta), device)
    return weights_home(meta, device, mode=memory_mode, free_bytes=host.free_bytes(device))


class KleinModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinModelLoader",
            display_name=NODE,
            category="Klein/loaders",
            description="Loads a FLUX.2 Klein transformer (4B or 9B, distilled or base) and the FLUX.2 VAE. "
                        "Sizes are read from the weights; files stay cached until ComfyUI frees memory.",
            inputs=[
                io.Combo.Input("model_name", options=host.filename_list("diffusion_models", GGUF), tooltip=(
                    "Klein transformer from models/diffusion_models (or models/unet), e.g. "
                    "flux-2-klein-4b.safetensors, flux-2-klein-base-4b.safetensors or a GGUF such as "
                    "flux-2-klein-4b-Q4_K_M.gguf (4B or 9B is read from the weights; unsupported formats "
                    "are refused by name).")),
                io.Combo.Input("vae_name", options=host.filename_list("vae"),
                               tooltip="FLUX.2 VAE from models/vae: flux2-vae.safetensors (or BFL's small-"
                                       "decoder file)."),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="bf16",
                               tooltip="Compute dtype of the transformer. bf16 is the native precision; fp16 "
                                       "for GPUs without bf16; fp32 doubles memory; fp8 stores the block "
                                       "weights in float8 (half the memory of bf16; fp8 matmuls on GPUs "
                                       "with fp8 tensor cores); q8 / q4 store them as GGUF Q8_0 / Q4_0 "
                                       "blocks (4B: 4.0 / 2.3 GB; dequantised one layer at a time). fp8, "
                                       "NVFP4 and GGUF files keep their own format with any choice (the "
                                       "node says so when fp8 / q8 / q4 is chosen for one, and when fp8 "
                                       "is chosen on a GPU without fp8 matmuls)."),
                io.Combo.Input("model_kind", options=list(KINDS), default="auto", tooltip=(
                    "Sets the sampler defaults: distilled = 4 steps without CFG, base = 50 steps with CFG 4, "
                    "kv = Klein 9B-KV (distilled; references' keys/values computed once per edit). auto = "
                    "from the file name: 'base' -> base, '-kv' -> kv, else distilled (weights cannot tell).")),
                io.Combo.Input("memory_mode", options=list(MEMORY_MODES), default="auto", optional=True, tooltip=(
                    "GPU memory plan. auto = the fastest plan that fits the free memory (logged by the "
                    "sampler with its estimate); resident = everything stays on the GPU; swap = text "
                    "encoder and transformer take turns; blocks = transformer blocks stream from CPU "
                    "memory (for cards smaller than the model); minimum = everything streamed.")),
                io.Combo.Input("speed", options=list(SPEEDS), default="fast", optional=True, tooltip=(
                    "fast = the fastest eager path on the GPU (cuDNN attention on H100-class GPUs, fused "
                    "norm/RoPE kernels from comfy-kitchen); the plain path on the CPU. fast + compile = "
                    "also torch.compile the transformer blocks and the VAE decoder (the first run at each size "
                    "compiles for tens of seconds, logged; torch caches it on disk for later starts). "
                    "plain = the reference PyTorch path.")),
            ],
            outputs=[
                KleinModelType.Output(display_name="model",
                                      tooltip="The transformer and its sampler defaults."),
                KleinVAEType.Output(display_name="vae",
                                    tooltip="The FLUX.2 VAE (for references and decoding)."),
                io.Vae.Output(display_name="native_vae",
                              tooltip="The same FLUX.2 VAE as ComfyUI's VAE, for VAE Decode / VAE Encode and "
                                      "other core nodes (read when a node first uses it)."),
            ],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        # Only model_name: ComfyUI reports a failure once under each input named here, and inputs
        # not named keep the host's own checks (current ComfyUI checks every combo, vae_name too;
        # 0.3.75 checks none, so there vae_name is checked when the node runs, by name).
        return check_choices(cls, {"model_name": "diffusion_models"}, model_name=model_name)  # .gguf listed too

    @classmethod
    def fingerprint_inputs(cls, model_name: str = "", vae_name: str = "", **_: object) -> object:
        # Load again when either file is replaced under the same name: the model refs this node
        # outputs carry the file's time, so the new file is then read instead of the cached model.
        return file_state("diffusion_models", model_name), file_state("vae", vae_name)

    @classmethod
    @notices.reported
    def execute(cls, model_name: str, vae_name: str, weight_dtype: str = "bf16",
                model_kind: str = "auto", memory_mode: str = "auto", speed: str = "fast") -> io.NodeOutput:
        device = host.torch_device()
        check_widget(NODE, "weight_dtype", weight_dtype, DTYPES)
        check_widget(NODE, "model_kind", model_kind, KINDS)
        check_widget(NODE, "memory_mode", memory_mode, MEMORY_MODES)
        check_widget(NODE, "speed", speed, SPEEDS)
        model_path = model_file(NODE, "model_name", "diffusion_models", model_name, expect="transformer")
        vae_path = model_file(NODE, "vae_name", "vae", vae_name, expect="vae")
        dtype, vae_device = weight_dtype_for(weight_dtype, device), host.vae_device()
        # A device without float8 (Apple's MPS) gets fp8 layers dequantised as they load, wherever they
        # load; fp8 storage asked of it is refused (the input named: the error is the choice, not the file)
        quantize = QUANTIZE.get(weight_dtype)
        input_name, value = ("weight_dtype", weight_dtype) if quantize == "fp8" else ("model_name", model_name)
        with errors_named(NODE, input_name, value):
            quantize = quantize_for(model_path, "transformer", device, quantize, dtype=dtype)
        home = transformer_home(memory_mode, device, model_path, dtype, quantize)
        tref = cache.model_ref("transformer", model_path, model_name, home, dtype, quantize)
        vref = cache.model_ref("vae", vae_path, vae_name, vae_device, host.vae_dtype(vae_device))
        with errors_named(NODE, "model_name", model_name):
            transformer = tref.get()
        report_weight_choice(weight_dtype, model_name, transformer, device)
        with errors_named(NODE, "vae_name", vae_name):
            vae = vref.get()
            check_compatible(transformer, None, vae)
        # the path, so a diffusers folder's model_index.json and folder name count too
        kind = guess_model_kind(model_path) if model_kind == "auto" else model_kind
        logger.info("%s: %s (%s) as a %s model%s", NODE, model_name, transformer.config.variant, kind,
                    " (from the file or folder name)" if model_kind == "auto" else "")
        return io.NodeOutput(KleinModel(tref, kind, transformer.config, memory_mode, SPEEDS[speed]),
                             KleinVAE(vref, vae.config, SPEEDS[speed]), host.native_flux2_vae(vae_path, vae.config))
