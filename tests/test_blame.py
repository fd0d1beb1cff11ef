"""The right culprit named: NaN/Inf inside quantised scales (GGUF, NVFP4, fp8) named as the tensor
and file that hold it, a LoRA that overflows when merged refused by name, malformed tiling
arguments named, and a too-small image named instead of "Output size" (issue #28, "Wrong blame,
raw errors")."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from quant_layers import random_nvfp4_layer
from safetensors.torch import save_file

import klein_core as kc
from klein_core.checks import non_finite_tensor, non_finite_weight
from klein_core.quant import nvfp4
from klein_core.quant.fp8 import FP8Linear
from klein_core.quant.ggml import GGMLLinear, GGMLType
from klein_core.testing import build_tiny_components


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


def _run(tr, te, vae, **kw):
    args = dict(prompt="a fox on a hill", width=64, height=64, steps=2, seed=3, cache=None)
    return kc.generate(tr, te, vae, **{**args, **kw})


# ---------------------------------------------------------------------------------------------
# 1. NaN/Inf inside quantised layers: named like a float weight, never "an extreme guidance value"

LAYER = "final_layer.linear"  # every element of its weight reaches the output


def _ggml_from(linear: torch.nn.Linear, qtype: GGMLType) -> GGMLLinear:
    return GGMLLinear.from_linear(linear, qtype)


def _poison_ggml(layer: GGMLLinear, value: float) -> None:
    """One block's fp16 scale set to ``value`` (the first scale field of block 0)."""
    from klein_core.quant.ggml import BLOCKS, SCALE_BYTES

    start, _ = SCALE_BYTES[layer.qtype]
    blocks = layer.qweight.view(-1, BLOCKS[layer.qtype][1])
    blocks[3, start : start + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def _poison_nvfp4(part: str):
    def poison(layer: nvfp4.NVFP4Linear, value: float) -> None:
        if part == "weight_scale_2":
            layer.tensor_scale = torch.tensor(value, dtype=torch.float32).view(torch.int32)
        else:  # one used block scale: e4m3fn has NaN (0x7F) but no Inf, and torch's cast saturates Inf
            plain = nvfp4.unswizzle(layer.block_scale, layer.out_features, layer.in_features // 16).clone()
            plain[5, 1] = 0x7F
            layer.block_scale = nvfp4.swizzle(plain).view(torch.uint8)
    return poison


def _poison_fp8_scale(layer: FP8Linear, value: float) -> None:
    layer.weight_scale.view(-1)[0] = value


CASES = {  # id -> (make the quantised layer, poison it, the tensor the error must name, words it must give)
    "gguf-q8_0": (lambda lin: _ggml_from(lin, GGMLType.Q8_0), _poison_ggml, "weight", "GGUF Q8_0 block scales"),
    "gguf-q4_0": (lambda lin: _ggml_from(lin, GGMLType.Q4_0), _poison_ggml, "weight", "GGUF Q4_0 block scales"),
    "gguf-q5_1": (lambda lin: _ggml_from(lin, GGMLType.Q5_1), _poison_ggml, "weight", "GGUF Q5_1 block scales"),
    "nvfp4-tensor-scale": (random_nvfp4_layer, _poison_nvfp4("weight_scale_2"), "weight_scale_2",
                           "NVFP4 per-tensor scale"),
    "nvfp4-block-scale": (random_nvfp4_layer, _poison_nvfp4("weight_scale"), "weight_scale", "NVFP4 block scales"),
    "fp8-weight-scale": (FP8Linear.from_linear, _poison_fp8_scale, "weight_scale", ""),
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("case", list(CASES))
def test_non_finite_quantised_scales_are_named(tiny, case, value):
    make, poison, suffix, words = CASES[case]
    tr = copy.deepcopy(tiny[0])
    layer = make(tr.get_submodule(LAYER))
    tr.final_layer.linear = layer
    tr.source = "poisoned_transformer.gguf"
    _run(tr, tiny[1], tiny[2])  # the quantised model runs before the poison
    assert non_finite_tensor(tr) is None
    poison(layer, value)
    with pytest.raises(kc.NonFiniteWeights) as err:
        _run(tr, tiny[1], tiny[2])
    msg = str(err.value)
    assert f"'{LAYER}.{suffix}'" in msg and "poisoned_transformer.gguf" in msg, msg
    assert words in msg and "guidance" not in msg, msg
    assert non_finite_weight(tr) == f"{LAYER}.{suffix}"


def test_packed_bytes_are_never_read_as_floats():
    """Codes whose bytes would be NaN as floats, and NaN bytes in the unused padding of NVFP4's
    swizzled block scales, are not corruption."""
    lin = torch.nn.Linear(64, 40, bias=False)
    g = _ggml_from(lin, GGMLType.Q8_0)
    blocks = g.qweight.view(-1, 34)
    blocks[:, 2:] = 0xFF  # int8 codes of -1: as fp16 / bf16 / fp8 bytes these would be NaN
    assert non_finite_tensor(g) is None
    n = random_nvfp4_layer(lin)
    n.qweight.fill_(0xFF)
    n.block_scale.view(-1)[-1] = 0x7F  # e4m3fn NaN, in the padding (40 rows padded to 128)
    assert non_finite_tensor(n) is None
    n.input_scale = torch.tensor(float("nan")).view(torch.int32)
    assert non_finite_tensor(n) == ("input_scale", "its NVFP4 input scale")


def test_meta_quantised_layers_are_skipped():
    assert non_finite_tensor(GGMLLinear(64, 40, GGMLType.Q8_0, device="meta")) is None
    assert non_finite_tensor(nvfp4.NVFP4Linear(64, 40, device="meta")) is None


# ---------------------------------------------------------------------------------------------
# 2. A LoRA whose finite factors overflow when multiplied: refused when applied, by name


def _lora_file(path, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    save_file({f"diffusion_model.{name}.{role}.weight": t.contiguous()
               for name, (a, b) in factors.items() for role, t in (("lora_A", a), ("lora_B", b))}, path)
    return kc.load_lora(path)


def _factors(module: torch.nn.Linear, value: float, rank: int = 4):
    return torch.full((rank, module.in_features), value), torch.full((module.out_features, rank), value)


@pytest.mark.parametrize("how", ["merge", "branch", "with_loras"])
@pytest.mark.parametrize("dtype,value", [(torch.float32, 1e30), (torch.float16, 1e3), (torch.bfloat16, 1e30)],
                         ids=["fp32-1e30", "fp16-1e3", "bf16-1e30"])
def test_a_lora_that_overflows_is_refused_by_name(tiny, tmp_path, how, dtype, value):
    tr = copy.deepcopy(tiny[0]).to(dtype)
    tr.source = "klein_transformer.safetensors"
    good = "double_blocks.0.img_attn.qkv"  # applied first, then rolled back
    lora = _lora_file(tmp_path / "huge_lora.safetensors", {
        good: _factors(tr.get_submodule(good), 0.01), LAYER: _factors(tr.get_submodule(LAYER), value)})
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    with pytest.raises(ValueError) as err:
        if how == "with_loras":
            kc.with_loras(tr, lora)
        else:
            kc.apply_loras(tr, lora, mode=how)
    msg = str(err.value)
    assert "huge_lora.safetensors" in msg and LAYER in msg and "not finite" in msg, msg
    assert "klein_transformer" not in msg
    assert all(torch.equal(v, before[k]) for k, v in tr.state_dict().items()), "a refused LoRA changed the model"
    assert not any(m._forward_hooks for m in tr.modules()), "a refused LoRA left hooks behind"
    # a sane LoRA still applies, in both modes
    fine = _lora_file(tmp_path / "fine.safetensors", {LAYER: _factors(tr.get_submodule(LAYER), 0.01)})
    kc.apply_loras(tr, fine, mode="branch").remove()
    kc.apply_loras(tr, fine, mode="merge").remove()


def test_two_loras_that_overflow_only_together_are_both_named(tiny, tmp_path):
    tr = copy.deepcopy(tiny[0])
    lin = tr.get_submodule(LAYER)
    one = _lora_file(tmp_path / "one.safetensors", {LAYER: _factors(lin, 1.35e19, rank=1)})  # delta 1.8e38 each
    two = _lora_file(tmp_path / "two.safetensors", {LAYER: _factors(lin, 1.35e19, rank=1)})
    with pytest.raises(ValueError, match=r"one\.safetensors.*two\.safetensors: their summed delta"):
        kc.apply_loras(tr, [one, two], mode="merge")
    kc.apply_loras(tr, one, mode="merge").remove()  # each alone fits


def test_an_fp8_layer_refuses_an_overflowing_lora(tiny, tmp_path):
    tr = copy.deepcopy(tiny[0])
    tr.final_layer.linear = FP8Linear.from_linear(tr.final_layer.linear)
    lora = _lora_file(tmp_path / "huge.safetensors", {LAYER: _factors(tiny[0].get_submodule(LAYER), 1e30)})
    w, s = tr.final_layer.linear.weight.clone(), tr.final_layer.linear.weight_scale.clone()
    for mode in ("merge", "branch"):
        with pytest.raises(ValueError, match=r"huge\.safetensors: .*final_layer\.linear.*not finite"):
            kc.apply_loras(tr, lora, mode=mode)
    assert torch.equal(tr.final_layer.linear.weight.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(tr.final_layer.linear.weight_scale, s)


def test_a_packed_layer_refuses_an_overflowing_lora_branch(tiny, tmp_path):
    tr = copy.deepcopy(tiny[0])
    tr.final_layer.linear = GGMLLinear.from_linear(tr.final_layer.linear, GGMLType.Q8_0)
    lora = _lora_file(tmp_path / "huge.safetensors", {LAYER: _factors(tiny[0].get_submodule(LAYER), 1e30)})
    with pytest.raises(ValueError, match=r"huge\.safetensors: .*final_layer\.linear.*not finite"):
        kc.apply_loras(tr, lora, mode="branch")


# ---------------------------------------------------------------------------------------------
# 3. Malformed tiling arguments: named, never torch's own TypeError


class _FakeVAE:
    class config:  # noqa: N801
        downscale = 16

    @staticmethod
    def decode(z):
        return torch.zeros(z.shape[0], 3, z.shape[-2] * 16, z.shape[-1] * 16)

    @staticmethod
    def encode(x):
        return torch.zeros(x.shape[0], 128, x.shape[-2] // 16, x.shape[-1] // 16)


def _tiling_calls():
    from klein_core.memory import tiling as t

    vae, z, px = _FakeVAE(), torch.zeros(1, 128, 8, 8), torch.zeros(1, 3, 128, 128)
    return {  # argument -> call with that argument set to the value
        "tile_overlap/tile": lambda v: t.tile_overlap(v),
        "tile_starts/size": lambda v: t.tile_starts(v, 8, 2),
        "tile_starts/tile": lambda v: t.tile_starts(64, v, 2),
        "tile_starts/overlap": lambda v: t.tile_starts(64, 8, v),
        "decode_tiled/tile": lambda v: t.decode_tiled(vae, z, tile=v, overlap=1),
        "decode_tiled/overlap": lambda v: t.decode_tiled(vae, z, tile=4, overlap=v),
        "decode_tiled/latents": lambda v: t.decode_tiled(vae, v),
        "encode_tiled/tile": lambda v: t.encode_tiled(vae, px, tile=v, overlap=16),
        "encode_tiled/overlap": lambda v: t.encode_tiled(vae, px, tile=64, overlap=v),
        "encode_tiled/pixels": lambda v: t.encode_tiled(vae, v),
        "tiling.decode/tile": lambda v: t.decode(vae, z, v),
        "tiling.encode/tile": lambda v: t.encode(vae, px, v),
    }


BAD_NUMBERS = [2.5, "64", True, float("nan"), [4], -1]
BAD_TENSORS = ["x", None, 3, torch.zeros(3, 8, 8), torch.zeros(1, 3, 0, 16)]


@pytest.mark.parametrize("arg", list(_tiling_calls()))
def test_malformed_tiling_arguments_are_named(arg):
    call = _tiling_calls()[arg]
    name = arg.split("/")[1]
    for bad in BAD_TENSORS if name in ("latents", "pixels") else BAD_NUMBERS:
        with pytest.raises((TypeError, ValueError)) as err:
            call(bad)
        msg = str(err.value)
        assert msg.startswith(arg.split("/")[0] + ":") and name in msg, (arg, bad, msg)


def test_valid_tiling_arguments_still_work():
    from klein_core.memory import tiling as t

    vae = _FakeVAE()
    assert t.decode_tiled(vae, torch.zeros(1, 128, 8, 8), tile=np.int64(4), overlap=1).shape == (1, 3, 128, 128)
    assert t.encode_tiled(vae, torch.zeros(1, 3, 128, 128), tile=64, overlap=16).shape == (1, 128, 8, 8)
    assert t.tile_starts(64, 8, 0) == list(range(0, 64, 8))
    with pytest.raises(ValueError, match="tile_starts: tile \\(8 positions\\) must be larger than overlap"):
        t.tile_starts(64, 8, 8)


# ---------------------------------------------------------------------------------------------
# 4. A size taken from an image names that image, not "Output size"


@pytest.mark.parametrize("kw,words", [
    (lambda: {"references": [Image.new("RGB", (1, 1))]}, "reference 1 (1x1 px) is too small"),
    (lambda: {"references": [Image.new("RGB", (1, 1))], "width": 64}, "reference 1 (1x1 px) is too small"),
    (lambda: {"references": [torch.zeros(1, 3, 32, 64)]}, "reference 1 (64x32 px) is too small"),
    (lambda: {"image": Image.new("RGB", (64, 20000))}, "the init image (64x20000 px) is too small"),
    (lambda: {"image": Image.new("RGB", (20000, 64)), "mask": Image.new("L", (20000, 64), 255)},
     "the init image (20000x64 px) is too small"),
], ids=["ref-1x1", "ref-1x1-width-given", "ref-tensor", "init-tall", "init-wide-masked"])
def test_a_too_small_image_is_named(tiny, kw, words):
    with pytest.raises(ValueError) as err:
        _run(*tiny, **{"width": None, "height": None, **kw()})
    msg = str(err.value)
    assert words in msg and "Output size" not in msg, msg


def test_explicit_sizes_keep_their_message(tiny):
    with pytest.raises(ValueError, match=r"^Output size 30x64 is too small"):
        _run(*tiny, width=30, height=64)
    # a side given explicitly that is too small is blamed as given, even with a reference
    with pytest.raises(ValueError, match=r"^Output size 32x64 is too small"):
        _run(*tiny, width=32, height=None, references=[Image.fromarray(np.full((64, 64, 3), 128, np.uint8))])


def test_resolve_size_names_its_source():
    from klein_core.pipeline.request import resolve_size

    assert resolve_size(None, None, (768, 512), size_from="reference 1 (768x512 px)") == (768, 512)
    with pytest.raises(ValueError, match=r"^reference 1 \(40x40 px\) is too small .* width and height under 64"):
        resolve_size(None, None, (32, 32), size_from="reference 1 (40x40 px)")
    with pytest.raises(ValueError, match=r"^Output size 32x32 is too small"):  # no source given: as before
        resolve_size(None, None, (32, 32))
    with pytest.raises(ValueError, match=r"^Output size 48x512 is too small"):  # the explicit side is to blame
        resolve_size(48, None, (768, 512), size_from="reference 1 (768x512 px)")
