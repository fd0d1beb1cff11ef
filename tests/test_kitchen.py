"""comfy-kitchen (ComfyUI's kernel library), the fused-kernel backend of the fast paths, on the CPU
(its eager backend): ``rms_rope`` and ``adaln`` against the plain path and against float64, launches
inside the tensors' device guard, and its fp8 per-tensor (de)quantisation against ours. Exactness
only: GPU speed is for a GPU session. The fast paths' wiring through it: tests/test_fast.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from extras import require

from klein_core.accel import comfy_kitchen as kitchen
from klein_core.accel.comfy_kitchen import KitchenOps, freqs_cis
from klein_core.models.block_ops import PLAIN_OPS
from klein_core.models.transformer_math import rope_cos_sin
from klein_core.quant.fp8 import dequantize, quantize_fp8

ck = require("comfy_kitchen")


@pytest.fixture(autouse=True)
def _eager():
    with ck.use_backend("eager"):
        yield


def _parts(dtype, heads=3, dim=32, lengths=(5, 9), batch=2, seed=0):
    """q/k of two streams as views of their fused projections, as a double block has them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, sum(lengths), 3, heads, dim, generator=g).to(dtype)
    scales = (1 + 0.1 * torch.randn(4, dim, generator=g)).to(dtype)
    return [(st[:, :, 0], st[:, :, 1], scales[2 * i], scales[2 * i + 1])
            for i, st in enumerate(qkv.split(lengths, dim=1))]


def _tables(n, dim, batch=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    axes = (dim // 4,) * 4
    shape = (n, 4) if batch is None else (batch, n, 4)
    cos, sin = rope_cos_sin(torch.randint(0, 64, shape, generator=g), axes, 2000.0)
    return (cos[None, None], sin[None, None]) if batch is None else (cos[:, None], sin[:, None])


def _qk_float64(parts, cos, sin):
    """The exact value of RMSNorm (eps 1e-6, SPEC §1.2; not klein_core's constant) + interleaved RoPE of
    the (rounded) inputs, in float64."""
    out = []
    for which in (0, 1):
        x = torch.cat([p[which].double() * torch.rsqrt(p[which].double().pow(2).mean(-1, keepdim=True) + 1e-6)
                       * p[2 + which].double() for p in parts], dim=1).transpose(1, 2)
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        out.append(x * cos.double() + rotated * sin.double())
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_freqs_cis_is_the_rotation_of_our_tables():
    ids = torch.randint(0, 50, (7, 4))
    cos, sin = rope_cos_sin(ids, (8, 8, 8, 8), 2000.0)
    f = freqs_cis(cos, sin)
    assert f.shape == (7, 16, 2, 2)
    assert torch.equal(f[..., 0, 0], cos[:, 0::2]) and torch.equal(f[..., 1, 0], sin[:, 0::2])
    assert torch.equal(f[..., 0, 1], -sin[:, 0::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim,batch_tables", [(3, 32, False), (24, 128, False), (3, 32, True)])
def test_rms_rope_two_streams(dtype, heads, dim, batch_tables, parity):
    parts = _parts(dtype, heads, dim)
    cos, sin = _tables(14, dim, batch=2 if batch_tables else None)
    kq, kk = KitchenOps().qk_norm_rope(parts, cos, sin)
    pq, pk = PLAIN_OPS.qk_norm_rope(parts, cos, sin)
    assert kq.shape == pq.shape == (2, heads, 14, dim) and kq.dtype == dtype
    # [B, H, N, D] views of contiguous [B, N, H, D]: what the attention kernels read without a copy
    assert kq.transpose(1, 2).is_contiguous() and kk.transpose(1, 2).is_contiguous()
    d = max((kq.float() - pq.float()).abs().max().item(), (kk.float() - pk.float()).abs().max().item())
    truth = _qk_float64(parts, cos, sin)
    ck_err = max(_rel(kq, truth[0]), _rel(kk, truth[1]))
    plain_err = max(_rel(pq, truth[0]), _rel(pk, truth[1]))
    name = f"{str(dtype).removeprefix('torch.')}, H={heads}, D={dim}{', per-batch tables' if batch_tables else ''}"
    parity(f"comfy-kitchen rms_rope vs plain qk_norm_rope ({name}, CPU eager)", d)
    parity(f"rms_rope rel L2 vs float64, comfy-kitchen ({name})", ck_err)
    parity(f"rms_rope rel L2 vs float64, plain path ({name})", plain_err)
    if dtype == torch.float32:
        assert d <= 1e-5
    else:
        # Rounded once (comfy-kitchen) vs twice (plain, as the references): at most a few ulps
        # apart (bf16 ulp at |x| < 4 is 2**-6), and comfy-kitchen no further from the exact value.
        assert d <= (2**-4 if dtype == torch.bfloat16 else 2**-7), d
        assert ck_err <= plain_err * 1.01, (ck_err, plain_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_one_modulation", [False, True])
def test_adaln_matches_plain_modulate(dtype, batch_one_modulation, parity):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 7, 96, generator=g) * 3).to(dtype)
    shift, scale = (torch.randn(2, 2, 1, 96, generator=g) * 0.5).to(dtype).unbind(0)
    if batch_one_modulation:
        shift, scale = shift[:1], scale[:1]
    got = KitchenOps().modulate(x, shift, scale)
    ref = PLAIN_OPS.modulate(x, shift, scale)
    d = parity(f"comfy-kitchen adaln vs plain modulate ({str(dtype).removeprefix('torch.')}, CPU eager)",
               (got.float() - ref.float()).abs().max().item())
    assert got.shape == ref.shape and got.dtype == dtype
    assert d <= (1e-6 if dtype == torch.float32 else 0.0), d  # measured bit-identical in bf16 and fp16


def test_per_token_modulation_and_switched_off_steps_stay_plain(monkeypatch):
    calls = []
    monkeypatch.setattr(ck, "adaln", lambda *a, **k: calls.append("adaln"))
    monkeypatch.setattr(ck, "rms_rope", lambda *a, **k: calls.append("rms_rope"))
    x = torch.randn(1, 4, 32)
    per_token = torch.randn(1, 4, 32)
    assert torch.equal(KitchenOps().modulate(x, per_token, per_token), PLAIN_OPS.modulate(x, per_token, per_token))
    parts, (cos, sin) = _parts(torch.float32, lengths=(3,), batch=1), _tables(3, 32)
    off = KitchenOps(rope=False, modulation=False)
    assert torch.equal(off.modulate(x, per_token[:, :1], per_token[:, :1]),
                       PLAIN_OPS.modulate(x, per_token[:, :1], per_token[:, :1]))
    assert all(torch.equal(a, b) for a, b in zip(off.qk_norm_rope(parts, cos, sin),
                                                 PLAIN_OPS.qk_norm_rope(parts, cos, sin)))
    assert calls == []


def test_rotation_tables_are_built_once_per_table_set(monkeypatch):
    built = []
    monkeypatch.setattr(kitchen, "freqs_cis", lambda c, s: built.append(1) or freqs_cis(c, s))
    ops = KitchenOps()
    parts = _parts(torch.float32)
    cond, uncond = _tables(14, 32, seed=1), _tables(14, 32, seed=2)  # CFG with prompts of two lengths
    for _ in range(4):  # steps: each forward's blocks all get the same tables
        for cos, sin in (cond, uncond):
            ops.qk_norm_rope(parts, cos, sin)
            ops.qk_norm_rope(parts, cos, sin)
    assert len(built) == 2
    ops.qk_norm_rope(parts, cond[0].clone(), cond[1].clone())  # equal values, other tensors: built anew
    assert len(built) == 3
    for seed in range(3, 9):
        ops.qk_norm_rope(parts, *_tables(14, 32, seed=seed))
    assert len(ops._tables) == kitchen._TABLES  # bounded


def test_kitchen_ops_without_comfy_kitchen_names_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_kitchen(name, *args, **kwargs):
        if name == "comfy_kitchen":
            raise ImportError("No module named 'comfy_kitchen'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kitchen)
    with pytest.raises(ImportError, match=r"comfy-kitchen is not installed: pip install comfy-kitchen"):
        KitchenOps()


def test_launches_run_inside_the_tensors_device_guard(monkeypatch):
    """comfy-kitchen launches on the current CUDA stream: the tensors' GPU must be current."""
    guard = kitchen._device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(kitchen._device_guard(torch.device("cpu")), contextlib.nullcontext)
    entered, seen = [], []

    @contextlib.contextmanager
    def fake_guard(device):
        entered.append(device)
        yield
        entered.pop()

    monkeypatch.setattr(kitchen, "_device_guard", fake_guard)
    monkeypatch.setattr(ck, "adaln", lambda x, *a: seen.append(("adaln", list(entered))) or x)
    monkeypatch.setattr(ck, "rms_rope", lambda q, k, *a: seen.append(("rms_rope", list(entered))) or (q, k))
    KitchenOps().modulate(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))
    KitchenOps().qk_norm_rope(_parts(torch.float32, lengths=(2, 3), batch=1), *_tables(5, 32))
    cpu = torch.device("cpu")
    assert seen == [("adaln", [cpu]), ("rms_rope", [cpu]), ("rms_rope", [cpu])]


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
