"""Each fast path against the plain path on the device: every attention backend, the fused kernels
(comfy-kitchen's QK-RMSNorm + RoPE and modulation), torch.compile of the blocks, the fast VAE decode,
and a whole generation with all of them.

Tolerances (bf16 on CUDA). Attention kernels and fused kernels change the order of the float32
accumulations and where bf16 rounding happens; the library's own self-check accepts 2% relative
max error per op (klein_core.accel.fast._compare). Through the blocks the output of one forward
must stay within 2% relative L2 of the plain path, the latents of a 4-step generation within 3% and
the bf16 fast VAE decode within 5% (fp32: 1e-5, 1e-5 and the same 5% for the bf16 decoder). On the
CPU every backend falls back to the plain path, so the results are identical there.
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch

import klein_core as kc
from klein_core.accel import fast
from klein_core.accel.comfy_kitchen import kitchen_available

from .helpers import forward, load_small, rel_l2, tag, transformer_inputs


def _tol(gpu) -> float:
    return 2e-2 if gpu.half else 1e-5


def _expected_attention(gpu, requested: str) -> set[str]:
    """The backend names ``requested`` may resolve to on this device."""
    if gpu.cpu or requested == "plain":
        return {"plain"}
    if requested in ("sdpa", "sdpa_cudnn"):
        return {requested}
    if requested == "auto":  # the measured table: sdpa_cudnn on sm_90, sdpa elsewhere
        return {fast.auto_attention(gpu.device)}
    return {requested, "sdpa"}  # flash3 / flash2 fall back to sdpa when not installed or not this GPU


@pytest.fixture(scope="module")
def model(small):
    return small[0]


@pytest.mark.parametrize("attention", fast.ATTENTION_BACKENDS)
def test_attention_backends_match_plain(gpu, model, attention, parity, caplog):
    inputs = transformer_inputs(model, gpu, 16, 16, txt_len=64, ref=(8, 12), batch=2)
    plain = forward(model, inputs)
    try:
        with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
            ops = fast.enable_fast_paths(model, attention=attention, fused_rope=False, fused_modulation=False)
            out = forward(model, inputs)
    finally:
        fast.disable_fast_paths(model)
    (described,) = ops.resolved().values()
    ran = described.split(",")[0].split("=")[1]
    assert ran in _expected_attention(gpu, attention), described
    assert "self-check" not in caplog.text, caplog.text  # a backend that fails its check is a bug here
    rel = parity(tag(gpu, f"attention={attention} (ran {ran}) vs plain, relative L2"), rel_l2(out, plain))
    assert rel < _tol(gpu), rel


@pytest.fixture
def fused_here(gpu, monkeypatch):
    """Skip without comfy-kitchen; in CPU mode let the fast paths use it on the CPU (its eager code)."""
    if not kitchen_available():
        pytest.skip("comfy-kitchen is not installed (on the device: carry its wheel, benchmarks/GPU_SESSION.md)")
    if gpu.cpu:
        monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("which", ["qk-norm+rope", "modulation", "elementwise", "all"])
def test_fused_kernels_match_plain(gpu, model, which, parity, fused_here):
    rope, mod = which in ("qk-norm+rope", "all"), which in ("modulation", "all")
    elementwise = which in ("elementwise", "all")
    inputs = transformer_inputs(model, gpu, 16, 16, txt_len=64, ref=(8, 12), batch=2)
    plain = forward(model, inputs)
    try:
        ops = fast.enable_fast_paths(model, attention="plain", fused_rope=rope, fused_modulation=mod,
                                     fused_elementwise=elementwise)
        out = forward(model, inputs)
    finally:
        fast.disable_fast_paths(model)
    (described,) = ops.resolved().values()
    if rope:
        assert "qk-norm+rope=comfy-kitchen" in described, described  # passed its self-check and ran
    if mod:
        assert "modulation=comfy-kitchen" in described, described
    if elementwise:
        assert "elementwise=fused" in described, described
        if not gpu.cpu and importlib.util.find_spec("triton") is not None:
            assert "swiglu=triton" in described, described  # passed its self-check and ran
    rel = parity(tag(gpu, f"fused {which} vs plain, relative L2"), rel_l2(out, plain))
    # fp32: 1e-6 (CPU measured 3.1e-8; a wrong RMSNorm epsilon, 1e-4 for 1e-6, gives 3.3e-6)
    assert rel < (_tol(gpu) if gpu.half else 1e-6), rel


def test_lora_training_step_on_the_fast_path(gpu, model, parity, fused_here, monkeypatch):
    """A LoRA training step (gradient checkpointing on) on the model set to ``fast``: comfy-kitchen's
    QK-norm + RoPE kernel runs the forward, under autograd, with klein_core's own backward
    (klein_core.accel.qk_norm_rope_grad); the attention backend's backward runs too. The LoRA
    gradients match the plain path's (before the fix the first backward pass failed)."""
    from klein_core.accel import comfy_kitchen as kitchen_mod
    from klein_core.train import LoRASet, TrainConfig, Trainer, TrainSample, preset

    real = kitchen_mod.FusedQKNormRope
    applied = []

    class Counted:
        @staticmethod
        def apply(*args):
            applied.append(1)
            return real.apply(*args)

    monkeypatch.setattr(kitchen_mod, "FusedQKNormRope", Counted)
    g = torch.Generator().manual_seed(0)
    sample = TrainSample(torch.randn(1, 128, 16, 16, generator=g),
                         torch.randn(1, 64, model.config.context_dim, generator=g))
    grads = {}
    try:
        for speed in ("plain", "fast"):
            if speed == "fast":
                ops = fast.enable_fast_paths(model)
            lora = LoRASet(model, preset("style", rank=4), seed=1, device=gpu.device)
            up = torch.Generator().manual_seed(2)
            with torch.no_grad():  # B off zero, so A gets gradients too
                for layer in lora.layers.values():
                    layer.up.copy_(torch.randn(layer.up.shape, generator=up).to(layer.up) * 0.1)
            trainer = Trainer(model, lora, [sample], TrainConfig(steps=1, seed=0, gradient_checkpointing=True))
            try:
                trainer.train_step()
            finally:
                trainer.close()
            grads[speed] = torch.cat([p.grad.flatten().float() for p in trainer.params])
    finally:
        fast.disable_fast_paths(model)
    (described,) = ops.resolved().values()
    assert "qk-norm+rope=comfy-kitchen" in described, described
    assert applied, "the fused QK-norm + RoPE did not run under autograd"
    assert torch.isfinite(grads["fast"]).all() and grads["fast"].abs().sum() > 0
    rel = parity(tag(gpu, f"LoRA gradients, fast path ({described}) vs plain, relative L2"),
                 rel_l2(grads["fast"], grads["plain"]))
    assert rel < (5e-2 if gpu.half else 1e-4), rel


@pytest.mark.cuda("the one-pass SwiGLU is a Triton kernel for CUDA; tests/test_fast.py covers its seam on the CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_pass_swiglu_kernel(gpu, dtype, parity):
    """The Triton SwiGLU against silu-then-multiply: a slice of a wider projection in, a slice of a
    wider buffer out (as the single blocks use it), odd sizes. It rounds the SiLU as torch does, so
    in bf16/fp16 almost every element is bit-identical and none is more than two rounding steps off
    (H100: bf16 all within one, fp16 99.97% identical, max 1.7 steps). In float32 its sigmoid and
    torch's differ in the last bits (H100: 60% identical, max relative 8.6e-7)."""
    from klein_core.accel.triton_swiglu import swiglu
    from klein_core.models.block_ops import PLAIN_OPS

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator(device=gpu.device).manual_seed(0)
    wide = (torch.randn(3, 517, 96 + 2 * 3000, generator=g, device=gpu.device) * 4).to(dtype)
    x = wide[..., 96:]
    out = torch.full((3, 517, 50 + 3000), 7.0, dtype=dtype, device=gpu.device)
    swiglu(x, out[..., 50:])
    ref = PLAIN_OPS.swiglu(x)
    assert torch.all(out[..., :50] == 7.0)  # nothing written outside the slice
    got = out[..., 50:]
    same = (got == ref).float().mean().item()
    rel = ((got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max().item()
    parity(tag(gpu, f"one-pass SwiGLU {dtype} vs silu*up: share bit-identical"), same)
    parity(tag(gpu, f"one-pass SwiGLU {dtype} vs silu*up: max relative difference"), rel)
    if dtype == torch.float32:
        assert rel < 1e-5, rel
    else:
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        assert same > 0.99 and rel <= 2 * ulp, (same, rel)
    assert torch.equal(swiglu(x), got)


@pytest.mark.cuda("torch.compile with inductor needs minutes on 2 CPU cores; tests/test_fast.py covers the "
                  "wiring with the eager backend")
def test_compile_matches_plain(gpu, model, parity, caplog):
    inputs = transformer_inputs(model, gpu, 16, 16, txt_len=64, ref=(8, 12), batch=2)
    plain = forward(model, inputs)
    try:
        with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
            ops = fast.enable_fast_paths(model, compile=True)
            first = forward(model, inputs)
            second = forward(model, inputs)
    finally:
        fast.disable_fast_paths(model)
        torch._dynamo.reset()
    assert torch.equal(first, second)
    (described,) = ops.resolved().values()
    assert "compile=True" in described and "qk-norm+rope=inductor" in described, described
    assert any("first forward" in r.getMessage() for r in caplog.records)
    rel = parity(tag(gpu, "torch.compile (inductor) vs plain, relative L2"), rel_l2(first, plain))
    assert rel < _tol(gpu), rel


@pytest.mark.cuda("torch.compile with inductor needs minutes on 2 CPU cores; "
                  "tests/test_text_encoder_compile.py covers the wiring with the eager backend")
def test_compiled_text_encoder_matches_plain(gpu, small, parity, caplog):
    """``speed="compile"`` compiles the text encoder's layers (Inductor fuses its norms, RoPE and
    SwiGLU): the features stay within the fused kernels' tolerance of the plain path, a second
    prompt of the same shape reuses the graph, and nothing falls back."""
    from klein_core.accel.text_encoder import disable_fast_text_encoder, enable_fast_text_encoder
    from klein_core.pipeline.tokenizer import tokenize_prompts

    te = small[1]
    ids, mask = tokenize_prompts(["a red fox in the snow", "two cats on a sofa"], max_length=512)
    other_ids, other_mask = tokenize_prompts(["an old boat", "rain on a window at night"], max_length=512)
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    try:
        with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
            enable_fast_text_encoder(te)
            first = te.encode(ids, mask)
            other = te.encode(other_ids, other_mask)
            second = te.encode(ids, mask)
    finally:
        disable_fast_text_encoder(te)
        torch._dynamo.reset()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in caplog.records if "first forward" in r.getMessage()]) == 1
    assert torch.equal(first, second)
    for name, out, ref in (("prompt 1", first, plain), ("prompt 2", other, plain_other)):
        rel = parity(tag(gpu, f"compiled text encoder vs plain ({name}), relative L2"), rel_l2(out, ref))
        assert rel < _tol(gpu), rel


@pytest.mark.cuda("CUDA graphs exist only on a CUDA device; tests/test_text_graph.py covers the bookkeeping "
                  "around them on the CPU")
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain"])
def test_text_encoder_graph_replay(gpu, small, parity, caplog, compiled):
    """Under ``speed="compile"`` the text encoder's forward is recorded once per prompt shape as a CUDA
    graph and replayed: another prompt of the same shape gets its own features, each within 1e-3 of
    the compiled forward without replay; a weight replaced by one at a new address is recorded again
    (never read from the old memory); nothing warns. The same for the plain forward's replay
    (``compile=False, graphs=True``, what ``speed="fast"`` sets), against the plain forward."""
    from klein_core.accel.text_encoder import disable_fast_text_encoder, enable_fast_text_encoder
    from klein_core.accel.text_graph import graphed_forward
    from klein_core.pipeline.tokenizer import tokenize_prompts

    te = small[1]
    ids, mask = tokenize_prompts(["a red fox in the snow", "two cats on a sofa"], max_length=512)
    other_ids, other_mask = tokenize_prompts(["an old boat", "rain on a window at night"], max_length=512)
    proj = te.layers[0].mlp.down_proj
    weight = proj.weight
    try:
        enable_fast_text_encoder(te, compile=compiled, graphs=False)
        ref, ref_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
        enable_fast_text_encoder(te, compile=compiled, graphs=True)
        forward = graphed_forward(te)
        assert forward is not None
        with caplog.at_level(logging.INFO, logger="klein_core.accel.text_graph"):
            first = te.encode(ids, mask)
            other = te.encode(other_ids, other_mask)
            again = te.encode(ids, mask)
            assert (forward.captures, forward.replays) == (1, 3)
            proj.weight = torch.nn.Parameter(weight.detach() * 1.5, requires_grad=False)
            moved = te.encode(ids, mask)
            assert (forward.captures, forward.moves) == (2, 1)
            enable_fast_text_encoder(te, compile=compiled, graphs=False)
            ref_moved = te.encode(ids, mask)
    finally:
        proj.weight = weight
        disable_fast_text_encoder(te)
        torch._dynamo.reset()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert torch.equal(first, again) and not torch.equal(first, other)
    for name, out, expected in (("prompt 1", first, ref), ("prompt 2", other, ref_other),
                                ("weight moved", moved, ref_moved)):
        what = "compiled" if compiled else "plain"
        rel = parity(tag(gpu, f"text encoder CUDA graph vs {what} forward ({name}), relative L2"),
                     rel_l2(out, expected))
        assert rel < 1e-3, (name, rel)
    assert rel_l2(moved, ref) > 1e-3  # the moved weight's result, not the old one's


@pytest.mark.cuda("CUDA graphs exist only on a CUDA device; tests/test_text_graph.py covers the same on the CPU "
                  "with a stand-in recorder")
def test_fast_text_encoder_graph_recorded_under_inference_mode_replays_under_no_grad(gpu, small):
    """``speed="fast"`` replays the plain forward's CUDA graph. ComfyUI runs its nodes under
    ``torch.inference_mode`` and a script under ``no_grad`` (``encode``): a graph recorded under the
    first replays under the second with the plain forward's bits."""
    from klein_core.accel.speed import apply_speed
    from klein_core.accel.text_graph import graphed_forward
    from klein_core.pipeline.tokenizer import tokenize_prompts

    te = small[1]
    ids, mask = tokenize_prompts(["a red fox in the snow"], max_length=512)
    other_ids, other_mask = tokenize_prompts(["an old boat"], max_length=512)
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    try:
        apply_speed(None, None, "fast", te)
        with torch.inference_mode():
            first = te.encode(ids, mask)
        other = te.encode(other_ids, other_mask)
        with torch.inference_mode():
            again = te.encode(ids, mask)
        forward = graphed_forward(te)
        assert forward is not None and (forward.captures, forward.replays) == (1, 3)
    finally:
        apply_speed(None, None, "plain", te)
    assert torch.equal(first, plain) and torch.equal(other, plain_other) and torch.equal(again, plain)


def test_fast_vae_decode(gpu, parity):
    """The compiled VAE (``speed="compile"``; dynamo's eager backend in the CPU mode, which has no
    inductor here) and the eager channels-last decode, each against the plain decode."""
    vae = load_small(gpu)[2]
    lat = torch.randn(1, 128, 12, 16, generator=torch.Generator().manual_seed(0)).to(gpu.device, gpu.dtype)
    backend = "eager" if gpu.cpu else "inductor"
    with torch.no_grad():
        plain = vae.decode(lat)
        try:
            fast.enable_fast_vae(vae, compile_backend=backend)
            assert fast.is_compiled(vae.decoder) and vae.decode_channels_last
            compiled = vae.decode(lat)
            fast.enable_fast_vae(vae, compile=False, channels_last=True)
            nhwc = vae.decode(lat)
        finally:
            fast.disable_fast_vae(vae)
            torch._dynamo.reset()
    assert compiled.dtype == nhwc.dtype == gpu.dtype
    rel = parity(tag(gpu, "compiled VAE decode vs plain, relative L2"), rel_l2(compiled, plain))
    assert rel < (0.05 if gpu.half else 1e-5), rel
    rel = parity(tag(gpu, "channels-last VAE decode vs plain, relative L2"), rel_l2(nhwc, plain))
    assert rel < (0.05 if gpu.half else 1e-5), rel


def test_fused_vae_group_norm(gpu, parity, fused_here):
    """``speed="fast"``'s VAE: comfy-kitchen's GroupNorm + SiLU kernel (half precision; bf16 in the
    CPU mode) against the plain decode and encode. On a GPU its self-check must pass."""
    dtype = gpu.dtype if gpu.half else torch.bfloat16
    vae = load_small(gpu, dtype=dtype)[2]
    lat = torch.randn(1, 128, 12, 16, generator=torch.Generator().manual_seed(0)).to(gpu.device, dtype)
    px = (torch.rand(1, 3, 192, 256, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(gpu.device, dtype)
    with torch.no_grad():
        plain_dec, plain_enc = vae.decode(lat), vae.encode(px)
        try:
            fast.enable_fast_vae(vae, compile=False)
            dec, enc = vae.decode(lat), vae.encode(px)
            resolved = vae.decoder.norm_out.fused.resolved()
        finally:
            fast.disable_fast_vae(vae)
    assert resolved == {f"{gpu.device} {dtype}": True}, resolved
    for name, out, ref in (("decode", dec, plain_dec), ("encode", enc, plain_enc)):
        rel = parity(tag(gpu, f"fused GroupNorm+SiLU VAE {name} vs plain, relative L2"), rel_l2(out, ref))
        assert rel < 0.05, (name, rel)


def test_generate_with_every_fast_path(gpu, parity):
    tr, te, vae = load_small(gpu)
    kw = {"prompt": "a fox", "width": gpu.size, "height": gpu.size, "steps": 4, "seed": 3, "cache": None}
    plain = kc.generate(tr, te, vae, **kw)
    try:
        quick = kc.generate(tr, te, vae, speed="compile" if not gpu.cpu else "fast", **kw)
    finally:
        kc.Engine(tr, vae=vae, speed="plain")
        torch._dynamo.reset()
    rel = parity(tag(gpu, "generate with fast paths vs plain: latents, relative L2"), rel_l2(quick.latents, plain.latents))
    assert rel < (3e-2 if gpu.half else 1e-5), rel
    d = parity(tag(gpu, "generate with fast paths vs plain: pixels max abs"), float((quick.pixels - plain.pixels).abs().max()))
    assert d < (0.15 if gpu.half else 1e-5), d  # CPU: 3.3e-2 in bf16 (the VAE in bf16), 2.9e-6 in fp32


# ---------------------------------------------------------------------------------------------
# Full size


@pytest.mark.full_size(40)
@pytest.mark.parametrize("attention,fused", [("sdpa", False), ("sdpa_cudnn", False), ("auto", True)])
def test_full_4b_fast_forward_matches_plain(gpu, full4b, attention, fused, parity):
    """One full-size 4B forward at 1024x1024 with a 1024x1024 reference and 512 text tokens."""
    tr = full4b[0]
    inputs = transformer_inputs(tr, gpu, 64, 64, txt_len=512, ref=(64, 64))
    plain = forward(tr, inputs)
    try:
        ops = fast.enable_fast_paths(tr, attention=attention, fused_rope=fused, fused_modulation=fused)
        out = forward(tr, inputs)
    finally:
        fast.disable_fast_paths(tr)
    (described,) = ops.resolved().values()
    rel = parity(tag(gpu, f"full 4B {described} vs plain, relative L2"), rel_l2(out, plain))
    assert rel < _tol(gpu), rel


def test_flash_packages_reported():
    """Not a check: records which optional attention packages this machine has (in the skip reason)."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface", "triton",
                                                             "comfy_kitchen")}
    pytest.skip(f"optional packages: {have}")


def test_images_from_device_pixels_match_the_cpu(gpu):
    """``to_pil`` rounds on the device and copies through pinned memory: the same bytes as from the
    CPU, halfway values and clamped ends included."""
    from klein_core.pipeline.images import to_pil

    g = torch.Generator().manual_seed(4)
    px = torch.rand(2, 3, 37, 53, generator=g)
    px[0, 0, 0, :4] = torch.tensor([0.5 / 255, 1.5 / 255, 0.0, 1.0])  # halfway values and both ends
    on_cpu = [np.asarray(im) for im in to_pil(px)]
    on_device = [np.asarray(im) for im in to_pil(px.to(gpu.device))]
    assert all(np.array_equal(a, b) for a, b in zip(on_cpu, on_device, strict=True))
