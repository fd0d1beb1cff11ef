"""The fast paths under autograd (training a LoRA on a model set to ``fast``): comfy-kitchen's kernels
have no backward, so QK-norm + RoPE keeps the kernel's forward with klein_core's own backward
(klein_core.accel.qk_norm_rope_grad), and the modulation and the VAE's GroupNorm run plain.

The backward is checked three ways: against finite differences in float64 (``gradcheck``, the
forward written out here, not klein_core's), against autograd through the plain path on a tiny model
(float32 and bf16), and through the Trainer with gradient checkpointing. comfy-kitchen runs its eager
backend on the CPU here; on a GPU its CUDA kernel: tests/gpu."""

from __future__ import annotations

import pytest
import torch
from extras import require

from klein_core import testing as demo
from klein_core.accel import fast
from klein_core.accel.comfy_kitchen import freqs_cis
from klein_core.accel.qk_norm_rope_grad import FusedQKNormRope, records_grad
from klein_core.models.transformer_math import rope_cos_sin
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.train.adapters import LoRASet, preset
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

EPS = 1e-6  # SPEC §1.2's QK-norm epsilon, written out rather than read from klein_core


def _float64_kernel(q, k, freqs, q_scale, k_scale, eps):
    """RMSNorm then the pair rotations ``freqs`` ``[..., D/2, 2, 2]`` applied as matrices, in the
    inputs' dtype: the forward whose gradient the Function must give."""
    out = []
    for x, w in ((q, q_scale), (k, k_scale)):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        out.append(torch.einsum("...ij,...j->...i", freqs, n.unflatten(-1, (-1, 2))).flatten(-2))
    return tuple(out)


def _qk_views(dtype, batch=2, length=5, heads=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    return qkv, qkv[:, :, 0], qkv[:, :, 1]  # q/k: strided views of one projection, as in the blocks


def _freqs(length, dim, batch=1, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_cos_sin(torch.randint(0, 40, (batch, length, 4), generator=g), (dim // 4,) * 4, 2000.0)
    return freqs_cis(cos, sin).unsqueeze(2).to(dtype)  # [B, L, 1, D/2, 2, 2]


@pytest.mark.parametrize("tables", [1, 2])
def test_backward_matches_finite_differences(tables):
    """gradcheck in float64: q, k (views of one projection) and both norm scales, with one table
    for the batch and with a table per sample."""
    qkv, _, _ = _qk_views(torch.float64)
    qkv.requires_grad_(True)
    scales = (1 + 0.1 * torch.randn(2, 8, dtype=torch.float64)).requires_grad_(True)
    freqs = _freqs(5, 8, batch=tables)

    def run(qkv, scales):
        return FusedQKNormRope.apply(qkv[:, :, 0], qkv[:, :, 1], freqs, scales[0], scales[1], EPS, _float64_kernel)

    assert torch.autograd.gradcheck(run, (qkv, scales))
    # the Function's forward is the kernel's, untouched
    q, k = run(qkv, scales)
    ref = _float64_kernel(qkv[:, :, 0], qkv[:, :, 1], freqs, scales[0], scales[1], EPS)
    assert torch.equal(q, ref[0]) and torch.equal(k, ref[1])


def test_only_the_gradients_asked_for():
    """Frozen scales (LoRA training) get no gradient; a k whose output is unused gets none either (the
    backward is handed None for it, not zeros to multiply through)."""
    _, q, k = _qk_views(torch.float64)
    q, k = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    scale = torch.ones(8, dtype=torch.float64)
    out_q, _ = FusedQKNormRope.apply(q, k, _freqs(5, 8), scale, scale, EPS, _float64_kernel)
    out_q.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert k.grad is None and scale.grad is None


def test_records_grad():
    x = torch.ones(2)
    assert not records_grad(x, None)
    assert records_grad(x, x.clone().requires_grad_(True))
    with torch.no_grad():
        assert not records_grad(x.clone().requires_grad_(True))


# -- through a model on the fast path ---------------------------------------------------------

@pytest.fixture
def kitchen_on_cpu(monkeypatch):
    """comfy-kitchen's kernels through the fast paths on the CPU (used on CUDA only), with a count
    of the QK-norm + RoPE kernel's launches."""
    ck = require("comfy_kitchen")
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    launches = []
    real = ck.rms_rope

    def counted(q, *args, **kwargs):
        launches.append(q.requires_grad)  # inside the autograd Function: grad mode is off there
        return real(q, *args, **kwargs)

    monkeypatch.setattr(ck, "rms_rope", counted)
    with ck.use_backend("eager"):
        yield launches


def _inputs(model, dtype, seed=0):
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(2, ids.shape[0], 128, generator=g).to(dtype), "img_ids": ids,
            "txt": torch.randn(2, 6, model.config.context_dim, generator=g).to(dtype),
            "txt_ids": text_position_ids(6), "timesteps": torch.linspace(0.9, 0.3, 2)}


def _trainable(model):
    """A LoRA-like set and more: the first double block's qkv, a single block's linear1, one QK-norm
    scale (trained in a full fine-tune), and the image input."""
    return [model.double_blocks[0].img_attn.qkv.weight, model.single_blocks[-1].linear1.weight,
            model.double_blocks[-1].txt_attn.norm.key_norm.scale]


def _grads(model, kw):
    params = _trainable(model)
    img = kw["img"].clone().requires_grad_(True)
    for p in params:
        p.requires_grad_(True)
    try:
        out = model(**{**kw, "img": img})
        (out.float().square().mean()).backward()
        return [p.grad.clone() for p in params] + [img.grad.clone()]
    finally:
        for p in params:
            p.grad = None
            p.requires_grad_(False)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fast_path_gradients_match_the_plain_path(kitchen_on_cpu, parity):
    """float32: every gradient through the fused steps (kernel forward, own backward) matches
    autograd through the plain path; the kernel ran under autograd (it used to fail there)."""
    model = demo.tiny_transformer()
    kw = _inputs(model, torch.float32)
    plain = _grads(model, kw)
    fast.enable_fast_paths(model, attention="plain")
    fused = _grads(model, kw)
    # Under autograd: one launch per stream of each block, but the first double block's text stream,
    # which nothing trainable reaches yet (it and the self-check launch without autograd).
    assert kitchen_on_cpu.count(True) == 2 * len(model.double_blocks) + len(model.single_blocks) - 1
    worst = max(_rel(f, p) for f, p in zip(fused, plain))
    parity("tiny transformer fp32: gradients, fast path (comfy-kitchen forward, own backward) vs plain, rel L2", worst)
    for f, p in zip(fused, plain):
        torch.testing.assert_close(f, p, rtol=1e-4, atol=1e-6)


def test_fast_path_gradients_in_bf16_are_as_close_as_the_plain_ones(kitchen_on_cpu, parity):
    """bf16: against the float32 plain gradients, the fast path's are no further off than the bf16
    plain path's own (both round the same activations)."""
    model = demo.tiny_transformer()
    kw32 = _inputs(model, torch.float32, seed=3)
    exact = _grads(model, kw32)
    model = model.to(torch.bfloat16)
    kw = _inputs(model, torch.bfloat16, seed=3)
    plain = _grads(model, kw)
    fast.enable_fast_paths(model, attention="plain")
    fused = _grads(model, kw)
    assert kitchen_on_cpu
    for i, (f, p, e) in enumerate(zip(fused, plain, exact)):
        err_fast, err_plain = _rel(f, e), _rel(p, e)
        parity(f"tiny transformer bf16: gradient {i} vs fp32, fast path (plain: {err_plain:.2e}), rel L2", err_fast)
        assert err_fast <= 1.5 * err_plain + 2e-3, (i, err_fast, err_plain)


def _samples(n=3, refs=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g) * 0.5, torch.randn(1, 3, 96, generator=g),
                        tuple(torch.randn(1, 128, 2, 2, generator=g) for _ in range(refs))) for _ in range(n)]


def _train(fast_on, steps=3, refs=0):
    model = demo.tiny_transformer()
    if fast_on:
        fast.enable_fast_paths(model, attention="plain")
    lora = LoRASet(model, preset("style", rank=4), seed=1)
    trainer = Trainer(model, lora, _samples(refs=refs), TrainConfig(steps=steps, learning_rate=1e-3))
    losses = [trainer.train_step() for _ in range(steps)]
    return losses, {k: v.detach().clone() for k, v in lora.state_dict().items()}


@pytest.mark.parametrize("refs", [0, 1])
def test_trainer_on_the_fast_path_with_gradient_checkpointing(kitchen_on_cpu, refs):
    """The Trainer (gradient checkpointing on: each block's forward runs again in the backward pass)
    on a model set to fast trains as on the plain path, text only and editing (a reference joins the
    sequence with its own RoPE time offset): the same losses and LoRA weights."""
    losses_plain, plain = _train(False, refs=refs)
    losses_fast, trained = _train(True, refs=refs)
    assert kitchen_on_cpu
    torch.testing.assert_close(losses_fast, losses_plain, rtol=1e-4, atol=1e-6)
    assert plain.keys() == trained.keys()
    for key in plain:
        torch.testing.assert_close(trained[key], plain[key], rtol=1e-4, atol=1e-6)


def test_fast_vae_under_autograd_runs_the_plain_group_norm(monkeypatch):
    """A loss through the decoder itself (``Flux2VAE.decode`` is no_grad) on a fast VAE: the GroupNorm
    kernel has no backward, so the plain one runs and the gradient is the plain path's (the reference
    run channels-last, as the fast VAE keeps its convolutions); without autograd the kernel runs."""
    ck = require("comfy_kitchen")
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    launches = []
    real = fast.group_norm_silu
    monkeypatch.setattr(fast, "group_norm_silu", lambda *a: launches.append(1) or real(*a))
    vae = demo.tiny_vae().to(torch.bfloat16)
    z0 = torch.randn(1, 32, 6, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grads = []
    with ck.use_backend("eager"):
        for on in (False, True):
            if on:
                fast.enable_fast_vae(vae, compile=False)
                vae.decode(torch.zeros(1, 128, 3, 4, dtype=torch.bfloat16))  # resolves: the kernel runs
                assert launches
                launches.clear()
            else:  # the layout the fast VAE keeps its convolutions in, on the plain path
                vae.to(memory_format=torch.channels_last)
            z = z0.clone().requires_grad_(True)
            vae.decoder(z).float().square().mean().backward()
            grads.append(z.grad)
    assert not launches
    assert torch.equal(grads[1], grads[0])
