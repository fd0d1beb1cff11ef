"""Issue #28: NVFP4 files whose block scales are row-major (NVIDIA ModelOpt) instead of ComfyUI's
swizzled layout. At Klein's sizes both layouts have the same shape, so the shape check never fires;
the loader tells them apart by the file's origin (see klein_core/files/nvfp4.py) and refuses what it
cannot tell. Every file here is a tiny Klein transformer (hidden 128) whose block Linears all have
out % 128 == 0 and in % 64 == 0: the hard case, as at the real sizes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from extras import require
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files.transformer_layout import bfl_to_diffusers
from klein_core.quant import nvfp4
from klein_core.quant.fp8 import block_linear_names
from klein_core.testing import tiny_transformer
from klein_core.testing.tiny import TinySpec

ck = require("comfy_kitchen")

HARD = TinySpec(hidden=128, heads=2)  # every block Linear: padded (swizzled) scale shape == [out, in/16]
MODELOPT_CONFIG = json.dumps({"producer": {"name": "modelopt", "version": "0.40.0"}, "quant_algo": "NVFP4",
                              "group_size": 16})


def _model() -> torch.nn.Module:
    model = tiny_transformer(HARD).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """comfy-kitchen's NVFP4 (ComfyUI's files): high-nibble-first codes, swizzled fp8 block scales."""
    pts = (w.abs().amax().float() / (448.0 * 6.0)).reshape(())
    q, bs = ck.quantize_nvfp4(w.float(), pts)
    return q, bs, pts


def _exact(w: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``w`` as ComfyUI's NVFP4 file holds them (comfy-kitchen's own dequantise)."""
    q, bs, pts = _quantize(w)
    return ck.dequantize_nvfp4(q, pts, bs, torch.float32)


def _as_modelopt(q: torch.Tensor, bs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantised weight as ModelOpt stores it: low nibble first, row-major [out, in/16] scales."""
    rows, cols = q.shape[0], q.shape[1] * 2 // 16
    return ((q << 4) | (q >> 4)).to(torch.uint8), nvfp4.unswizzle(bs, rows, cols).contiguous()


def _write_nvfp4(path, sd: dict, layers: list[str], *, style: str, marker: str | None, modelopt_header: bool = False):
    """``sd`` (float) with ``layers`` in NVFP4: ``style`` "comfy" or "modelopt" (row-major scales, low
    nibble first); ``marker`` "metadata", "comfy_quant" or None (weight_scale_2 only)."""
    out = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    for layer in layers:
        q, bs, pts = _quantize(sd[f"{layer}.weight"])
        if style == "modelopt":
            q, bs = _as_modelopt(q, bs)
        out[f"{layer}.weight"], out[f"{layer}.weight_scale"], out[f"{layer}.weight_scale_2"] = q, bs, pts
        out[f"{layer}.input_scale"] = torch.tensor(0.01)
        if marker == "comfy_quant":
            out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()),
                                                       dtype=torch.uint8)
    meta = {}
    if marker == "metadata":
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0",
                                                     "layers": {la: {"format": "nvfp4"} for la in layers}})
    if modelopt_header:
        meta["quantization_config"] = MODELOPT_CONFIG
    save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata=meta or None)


def _bfl_file(path, *, style="comfy", marker=None, modelopt_header=False) -> tuple[torch.nn.Module, list[str]]:
    model = _model()
    layers = block_linear_names(model)
    _write_nvfp4(path, model.state_dict(), layers, style=style, marker=marker, modelopt_header=modelopt_header)
    return model, layers


def _refused(path, layer_names: list[str], *why: str) -> str:
    with pytest.raises(kc.WeightFormatError) as err:
        kc.load_transformer(path, dtype=torch.float32)
    msg = str(err.value)
    assert str(path) in msg
    first = sorted(layer_names)[0]
    assert f"'{first}.weight_scale'" in msg, msg
    for w in why:
        assert w in msg, msg
    assert "comfy-kitchen" in msg and "bf16" in msg  # what to do instead
    return msg


def test_the_hard_case_shapes_agree_and_a_misread_is_silently_wrong(parity):
    """Why the shape check cannot help here, and what reading the wrong layout would cost: the
    weight read in the wrong layout is unrelated to the stored one (relative L2 about sqrt(2))."""
    model = _model()
    for layer in block_linear_names(model):
        out_f, in_f = model.get_submodule(layer).weight.shape
        assert nvfp4.scale_shape(out_f, in_f) == (out_f, in_f // 16), layer
    w = model.get_submodule("single_blocks.0.linear1").weight
    q, bs, pts = _quantize(w)
    exact = ck.dequantize_nvfp4(q, pts, bs, torch.float32)
    assert torch.equal(nvfp4.dequantize(q, bs, pts, tuple(w.shape)), exact)
    mq, mbs = _as_modelopt(q, bs)
    misread = nvfp4.dequantize(mq, mbs, pts, tuple(w.shape))  # what the loader did before #28
    assert misread.shape == exact.shape and not torch.equal(misread, exact)
    rel = parity("NVFP4 ModelOpt scales read as ComfyUI's: relative L2 of the weight",
                 ((misread - exact).norm() / exact.norm()).item())
    assert rel > 1.0  # not a small error: every block scale lands on the wrong block
    # the ModelOpt data holds the same weight: nibbles swapped back and scales swizzled, it is exact again
    swapped = ((mq << 4) | (mq >> 4)).to(torch.uint8)
    assert torch.equal(nvfp4.dequantize(swapped, nvfp4.swizzle(mbs), pts, tuple(w.shape)), exact)


@pytest.mark.parametrize("marker", ["metadata", "comfy_quant", None])
def test_comfyui_layout_files_load_exactly_at_the_hard_sizes(tmp_path, marker):
    path = tmp_path / "flux-2-klein-nvfp4.safetensors"
    model, layers = _bfl_file(path, marker=marker)
    loaded = kc.load_transformer(path, dtype=torch.float32)
    assert sorted(nvfp4.nvfp4_layers(loaded)) == sorted(layers)
    for layer in layers:
        assert torch.equal(loaded.get_submodule(layer).dequantized(torch.float32),
                           _exact(model.get_submodule(layer).weight)), layer


@pytest.mark.parametrize("style", ["modelopt", "comfy"])  # ModelOpt swizzles only when asked; the file never says
@pytest.mark.parametrize("marker", ["metadata", "comfy_quant", None])
def test_modelopt_files_are_refused_naming_file_and_tensor(tmp_path, style, marker):
    path = tmp_path / "klein-modelopt-nvfp4.safetensors"
    _, layers = _bfl_file(path, style=style, marker=marker, modelopt_header=True)
    _refused(path, layers, "ModelOpt", "'quantization_config'", "row-major")
    with pytest.raises(kc.WeightFormatError, match="ModelOpt"):  # dequantising would read them just as wrong
        kc.load_transformer(path, dtype=torch.float32, quantize="dequantize")
    # a valid ComfyUI file of the same model loads afterwards, in the same process
    good = tmp_path / "flux-2-klein-nvfp4.safetensors"
    _, layers = _bfl_file(good, marker="metadata")
    assert sorted(nvfp4.nvfp4_layers(kc.load_transformer(good, dtype=torch.float32))) == sorted(layers)


def _diffusers_file(path, *, style: str, marker: str | None) -> list[str]:
    model = _model()
    sd = bfl_to_diffusers(model.state_dict(), model.config)
    layers = sorted(k[: -len(".weight")] for k, v in sd.items()
                    if re.match(r"(single_)?transformer_blocks\.\d+\.", k) and k.endswith(".weight") and v.ndim == 2)
    assert layers and all(nvfp4.scale_shape(*sd[f"{la}.weight"].shape) == (sd[f"{la}.weight"].shape[0],
                                                                          sd[f"{la}.weight"].shape[1] // 16)
                          for la in layers)
    _write_nvfp4(path, sd, layers, style=style, marker=marker)
    return layers


@pytest.mark.parametrize("style", ["modelopt", "comfy"])
def test_unmarked_files_under_diffusers_names_are_refused(tmp_path, style):
    """weight_scale_2 only, diffusers names: what ModelOpt's plain diffusers export writes (row-major);
    its origin cannot be told from a ComfyUI file, so even correctly swizzled data is refused."""
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    layers = _diffusers_file(path, style=style, marker=None)
    _refused(path, layers, "no ComfyUI marker", "origin cannot be told", "row-major")


def test_marked_files_under_diffusers_names_still_load(tmp_path):
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    _diffusers_file(path, style="comfy", marker="metadata")
    model = _model()
    loaded = kc.load_transformer(path, dtype=torch.float32)
    # to_q/to_k/to_v are fused into qkv while loading: dequantised exactly, then concatenated
    exact = torch.cat([_exact(w) for w in model.get_submodule("double_blocks.0.img_attn.qkv").weight.chunk(3)])
    assert torch.equal(loaded.get_submodule("double_blocks.0.img_attn.qkv").weight.float(), exact)
