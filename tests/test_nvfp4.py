"""NVFP4 files (the ComfyUI / comfy-kitchen / BFL format): our dequantisation bit for bit against
comfy-kitchen's, tiny Klein files written in both marker forms and loaded through load_transformer,
outputs vs the bf16 model, and the bytes a 9B NVFP4 transformer keeps resident (meta path, from a
file with the published 9B layout)."""

from __future__ import annotations

import json

import pytest
import torch
from layout_files import manifests, write_safetensors
from safetensors.torch import save_file

import klein_core as kc
from klein_core.quant import nvfp4
from klein_core.quant.fp8 import block_linear_names
from klein_core.testing import tiny_transformer

ck = pytest.importorskip("comfy_kitchen")


def _ck_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """comfy-kitchen's own NVFP4 quantisation (eager backend on the CPU), as ComfyUI makes files."""
    pts = (w.abs().amax().float() / (448.0 * 6.0)).reshape(())
    q, bs = ck.quantize_nvfp4(w.float(), pts)
    return q, bs, pts


@pytest.mark.parametrize("shape", [(64, 128), (256, 3072), (96, 48), (300, 2048)])
def test_dequantize_is_bit_identical_to_comfy_kitchen(shape, parity):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.05
    pts = (w.abs().amax().float() / (448.0 * 6.0)).reshape(())
    q, bs = ck.quantize_nvfp4(w, pts, pad_16x=True)
    ref = ck.dequantize_nvfp4(q, pts, bs, torch.float32)[: shape[0], : shape[1]]
    ours = nvfp4.dequantize(q, bs, pts, shape)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    cols = q.shape[1] * 2 // 16
    assert torch.equal(nvfp4.unswizzle(bs, q.shape[0], cols).view(torch.uint8),
                       ck.from_blocked(bs, q.shape[0], cols).view(torch.uint8))
    assert torch.equal(nvfp4.swizzle(nvfp4.unswizzle(bs, q.shape[0], cols)).view(torch.uint8), bs.view(torch.uint8))
    parity(f"NVFP4 dequantised {list(shape)} vs comfy-kitchen dequantize_nvfp4 (max abs)", (ours - ref).abs().max().item())


def _nvfp4_file(path, model, marker: str, input_scale: bool = True) -> list[str]:
    """The model's block Linears in NVFP4 (comfy-kitchen), the rest bf16, in ComfyUI's layout."""
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    layers = block_linear_names(model)
    meta = None
    for layer in layers:
        q, bs, pts = _ck_quantize(model.get_submodule(layer).weight)
        sd[f"{layer}.weight"] = q
        sd[f"{layer}.weight_scale"] = bs
        sd[f"{layer}.weight_scale_2"] = pts
        if input_scale:
            sd[f"{layer}.input_scale"] = torch.tensor(0.01)
        if marker == "comfy_quant":
            sd[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    if marker == "metadata":
        meta = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                      "layers": {la: {"format": "nvfp4"} for la in layers}})}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=meta)
    return layers


def _run(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 12, 128, generator=g), torch.randn(2, 5, 96, generator=g)
    with torch.no_grad():
        return model(img=img, img_ids=kc.position_ids(3, 4), txt=txt, txt_ids=kc.text_position_ids(5),
                     timesteps=torch.tensor([0.9, 0.4]))


@pytest.mark.parametrize("marker", ["metadata", "comfy_quant", "weight_scale_2 only"])
def test_nvfp4_files_load_and_stay_nvfp4(tmp_path, marker, parity):
    model = tiny_transformer().float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 file's values
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    layers = _nvfp4_file(path, model, marker)
    loaded = kc.load_transformer(path, dtype=torch.float32)
    assert sorted(nvfp4.nvfp4_layers(loaded)) == sorted(layers)
    # exactly the file's values: the same model with comfy-kitchen's dequantised weights
    exact = tiny_transformer().float()
    exact.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in layers:
            q, bs, pts = _ck_quantize(model.get_submodule(layer).weight)
            exact.get_submodule(layer).weight.copy_(ck.dequantize_nvfp4(q, pts, bs, torch.float32))
    diff = (_run(loaded) - _run(exact)).abs().max().item()
    parity(f"NVFP4 file ({marker}): output vs a float model of comfy-kitchen's dequantised weights", diff)
    assert diff <= 1e-5
    ref = _run(model)
    rel = ((_run(loaded) - ref).norm() / ref.norm()).item()
    parity(f"NVFP4 tiny transformer vs the bf16 model (relative L2, not a diff; {marker})", rel)
    assert 0 < rel < 0.005  # measured 1.8e-3
    weightless = kc.weightless(path, "transformer", dtype=torch.bfloat16)
    assert kc.module_bytes(weightless) == kc.module_bytes(kc.load_transformer(path, dtype=torch.bfloat16))


def test_dequantize_option_and_bad_scales(tmp_path):
    model = tiny_transformer().float()
    path = tmp_path / "m.safetensors"
    _nvfp4_file(path, model, "metadata", input_scale=False)
    plain = kc.load_transformer(path, dtype=torch.float32, quantize="dequantize")
    assert not nvfp4.nvfp4_layers(plain)
    assert (_run(plain) - _run(kc.load_transformer(path, dtype=torch.float32))).abs().max() < 1e-5
    from safetensors.torch import load_file

    sd = load_file(str(path))
    key = next(k for k in sd if k.endswith(".weight_scale"))
    rows, cols = sd[key.replace("_scale", "")].shape
    sd[key] = torch.zeros(rows, cols * 2 // 16, dtype=torch.float8_e4m3fn)[:, : max(1, cols * 2 // 16 - 1)].contiguous()
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(kc.WeightFormatError, match="block scales"):
        kc.load_transformer(tmp_path / "bad.safetensors")


def test_resident_bytes_of_a_9b_nvfp4_transformer(tmp_path, parity):
    """BFL's 9B layout with its 112 fp8 block Linears as NVFP4 instead: the file's header alone
    (sparse file, zero data), loaded on the meta device as a real load would place it."""
    fp8 = manifests()["bfl_flux-2-klein-9b-fp8"]
    tensors, layers = {}, []
    for name, (shape, dtype) in fp8["tensors"].items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if dtype == "F8_E4M3":
            layer = name[: -len(".weight")]
            layers.append(layer)
            out_f, in_f = shape
            tensors[name] = [[out_f, in_f // 2], "U8"]
            tensors[layer + ".weight_scale"] = [list(nvfp4.scale_shape(out_f, in_f)), "F8_E4M3"]
            tensors[layer + ".weight_scale_2"] = [[], "F32"]
            tensors[layer + ".input_scale"] = [[], "F32"]
        else:
            tensors[name] = [shape, dtype]
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                  "layers": {la: {"format": "nvfp4"} for la in layers}})}
    path = tmp_path / "flux-2-klein-9b-nvfp4.safetensors"
    write_safetensors(path, tensors, meta)
    model = kc.weightless(path, "transformer", dtype=torch.bfloat16)
    assert len(nvfp4.nvfp4_layers(model)) == len(layers) == 112
    size = kc.module_bytes(model)
    parity("Klein 9B NVFP4 transformer resident (GiB, meta path; not a diff)", size / 2**30)
    assert 4.5 * 2**30 < size < 6 * 2**30


def test_model_to_dtype_never_rounds_the_scales(tmp_path):
    model = tiny_transformer().float()
    path = tmp_path / "m.safetensors"
    _nvfp4_file(path, model, "metadata")
    loaded = kc.load_transformer(path, dtype=torch.float32)
    before = _run(loaded)
    loaded.to(torch.bfloat16).to(torch.float32)  # a round trip through bf16 would round float scales
    assert torch.equal(_run(loaded), before)
