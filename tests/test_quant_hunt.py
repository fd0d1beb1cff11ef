"""Hunting defects in quantised weights: fp8 layers (compute dtypes, module casts, LoRA merges), fp8 files'
scale layouts, GGML blocks against gguf-py, and quantise-on-load at the edges of the float ranges.

References are independent of the code under test: fp8 values are read with torch's own float8 casts
and multiplied by their scales in float64; GGML blocks are decoded by ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from extras import require
from safetensors.torch import save_file
from test_nvfp4 import _run

from klein_core.files.loaders import load_transformer
from klein_core.lora.apply import apply_loras
from klein_core.lora.read import load_lora
from klein_core.quant.fp8 import FP8Linear, quantize_fp8
from klein_core.quant.ggml import GGMLLinear, GGMLType, dequantize
from klein_core.testing import tiny_transformer

F8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


def _fp8_layer(w: torch.Tensor, fmt: str) -> tuple[FP8Linear, torch.Tensor, torch.Tensor]:
    q, s = quantize_fp8(w, fmt)
    layer = FP8Linear(w.shape[1], w.shape[0], fmt=fmt)
    layer.weight.data = q
    layer.weight_scale = s
    return layer, q, s


def _float_sd():
    return {k: v.contiguous() for k, v in tiny_transformer().state_dict().items()}


# ---- fp8 layers computing in fp16 ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,amax", [("float8_e5m2", 0.05), ("float8_e5m2", 0.001), ("float8_e4m3fn", 0.005)])
def test_fp8_layer_in_fp16_keeps_its_weight_scale(fmt, amax, parity):
    """Was a bug: an FP8Linear computing in fp16 (the loader's weight_dtype fp16, and bf16 / fp8 on pre-Ampere GPUs,
    which fall back to fp16) rounds its fp32 ``weight_scale`` to fp16 before scaling the weight
    (``FP8Linear.dequantized_weight``: ``self.weight_scale.to(dtype)``). A scale ``amax / fp8_max`` is an fp16
    subnormal for any e5m2 weight with amax < 3.5 and any e4m3 weight with amax < 0.027, so it loses most
    of its bits, and below 6e-8 it becomes 0. Measured (64x128 weight, 8 random inputs): e5m2 amax 0.05: the
    layer's fp16 output is 2.5e-2 (relative L2) from the exact product, where the same dequantised weight as
    a dense fp16 Linear is 4e-4 off; e5m2 amax 0.001: the scale flushes to 0 and the layer outputs zeros
    (relative error 1.0); e4m3 amax 0.005: 1.4e-3 against 3.5e-4. The user sees a quietly distorted or
    dead layer in fp16, no error."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w = w / w.abs().max() * amax
    layer, q, s = _fp8_layer(w, fmt)
    x = torch.randn(8, 128, generator=g)
    exact = F.linear(x.double(), q.double() * s.double())  # the weight the file stands for, in float64
    dense = F.linear(x.half(), (q.double() * s.double()).half())  # the same weight as a plain fp16 Linear
    with torch.no_grad():
        got = layer(x.half())
    assert got.dtype == torch.float16
    rel_layer, rel_dense = _rel(got, exact), _rel(dense, exact)
    parity(f"fp8 {fmt} amax {amax} layer in fp16 vs exact, relative L2", rel_layer)
    assert rel_layer <= 2 * rel_dense + 1e-4, (rel_layer, rel_dense)


def test_fp8_e5m2_file_loaded_in_fp16_matches_its_dequantised_weights(tmp_path):
    """Was a bug: the fp16 scale rounding above, through the loader: an e5m2 scaled-fp8 file (per-tensor fp32
    ``weight_scale``) loaded with ``dtype=torch.float16``. The tiny model's block weights have amax ~0.1-0.2,
    so their e5m2 scales (~2e-6..4e-6) are fp16 subnormals with 5-6 significant bits: each fp8 layer's
    output is off by its scale's rounding. Compared with the same file loaded ``quantize="dequantize"`` in
    fp16 (every fp8 weight times its scale in float32, then cast to fp16, a plain fp16 Linear), the worst
    layer is 1.5e-2 (relative L2) further from the exact product of its stored weights than the plain
    fp16 layer is."""
    sd = _float_sd()
    layers = [k[: -len(".weight")] for k in sd if k.endswith(".weight") and k.startswith(("double_blocks.",
                                                                                          "single_blocks."))
              and sd[k].ndim == 2]
    out = dict(sd)
    for layer in layers:
        q, s = quantize_fp8(sd[layer + ".weight"], "float8_e5m2")
        out[layer + ".weight"], out[layer + ".weight_scale"] = q, s
    save_file(out, str(tmp_path / "e5m2.safetensors"))
    fp8 = load_transformer(tmp_path / "e5m2.safetensors", dtype=torch.float16)
    plain = load_transformer(tmp_path / "e5m2.safetensors", dtype=torch.float16, quantize="dequantize")
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for layer in layers:
        a, b = fp8.get_submodule(layer), plain.get_submodule(layer)
        assert isinstance(a, FP8Linear) and not isinstance(b, FP8Linear)
        x = torch.randn(4, a.in_features, generator=g).half()
        q, s = out[layer + ".weight"], out[layer + ".weight_scale"]
        exact = F.linear(x.double(), q.double() * s.double())
        with torch.no_grad():
            worst = max(worst, _rel(a(x), exact) - _rel(b(x), exact))
    assert worst < 1e-3, f"an fp8 layer in fp16 is {worst:.2e} (relative L2) further from its weights than fp16 allows"


# ---- module casts ------------------------------------------------------------------------------------------------


def test_fp8_model_to_dtype_keeps_fp8_storage_and_its_scales(tmp_path):
    """Was a bug: ``model.to(torch.bfloat16)`` on a model with fp8 layers casts each FP8Linear's float8 weight to bf16
    (float8 counts as a floating dtype for ``nn.Module.to``), doubling the memory the fp8 file saved, and
    rounds its fp32 ``weight_scale`` to bf16; ``.to(torch.float32)`` afterwards leaves fp32 weights (4 bytes
    each) under the rounded scales. Measured on the tiny transformer quantised on load (quantize="fp8"):
    after ``.to(bf16).to(fp32)`` the 212,992 fp8 weights are float32 (parameter bytes 664,576 -> 1,303,552)
    and the output moved by max abs 5.2e-3 (relative L2 2.3e-3), where the same round trip leaves an
    NVFP4 or GGML model bit-identical. NVFP4Linear keeps its scales as integer bit patterns for exactly this reason
    (tests/test_nvfp4.py::test_model_to_dtype_never_rounds_the_scales); GGMLLinear stores uint8. FP8Linear
    has no such guard (klein_core/quant/fp8.py: ``weight`` a float8 Parameter, ``weight_scale`` an fp32
    buffer)."""
    # Weights that bf16 holds exactly: the layers left dense (embedders, norms) then go through the round
    # trip unchanged too, so any change in the output is the fp8 layers'.
    save_file({k: v.to(torch.bfloat16).float() for k, v in _float_sd().items()}, str(tmp_path / "m.safetensors"))
    model = load_transformer(tmp_path / "m.safetensors", dtype=torch.float32, quantize="fp8")
    name = "double_blocks.0.img_attn.qkv"
    before_out = _run(model)
    before_scale = model.get_submodule(name).weight_scale.clone()
    model.to(torch.bfloat16).to(torch.float32)
    layer = model.get_submodule(name)
    assert layer.weight.dtype == torch.float8_e4m3fn, f"fp8 weight became {layer.weight.dtype}"
    assert torch.equal(layer.weight_scale, before_scale), (layer.weight_scale.item(), before_scale.item())
    assert torch.equal(_run(model), before_out)


def test_ggml_model_to_dtype_keeps_its_blocks():
    """Pins that a GGML layer survives ``.to(bf16).to(fp32)`` unchanged (blocks are uint8 bytes; only the bias
    is a float, and fp32 -> bf16 -> fp32 is lossy for it, so the bias here holds bf16-exact values)."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 48)
    lin.weight.data = torch.randn(48, 64, generator=g) * 0.1
    lin.bias.data = (torch.randn(48, generator=g) * 0.1).bfloat16().float()
    layer = GGMLLinear.from_linear(lin, GGMLType.Q8_0)
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        before = layer(x)
        layer.to(torch.bfloat16).to(torch.float32)
        assert layer.qweight.dtype == torch.uint8
        assert torch.equal(layer(x), before)


# ---- LoRA merged into fp8 layers ---------------------------------------------------------------------------------


def _per_row_fp8_file(tmp_path):
    """A tiny transformer whose img qkv of double block 0 is stored fp8 with per-row scales: q, k and v each
    quantised per tensor (as a diffusers-named fp8 file's to_q / to_k / to_v give after fusing), of
    different magnitudes."""
    sd = _float_sd()
    name = "double_blocks.0.img_attn.qkv"
    w = sd[name + ".weight"] * torch.tensor([1.0, 0.3, 3.0]).repeat_interleave(sd[name + ".weight"].shape[0] // 3)[:, None]
    qs, ss = [], []
    for part in w.chunk(3):
        q, s = quantize_fp8(part)
        qs.append(q)
        ss.append(s.expand(part.shape[0]))
    sd[name + ".weight"], sd[name + ".weight_scale"] = torch.cat(qs), torch.cat(ss).contiguous()
    save_file(sd, str(tmp_path / "rows.safetensors"))
    return tmp_path / "rows.safetensors", name, w.shape


def test_lora_merge_into_a_per_row_fp8_layer_leaves_untouched_rows_alone(tmp_path, parity):
    """Was a bug: merging a LoRA into an FP8Linear with per-row scales re-quantises every row under a new absmax
    scale (klein_core/lora/apply.py ``_merge_fp8``: ``amax = merged.abs().amax(dim=1)`` for all rows), also the
    rows the LoRA does not touch. A q-only LoRA (diffusers ``attn.to_q``) merged into the fused img qkv
    changes the k and v rows: measured 10.9% of their values moved, max abs 9.6e-3 (relative L2 ~5e-3 on
    those rows), an error the LoRA did not ask for (merging into bf16 leaves them bit-identical, and per-row
    scales make it avoidable: a row whose delta is zero can keep its codes and scale)."""
    path, name, (out_f, in_f) = _per_row_fp8_file(tmp_path)
    model = load_transformer(path, dtype=torch.float32)
    layer = model.get_submodule(name)
    assert isinstance(layer, FP8Linear) and layer.weight_scale.shape == (out_f,)
    g = torch.Generator().manual_seed(0)
    lora = load_lora({
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, in_f, generator=g) * 0.1,
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(out_f // 3, 4, generator=g) * 0.1,
    })
    n = out_f // 3
    codes0, scale0 = layer.weight.detach().clone(), layer.weight_scale.clone()
    before = codes0.double() * scale0.double()[:, None]
    with apply_loras(model, [(lora, 1.0)]):
        after = layer.weight.double() * layer.weight_scale.double()[:, None]
        assert not torch.equal(after[:n], before[:n])  # the LoRA was merged into q
        moved = (after[n:] - before[n:]).abs()
        parity("LoRA merge into per-row fp8: untouched k/v rows, max abs change", float(moved.max()))
        assert float(moved.max()) == 0.0, (f"{float((moved > 0).double().mean()):.1%} of the rows the LoRA does not "
                                           f"touch changed, max abs {float(moved.max()):.2e}")
    assert torch.equal(layer.weight.view(torch.uint8), codes0.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale0)


def test_lora_on_fp8_strength_zero_and_removal_are_exact(tmp_path):
    """Pins: strength 0 touches no fp8 weight (no re-quantisation) and gives the same output; a merge at
    strength 1 then ``remove()`` restores the fp8 codes and per-row scales bit for bit, and the output."""
    path, name, (out_f, in_f) = _per_row_fp8_file(tmp_path)
    model = load_transformer(path, dtype=torch.float32)
    layer = model.get_submodule(name)
    g = torch.Generator().manual_seed(1)
    lora = load_lora({
        f"diffusion_model.{name}.lora_A.weight": torch.randn(4, in_f, generator=g) * 0.1,
        f"diffusion_model.{name}.lora_B.weight": torch.randn(out_f, 4, generator=g) * 0.1,
    })
    codes0, scale0, out0 = layer.weight.detach().clone(), layer.weight_scale.clone(), _run(model)
    for mode in ("merge", "branch"):
        with apply_loras(model, [(lora, 0.0)], mode=mode):
            assert torch.equal(layer.weight.view(torch.uint8), codes0.view(torch.uint8))
            assert torch.equal(layer.weight_scale, scale0)
            assert torch.equal(_run(model), out0)
    with apply_loras(model, [(lora, 1.0)]):
        assert not torch.equal(_run(model), out0)
    assert torch.equal(layer.weight.view(torch.uint8), codes0.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale0)
    assert torch.equal(_run(model), out0)


# ---- fp8 files: every scale layout -------------------------------------------------------------------------------


def test_fp8_scale_shapes_and_dtypes_load_exactly(tmp_path):
    """Pins that each fp8 scale layout a file may carry loads to exactly ``q * scale``: per-tensor scales stored
    as ``[]`` and ``[1]``, per-row ``[rows]`` and ``[rows, 1]``, scales in fp32, bf16 and fp16, e4m3 and e5m2
    weights, and a ``[1]`` bf16 ``input_scale`` (read as a 0-dim fp32 scalar). The reference decodes each
    weight with torch's float8 cast times the scale as stored, in float32."""
    sd = _float_sd()
    variants = {
        "double_blocks.0.img_attn.qkv": ("float8_e4m3fn", "[1]", torch.float32),
        "double_blocks.0.txt_mlp.0": ("float8_e4m3fn", "[rows]", torch.bfloat16),
        "single_blocks.0.linear1": ("float8_e5m2", "[rows,1]", torch.float32),
        "single_blocks.1.linear2": ("float8_e4m3fn", "[]", torch.bfloat16),
        "double_blocks.0.txt_attn.proj": ("float8_e5m2", "[1]", torch.float16),
    }
    out, ref = dict(sd), {}
    for name, (fmt, shape, sdt) in variants.items():
        w = sd[name + ".weight"]
        fmax = torch.finfo(F8[fmt]).max
        s = ((w.abs().amax(1) if shape.startswith("[rows") else w.abs().amax()) / fmax).to(sdt)
        col = s.double()[:, None] if s.ndim else s.double()
        q = (w.double() / col).clamp(-fmax, fmax).to(F8[fmt])
        stored = {"[]": (), "[1]": (1,), "[rows]": (-1,), "[rows,1]": (-1, 1)}[shape]
        stored = s.reshape(stored)
        out[name + ".weight"], out[name + ".weight_scale"] = q, stored.contiguous()
        out[name + ".input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        ref[name] = (q.float() * col.float()).double()  # W = q * scale in float32 (the format's definition)
    save_file(out, str(tmp_path / "scales.safetensors"))
    model = load_transformer(tmp_path / "scales.safetensors", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    for name, (fmt, _, _) in variants.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, FP8Linear) and layer.weight.dtype == F8[fmt], name
        assert layer.input_scale is not None and layer.input_scale.shape == ()
        assert float(layer.input_scale) == float(torch.tensor(0.02, dtype=torch.bfloat16))
        assert torch.equal(layer.dequantized_weight(torch.float32).double(), ref[name]), name
        x = torch.randn(3, layer.in_features, generator=g)
        with torch.no_grad():
            assert torch.allclose(layer(x).double(), F.linear(x.double(), ref[name]), rtol=1e-5, atol=1e-6), name


# ---- quantise-on-load at the edges of the float ranges -------------------------------------------------------------


@pytest.mark.parametrize("fmt,step", [("float8_e4m3fn", 2.0**-4), ("float8_e5m2", 2.0**-3)])
def test_quantize_fp8_extreme_ranges_stay_finite_and_within_half_a_step(fmt, step):
    """Pins quantise-on-load (``quantize_fp8``) at the ends of bf16: weights up to bf16's max (3.39e38), far
    beyond fp8's max, and down to 1e-3 of the absmax, give finite codes (no inf/NaN from saturation), a
    finite scale, and every value within half an fp8 step of the weight (relative ``step``, plus half the
    smallest subnormal step for values near 0)."""
    big = torch.finfo(torch.bfloat16).max
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(32, 64, generator=g) * (big / 8)).bfloat16()
    w[0, 0], w[1, 1], w[2, 2] = big, -big, 0.0
    q, s = quantize_fp8(w, fmt)
    assert q.dtype == F8[fmt] and torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    back = q.double() * s.double()
    w64 = w.double()
    sub = torch.finfo(F8[fmt]).smallest_normal * 2.0**-3  # below normals: an absolute step
    assert bool(((back - w64).abs() <= w64.abs() * step + s.double() * sub).all())
    assert float(back.abs().max()) == pytest.approx(float(big), rel=step)


# ---- GGML blocks against gguf-py, cast to the half dtypes ------------------------------------------------------------

_SCALE_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
                 "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.mark.parametrize("name", list(_SCALE_FIELDS))
def test_ggml_subnormal_and_negative_zero_scales_match_gguf_in_every_compute_dtype(name):
    """Pins GGML dequantisation with fp16 block scales that are subnormal (random subnormal bit patterns),
    +-0, the smallest normal and +-65504, for every type klein_core reads: float32 bit for bit as
    ``gguf.quants.dequantize``, and the bf16 / fp16 layers compute in as exactly that value cast once
    (never a second rounding)."""
    gguf = require("gguf")
    qt = getattr(gguf.GGMLQuantizationType, name)
    _, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(11)
    rows, blocks = 6, 4
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    specials = np.array([0.0, -0.0, 6.104e-5, -6.104e-5, 5.96e-8, -5.96e-8, 65504, -65504, 0.01, -1.0],
                        np.float16).view(np.uint16)
    for off in _SCALE_FIELDS[name]:
        sub = rng.integers(1, 0x400, (rows, blocks)).astype(np.uint16) | (
            rng.integers(0, 2, (rows, blocks)).astype(np.uint16) << 15)
        bits = np.where(rng.random((rows, blocks)) < 0.5, rng.choice(specials, (rows, blocks)), sub).astype(np.uint16)
        raw[..., off:off + 2] = bits.view(np.uint8).reshape(rows, blocks, 2)
    raw = raw.reshape(rows, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    for dtype, ints in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        ours = dequantize(torch.from_numpy(raw.copy()), int(qt), tuple(ref.shape), dtype)
        want = ref.to(dtype)
        assert torch.equal(ours.view(ints), want.view(ints)), (name, dtype)
