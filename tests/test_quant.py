"""fp8 weights: every file format loads and matches bf16, quantize-on-load is exact, FP8Linear paths.

Each fp8 file is written by the test from a tiny random model (``klein_core.demo``) in the layout
the format uses, then loaded through the normal loaders. The reference is the same bf16 weights
loaded unquantised; both run in float32 so the difference is the fp8 rounding alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from klein_core import testing as demo
from klein_core.errors import WeightFormatError
from klein_core.files.fp8 import QuantTensorInfo, prepare_quantized, quantize_state_dict
from klein_core.files.loaders import load_text_encoder, load_transformer
from klein_core.files.materialize import materialize
from klein_core.files.opening import open_weights
from klein_core.files.transformer_layout import bfl_to_diffusers, plan_transformer
from klein_core.models.transformer import Flux2Transformer
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.quant.fp8 import (
    E4M3_MAX,
    FP8Linear,
    block_linear_names,
    fp8_layers,
    quantize_fp8,
    quantize_model_,
    scaled_mm_available,
)

F8 = torch.float8_e4m3fn


def _bf16(sd):
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


@pytest.fixture(scope="module")
def tiny():
    model = demo.tiny_transformer(demo.TINY_4B, seed=3)
    sd = dict(model.state_dict())
    for k, v in sd.items():
        if "modulation" in k:
            # Random init leaves the gates small and the blocks barely move the output; larger
            # gates make the blocks (the fp8 part) dominate, so the measured error is theirs.
            sd[k] = v * 30
        if k.endswith("attn.qkv.weight"):
            # q, k and v of different magnitudes: diffusers-named files then carry three scales.
            sd[k] = v * torch.tensor([1.0, 0.5, 2.0]).repeat_interleave(v.shape[0] // 3)[:, None]
    return _bf16(sd), block_linear_names(model)


def _inputs(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([position_ids(4, 5), position_ids(2, 3, t=10)])
    img = torch.randn(batch, ids.shape[0], cfg.in_channels, generator=g)
    txt = torch.randn(batch, 7, cfg.context_dim, generator=g)
    return {"img": img, "img_ids": ids, "txt": txt, "txt_ids": text_position_ids(7),
            "timesteps": torch.tensor([0.9, 0.4])}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _diffusers_linears(layers):
    """Diffusers layer names of the BFL block linears (q/k/v split)."""
    names = []
    for layer in layers:
        parts = layer.split(".")
        i = parts[1]
        if parts[0] == "double_blocks":
            tail = ".".join(parts[2:])
            names += {
                "img_attn.qkv": [f"transformer_blocks.{i}.attn.to_{x}" for x in "qkv"],
                "txt_attn.qkv": [f"transformer_blocks.{i}.attn.add_{x}_proj" for x in "qkv"],
                "img_attn.proj": [f"transformer_blocks.{i}.attn.to_out.0"],
                "txt_attn.proj": [f"transformer_blocks.{i}.attn.to_add_out"],
                "img_mlp.0": [f"transformer_blocks.{i}.ff.linear_in"],
                "img_mlp.2": [f"transformer_blocks.{i}.ff.linear_out"],
                "txt_mlp.0": [f"transformer_blocks.{i}.ff_context.linear_in"],
                "txt_mlp.2": [f"transformer_blocks.{i}.ff_context.linear_out"],
            }[tail]
        else:
            sub = {"linear1": "to_qkv_mlp_proj", "linear2": "to_out"}[parts[2]]
            names.append(f"single_transformer_blocks.{i}.attn.{sub}")
    return names


def _write_file(tmp_path, name, sd, metadata=None):
    path = tmp_path / name
    save_file(sd, str(path), metadata=metadata)
    return path


FORMATS = ["comfy_quant mixed", "scaled_fp8", "bfl diffusers weight_scale+input_scale", "plain float8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_files_load_and_match_bf16(tmp_path, tiny, fmt, parity):
    sd, layers = tiny
    ref = load_transformer(sd, dtype=torch.float32)
    cfg = ref.config
    n_expected = len(layers)
    if fmt == "comfy_quant mixed":
        kept_bf16 = [l for l in layers if l.startswith("single_blocks.1.")]  # like fp8mixed files
        quantised = [l for l in layers if l not in kept_bf16]
        file_sd = quantize_state_dict(sd, quantised, style="comfy_quant",
                                      input_scales={quantised[0]: 0.05})
        file_sd[kept_bf16[0] + ".input_scale"] = torch.tensor(0.1)  # stray calibration of a bf16 layer
        n_expected = len(quantised)
    elif fmt == "scaled_fp8":
        scaled = quantize_state_dict(sd, layers, style="scaled_fp8")
        file_sd = {"model.diffusion_model." + k: v for k, v in scaled.items() if k != "scaled_fp8"}
        file_sd["scaled_fp8"] = torch.empty(0, dtype=F8)  # the marker sits at the root in ComfyUI files
    elif fmt == "plain float8":
        # Everything float8, norms and embedders too (as ComfyUI's weight_dtype=fp8_e4m3fn saves).
        file_sd = {k: v.float().to(F8) for k, v in sd.items()}
    else:
        dsd = {k: v.contiguous() for k, v in bfl_to_diffusers(sd, cfg).items()}
        dl = _diffusers_linears(layers)
        input_scales = {n: 0.02 * (1 + j % 3) for j, n in enumerate(dl)}
        file_sd = quantize_state_dict(dsd, dl, style="bfl", input_scales=input_scales)
    path = _write_file(tmp_path, "flux-2-klein-4b-fp8.safetensors", file_sd)
    model = load_transformer(path, dtype=torch.float32)
    assert isinstance(model, Flux2Transformer) and model.dtype == torch.float32
    assert len(fp8_layers(model)) == n_expected
    assert isinstance(model.img_in, nn.Linear) and not isinstance(model.img_in, FP8Linear)
    if fmt.startswith("bfl"):  # q/k/v each had its own scale: fused exactly with per-row scales
        qkv = model.double_blocks[0].img_attn.qkv
        assert qkv.weight_scale.shape == (qkv.out_features,) and qkv.input_scale is not None
        assert float(qkv.input_scale) == pytest.approx(0.06)
    inputs = _inputs(cfg)
    with torch.no_grad():
        out, want = model(**inputs), ref(**inputs)
    rel = _rel(out, want)
    parity(f"fp8 {fmt}: transformer output, relative L2 vs bf16 weights", rel)
    # e4m3 keeps 3 mantissa bits: ~2-4% relative error per layer; scale-1 plain files lose more to
    # subnormals (tiny random weights are ~0.1).
    assert rel < (0.15 if fmt == "plain float8" else 0.08), rel


def test_text_encoder_fp8mixed(tmp_path, parity):
    te = demo.tiny_text_encoder(demo.TINY_4B, seed=1)
    sd = _bf16(te.state_dict())
    layers = block_linear_names(te)
    quantised = [l for l in layers if not l.endswith("o_proj")]  # a mixed file: some layers stay bf16
    file_sd = {"model." + k: v for k, v in quantize_state_dict(sd, quantised, style="comfy_quant").items()}
    path = _write_file(tmp_path, "qwen_3_8b_fp8mixed.safetensors", file_sd)
    ref = load_text_encoder({"model." + k: v for k, v in sd.items()}, dtype=torch.float32)
    model = load_text_encoder(path, dtype=torch.float32)
    assert len(fp8_layers(model)) == len(quantised) and model.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    rel = _rel(model.encode(ids, mask), ref.encode(ids, mask))
    parity("fp8 comfy_quant mixed: text encoder output, relative L2 vs bf16 weights", rel)
    assert rel < 0.06, rel
    default = load_text_encoder(path)  # no dtype: computes in the bf16 of the unquantised tensors
    assert default.embed_tokens.weight.dtype == torch.bfloat16 and len(fp8_layers(default)) == len(quantised)


def test_quantize_on_load_equals_prequantized_file(tmp_path, tiny):
    sd, layers = tiny
    bf16_path = _write_file(tmp_path, "bf16.safetensors", sd)
    fp8_path = _write_file(tmp_path, "fp8.safetensors", quantize_state_dict(sd, layers, style="comfy_quant"))
    from_file = load_transformer(fp8_path, dtype=torch.float32)
    # What load_transformer(..., quantize="fp8") does: the same plan, materialize with quantize.
    src = open_weights(bf16_path, component="transformer")
    plan, config, _, view = plan_transformer(src)
    on_load = materialize(lambda: Flux2Transformer(config), plan, view, component="t", dtype=torch.float32,
                          quantize="fp8")
    after = load_transformer(bf16_path, dtype=torch.float32)
    assert sorted(quantize_model_(after)) == sorted(layers)
    a, b, c = from_file.state_dict(), on_load.state_dict(), after.state_dict()
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == c[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == F8 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == F8 else b[k]), k
        assert torch.equal(a[k].float(), c[k].float()), k
    inputs = _inputs(config)
    with torch.no_grad():
        assert torch.equal(from_file(**inputs), on_load(**inputs))
        assert torch.equal(from_file(**inputs), after(**inputs))


@pytest.mark.parametrize("per_row", [False, True])
def test_fp8linear_upcast_equals_dequantized_matmul(per_row):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    layer = FP8Linear(32, 48, per_row_scale=per_row, bias=True)
    q, s = quantize_fp8(w)
    layer.weight.data = q
    layer.weight_scale = torch.linspace(0.5, 2.0, 48) * s if per_row else s
    layer.bias.data = torch.randn(48, generator=g)
    x = torch.randn(3, 5, 32, generator=g)
    scale = layer.weight_scale[:, None] if per_row else layer.weight_scale
    deq = q.float() * scale
    assert torch.equal(layer(x), F.linear(x, deq, layer.bias))  # float32: exact
    xb = x.bfloat16()
    # bf16 activations: the weight is upcast to bf16 and scaled in bf16, one layer at a time.
    want = F.linear(xb, q.bfloat16() * scale.bfloat16(), layer.bias.bfloat16())
    assert torch.equal(layer(xb), want)
    assert _rel(layer(xb).float(), F.linear(x, deq, layer.bias)) < 1e-2
    assert not scaled_mm_available(torch.device("cpu"))


@pytest.mark.parametrize("per_row,static", [(False, False), (True, False), (False, True)])
def test_scaled_mm_path_matches_upcast(per_row, static, parity):
    # torch._scaled_mm also runs on CPU, so the fp8 tensor-core code path is exercised here.
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 96, bias=False)
    lin.weight.data = torch.randn(96, 64, generator=g) * 0.05
    layer = FP8Linear.from_linear(lin)
    if per_row:
        layer.weight_scale = layer.weight_scale * torch.linspace(0.5, 1.5, 96)
    x = torch.randn(2, 7, 64, generator=g).bfloat16()
    if static:
        layer.input_scale = (x.float().abs().amax() / E4M3_MAX).reshape(())
    layer.matmul = "upcast"
    up = layer(x)
    layer.matmul = "scaled_mm"
    mm = layer(x)
    assert mm.dtype == torch.bfloat16 and mm.shape == (2, 7, 96)
    rel = _rel(mm.float(), up.float())
    parity(f"fp8 scaled_mm vs upcast (per_row={per_row}, static={static}), relative L2", rel)
    assert rel < 0.05, rel  # the activations are quantised to e4m3 on this path


def test_nvfp4_and_other_formats_refused(tmp_path, tiny):
    sd, layers = tiny
    bad = dict(sd)
    layer = layers[0]
    rows, cols = sd[layer + ".weight"].shape
    bad[layer + ".weight"] = torch.zeros(rows, cols // 2, dtype=torch.uint8)  # two fp4 values a byte
    bad[layer + ".weight_scale"] = torch.ones(rows, cols // 16, dtype=F8)
    bad[layer + ".weight_scale_2"] = torch.tensor(1.0)
    bad[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    path = _write_file(tmp_path, "flux-2-klein-base-9b-nvfp4.safetensors", bad)
    with pytest.raises(WeightFormatError, match="nvfp4") as exc:
        load_transformer(path)
    assert str(path) in str(exc.value)
    mx = dict(sd)
    mx[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "mxfp8"}'), dtype=torch.uint8)
    with pytest.raises(WeightFormatError, match=f"'mxfp8'.*'{layer}'"):
        load_transformer(mx)
    layers_meta = {"layers": {layer: {"format": "int8_blockwise"}}}
    meta_bad = _write_file(tmp_path, "m.safetensors", sd,
                      metadata={"_quantization_metadata": json.dumps(layers_meta)})
    with pytest.raises(WeightFormatError, match="int8_blockwise"):
        load_transformer(meta_bad)
    (tmp_path / "klein.gguf").write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(WeightFormatError, match="GGUF"):
        load_transformer(tmp_path / "klein.gguf")


def test_inconsistent_fp8_files_are_named(tiny):
    sd, layers = tiny
    layer = layers[0]
    marked = dict(sd)  # "float8" declared, bf16 stored
    marked[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    with pytest.raises(WeightFormatError, match=rf"{layer}\.comfy_quant.*stored as torch\.bfloat16"):
        load_transformer(marked)
    blocky = quantize_state_dict(sd, [layer])
    blocky[layer + ".weight_scale"] = torch.ones(4, 4)
    with pytest.raises(WeightFormatError, match="block-wise"):
        load_transformer(blocky)
    with pytest.raises(ValueError, match="storage format"):
        load_transformer(quantize_state_dict(sd, layers), dtype=F8)


def test_uint8_container_and_dequantize_mode(tiny):
    sd, layers = tiny
    q = quantize_state_dict(sd, layers, style="comfy_quant")
    as_u8 = {k: (v.view(torch.uint8) if v.dtype == F8 else v) for k, v in q.items()}
    src = prepare_quantized(open_weights(as_u8, component="transformer"))
    info = src.info(layers[0] + ".weight")
    assert isinstance(info, QuantTensorInfo) and info.dtype == F8
    assert src.get(layers[0] + ".weight").dtype == F8
    assert not any(k.endswith((".comfy_quant", ".weight_scale")) for k in src.keys())
    a = load_transformer(as_u8, dtype=torch.float32)
    b = load_transformer(q, dtype=torch.float32)
    inputs = _inputs(a.config)
    with torch.no_grad():
        assert torch.equal(a(**inputs), b(**inputs))
    # quantize="dequantize": no fp8 modules (for devices without float8, e.g. MPS), same values.
    s2 = open_weights(q, component="transformer")
    plan, config, _, view = plan_transformer(s2)
    d = materialize(lambda: Flux2Transformer(config), plan, view, component="t", dtype=torch.float32,
                    quantize="dequantize")
    assert not fp8_layers(d)
    with torch.no_grad():
        assert _rel(d(**inputs), b(**inputs)) < 1e-6


def test_no_cuda_query_at_import():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "def boom(*a, **k): raise AssertionError('CUDA queried')\n"
        "torch.cuda.get_device_capability = boom\n"
        "torch.cuda.is_available = boom\n"
        "import klein_core, klein_core.quant.fp8 as q\n"
        "layer = q.FP8Linear(16, 16)\n"
        "layer.weight.data = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)\n"
        "layer(torch.randn(2, 16, dtype=torch.bfloat16))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp8_matmul_fallback_is_per_call_and_never_swallows_out_of_memory(monkeypatch, caplog):
    import klein_core.quant.fp8 as q

    layer = FP8Linear.from_linear(torch.nn.Linear(16, 48, bias=False))  # widening: auto takes scaled_mm
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16))
    monkeypatch.setattr(q, "scaled_mm_available", lambda device: True)  # pretend a GPU with fp8 matmul
    tries = []

    def fail(exc):
        def _scaled_mm(inp):
            tries.append(type(exc).__name__)
            raise exc
        return _scaled_mm

    monkeypatch.setattr(layer, "_scaled_mm", fail(torch.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(torch.OutOfMemoryError):
        layer(x)
    assert not layer.full_precision_mm  # out of memory switches nothing
    monkeypatch.setattr(layer, "_scaled_mm", fail(RuntimeError("shape not supported by cuBLASLt")))
    with caplog.at_level("WARNING"):
        assert torch.equal(layer(x), expected)  # this call upcasts...
        assert torch.equal(layer(x), expected)
    assert tries == ["OutOfMemoryError", "RuntimeError", "RuntimeError"]  # ...and the next one tries again
    assert caplog.text.count("fp8 matmul failed") == 1 and not layer.full_precision_mm


@pytest.mark.parametrize("shape, pays", [((3072, 9216), True), ((3072, 18432), True), ((4096, 12288), True),
                                         ((3072, 3072), False), ((4096, 4096), False), ((9216, 3072), False)])
def test_fp8_auto_matmul_only_on_the_shapes_where_it_measured_faster(monkeypatch, shape, pays):
    """matmul="auto" on an fp8-capable GPU: scaled_mm for the widening layers (faster on the H100),
    the upcast for square and narrowing ones (faster there, and the more exact path)."""
    import klein_core.quant.fp8 as q

    monkeypatch.setattr(q, "scaled_mm_available", lambda device: True)
    layer = FP8Linear(*shape, device="meta")
    x = torch.empty(2, shape[0], dtype=torch.bfloat16, device="meta")
    assert layer.scaled_mm_pays is pays and layer._use_scaled_mm(x) is pays
    layer.matmul = "scaled_mm"  # forcing still works on any shape
    assert layer._use_scaled_mm(x)


def test_stored_formats_are_counted_and_named():
    from torch import nn

    from klein_core.quant.formats import describe_formats, prequantized_layers, stored_formats
    from klein_core.quant.ggml import GGMLLinear
    from klein_core.quant.nvfp4 import NVFP4Linear

    n = 256  # one Q4_K block
    model = nn.Sequential(FP8Linear(n, n), FP8Linear(n, n, fmt="float8_e5m2"), GGMLLinear(n, n, 12),
                          GGMLLinear(n, n, 8), GGMLLinear(n, n, 8), NVFP4Linear(n, n), nn.Linear(n, n))
    counts = stored_formats(model)
    assert counts == {"GGUF Q8_0": 2, "fp8 e4m3fn": 1, "fp8 e5m2": 1, "GGUF Q4_K": 1, "NVFP4": 1}
    assert next(iter(counts)) == "GGUF Q8_0"  # most common first
    assert describe_formats({"fp8 e4m3fn": 80}) == "80 layers in fp8 e4m3fn"
    assert describe_formats({"fp8 e4m3fn": 1, "NVFP4": 2}) == "1 layer in fp8 e4m3fn and 2 in NVFP4"
    assert prequantized_layers(model, "q8") == {"fp8 e4m3fn": 1, "fp8 e5m2": 1, "GGUF Q4_K": 1, "NVFP4": 1}
    assert prequantized_layers(model, None) == {} and prequantized_layers(nn.Linear(2, 2), "fp8") == {}


def test_a_device_without_float8_gets_fp8_files_dequantised(tmp_path, tiny, monkeypatch, caplog):
    """Apple's MPS has no float8 dtypes (ComfyUI#8988). An fp8 file loaded for such a device (the CPU
    stands in here, its probe answering no) loads with no fp8 layer, its weights dequantised to the
    compute dtype as they load: the values of quantize='dequantize', with one warning naming the file.
    With quantize='q8' its fp8 layers are dequantised too, never read as raw float8 into GGML blocks.
    quantize='fp8' there is refused, naming the device and what to load with instead."""
    import logging

    import klein_core.files.materialize as mat

    sd, layers = tiny
    path = _write_file(tmp_path, "flux-2-klein-4b-fp8.safetensors", quantize_state_dict(sd, layers, style="comfy_quant"))
    want = load_transformer(path, dtype=torch.bfloat16, quantize="dequantize")
    assert fp8_layers(load_transformer(path, dtype=torch.bfloat16))  # the CPU holds float8: kept
    monkeypatch.setattr(mat, "holds_float8", lambda device: torch.device(device).type != "cpu")
    for quantize in (None, "q8"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="klein_core.files.materialize"):
            got = load_transformer(path, dtype=torch.bfloat16, quantize=quantize)
        assert not fp8_layers(got) and not any(type(m).__name__ == "GGMLLinear" for m in got.modules())
        a, b = got.state_dict(), want.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), quantize
        assert caplog.text.count("cpu holds no float8 tensors; the") == 1, caplog.text
        assert "flux-2-klein-4b-fp8.safetensors are dequantised to torch.bfloat16" in caplog.text
    bf16 = _write_file(tmp_path, "flux-2-klein-4b.safetensors", sd)
    with pytest.raises(ValueError, match=r"cpu cannot hold float8 tensors.*quantize=None"):
        load_transformer(bf16, dtype=torch.bfloat16, quantize="fp8")


def test_float8_storage_probe(monkeypatch):
    """The CPU and CUDA hold float8 (answered without touching CUDA); another device type is probed
    once, by making a one-element float8 tensor there (MPS's refusal stands in)."""
    from klein_core.quant import fp8 as fp8_mod

    assert fp8_mod.holds_float8("cpu") and fp8_mod.holds_float8(torch.device("cuda", 1))
    monkeypatch.setattr(fp8_mod, "_float8_storage", {})
    tried = []

    def no_float8(*args, dtype=None, device=None, **kwargs):
        tried.append((dtype, str(device)))
        raise TypeError("Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that "
                        "dtype.")

    monkeypatch.setattr(fp8_mod.torch, "zeros", no_float8)
    assert not fp8_mod.holds_float8("mps") and not fp8_mod.holds_float8(torch.device("mps"))
    assert tried == [(torch.float8_e4m3fn, "mps")]  # once per device type


def test_quantize_for_a_device_without_float8(tmp_path, tiny, monkeypatch):
    """What the node loader and the training job load with when the weights go to CPU memory first
    (to be streamed or copied to the device): on a device without float8 an fp8 file loads
    dequantised (so its layers never reach the device in fp8), a bf16 file as asked; fp8 storage is
    refused naming the device. Elsewhere the choice passes through untouched."""
    from klein_core.files import loaders

    sd, layers = tiny
    fp8_file = _write_file(tmp_path, "klein-fp8.safetensors", quantize_state_dict(sd, layers, style="comfy_quant"))
    bf16_file = _write_file(tmp_path, "klein.safetensors", sd)
    cpu = torch.device("cpu")
    assert loaders.quantize_for(fp8_file, "transformer", cpu) is None  # the CPU holds float8
    monkeypatch.setattr(loaders, "holds_float8", lambda device: False)  # as MPS answers
    assert loaders.quantize_for(fp8_file, "transformer", cpu) == "dequantize"
    assert loaders.quantize_for(fp8_file, "transformer", cpu, "q8") == "dequantize"
    assert loaders.quantize_for(bf16_file, "transformer", cpu) is None
    assert loaders.quantize_for(bf16_file, "transformer", cpu, "q8") == "q8"
    with pytest.raises(ValueError, match=r"klein.safetensors: cpu cannot hold float8 tensors.*quantize=None"):
        loaders.quantize_for(bf16_file, "transformer", cpu, "fp8")
    model = load_transformer(fp8_file, device=cpu, dtype=torch.bfloat16,
                             quantize=loaders.quantize_for(fp8_file, "transformer", cpu))
    assert not fp8_layers(model)
