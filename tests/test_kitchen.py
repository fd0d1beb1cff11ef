"""comfy-kitchen (ComfyUI's kernel library) against klein_core's own steps, on the CPU (its eager
backend): fused QK-RMSNorm + RoPE, modulation (adaln), a whole transformer run through it, and its
fp8 per-tensor (de)quantisation against ours. Exactness only: GPU speed is for a GPU session."""

from __future__ import annotations

import pytest
import torch

import klein_core as kc
from klein_core.accel.kitchen import KitchenOps, enable_kitchen_ops, freqs_cis
from klein_core.models.block_ops import PLAIN_OPS
from klein_core.models.transformer_math import rope_cos_sin
from klein_core.quant.fp8 import dequantize, quantize_fp8
from klein_core.testing import tiny_transformer

ck = pytest.importorskip("comfy_kitchen")


@pytest.fixture(autouse=True)
def _eager():
    with ck.use_backend("eager"):
        yield


def test_freqs_cis_is_the_rotation_of_our_tables():
    ids = torch.randint(0, 50, (7, 4))
    cos, sin = rope_cos_sin(ids, (8, 8, 8, 8), 2000.0)
    f = freqs_cis(cos, sin)
    assert f.shape == (7, 16, 2, 2)
    assert torch.equal(f[..., 0, 0], cos[:, 0::2]) and torch.equal(f[..., 1, 0], sin[:, 0::2])
    assert torch.equal(f[..., 0, 1], -sin[:, 0::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_rope_and_adaln_against_the_plain_ops(dtype, parity):
    g = torch.Generator().manual_seed(0)
    heads, dim, lengths = 3, 32, (5, 9)
    qkv = torch.randn(2, sum(lengths), 3, heads, dim, generator=g).to(dtype)
    scales = (1 + 0.1 * torch.randn(4, dim, generator=g)).to(dtype)
    parts = [(st[:, :, 0], st[:, :, 1], scales[2 * i], scales[2 * i + 1])
             for i, st in enumerate(qkv.split(lengths, dim=1))]
    cos, sin = rope_cos_sin(torch.randint(0, 64, (sum(lengths), 4), generator=g), (8, 8, 8, 8), 2000.0)
    cos, sin = cos[None, None], sin[None, None]
    kq, kk = KitchenOps().qk_norm_rope(parts, cos, sin)
    pq, pk = PLAIN_OPS.qk_norm_rope(parts, cos, sin)
    d_rope = max((kq.float() - pq.float()).abs().max().item(), (kk.float() - pk.float()).abs().max().item())
    x = (torch.randn(2, 7, 96, generator=g) * 3).to(dtype)
    shift, scale = (torch.randn(2, 1, 96, generator=g) * 0.5).to(dtype).unbind(0)
    shift, scale = shift[None].expand(2, 1, 96), scale[None].expand(2, 1, 96)
    d_mod = (KitchenOps().modulate(x, shift, scale).float() - PLAIN_OPS.modulate(x, shift, scale).float()).abs().max()
    name = str(dtype).removeprefix("torch.")
    parity(f"comfy-kitchen rms_rope vs klein qk_norm_rope ({name}, CPU eager)", d_rope)
    parity(f"comfy-kitchen adaln vs klein modulate ({name}, CPU eager)", d_mod.item())
    # bf16: one rounding of the normalised values apart (measured 1.6e-2); adaln measured equal
    assert d_rope <= (1e-5 if dtype == torch.float32 else 0.03)
    assert d_mod <= (1e-6 if dtype == torch.float32 else 2**-7)


def test_whole_transformer_through_comfy_kitchen(parity):
    model = tiny_transformer().float()
    g = torch.Generator().manual_seed(1)
    args = dict(img=torch.randn(1, 12, 128, generator=g), img_ids=kc.position_ids(3, 4),
                txt=torch.randn(1, 5, 96, generator=g), txt_ids=kc.text_position_ids(5), timesteps=torch.tensor([0.7]))
    with torch.no_grad():
        plain = model(**args)
        enable_kitchen_ops(model)
        kitchen = model(**args)
    model.ops = PLAIN_OPS
    diff = parity("tiny transformer fp32: comfy-kitchen ops vs plain (CPU eager)", (kitchen - plain).abs().max().item())
    assert diff <= 1e-5


def test_fp8_per_tensor_against_ours(parity):
    w = torch.randn(64, 96) * 0.1
    q, scale = quantize_fp8(w)
    theirs = ck.quantize_per_tensor_fp8(w, scale.float())
    assert torch.equal(theirs.view(torch.uint8), q.view(torch.uint8))  # the same fp8 codes
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize(q, scale, dtype)
        kit = ck.dequantize_per_tensor_fp8(q, scale.float(), dtype)
        parity(f"comfy-kitchen fp8 dequantise vs klein's ({str(dtype).removeprefix('torch.')})",
               (ours.float() - kit.float()).abs().max().item())
        # klein multiplies in float32 and rounds once; comfy-kitchen multiplies in the output dtype
        assert (ours.float() - kit.float()).abs().max() <= (0 if dtype == torch.float32 else 2e-3)
