"""klein_core.fast (the switchboard for optional fast paths) and benchmarks/speed.py, on the CPU.

Without a GPU every fast path must fall back to the plain PyTorch path, say so once, and give
the plain result. The fused kernels (comfy-kitchen) are tested in tests/test_kitchen.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from extras import require
from script_module import load_script

import klein_core
from klein_core import testing as demo
from klein_core.accel import fast
from klein_core.accel.text_encoder import disable_fast_text_encoder, enable_fast_text_encoder
from klein_core.models.block_ops import PLAIN_OPS
from klein_core.models.vae import GroupNormAct
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.pipeline.tokenizer import tokenize_prompts

REPO = Path(__file__).resolve().parent.parent


def _inputs(model, batch: int = 2, seed: int = 0):
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    g = torch.Generator().manual_seed(seed)
    return dict(img=torch.randn(batch, ids.shape[0], 128, generator=g), img_ids=ids,
                txt=torch.randn(batch, 6, model.config.context_dim, generator=g),
                txt_ids=text_position_ids(6), timesteps=torch.linspace(0.9, 0.3, batch))


@pytest.fixture
def model():
    return demo.tiny_transformer()


def _plain_then_fast(model, kw, caplog, level=logging.INFO, calls=1, **settings):
    """The plain output, then enable_fast_paths(model, **settings) and ``calls`` forwards with the
    fast paths' log captured; returns (plain, first fast output, the installed FastOps)."""
    with torch.no_grad():
        ref = model(**kw)
        ops = fast.enable_fast_paths(model, **settings)
        with caplog.at_level(level, logger="klein_core.accel.fast"):
            outs = [model(**kw) for _ in range(calls)]
    return ref, outs[0], ops


@pytest.fixture
def kitchen_on_cpu(monkeypatch):
    """comfy-kitchen's fused steps through the fast paths on the CPU (they use it on CUDA only)."""
    require("comfy_kitchen")
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("attention", fast.ATTENTION_BACKENDS)
def test_fast_paths_match_plain_on_cpu(model, attention):
    kw = _inputs(model)
    with torch.no_grad():
        ref = model(**kw)
        ops = fast.enable_fast_paths(model, attention=attention)
        out = model(**kw)
    assert model.ops is ops
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # On the CPU every choice falls back to the plain path.
    assert ops.resolved() == {
        "cpu torch.float32": ("attention=plain, qk-norm+rope=plain, modulation=plain, elementwise=plain, "
                              "swiglu=plain, compile=False")}


def test_fallback_is_logged_once_and_disable_restores_plain(model, caplog):
    kw = _inputs(model)
    with torch.no_grad():
        ref = model(**kw)
        fast.enable_fast_paths(model, attention="flash3")
        with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
            outs = [model(**kw) for _ in range(3)]
        fast.disable_fast_paths(model)
        again = model(**kw)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flash3" in warnings[0].getMessage() and "CUDA" in warnings[0].getMessage()
    assert sum("klein fast paths on cpu" in r.getMessage() for r in caplog.records) == 1
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert model.ops is PLAIN_OPS
    assert torch.equal(again, ref)


def _fake_flash(q, k, v):
    """A flash-attn stand-in: [B, L, H, D] in and out, returning (out, lse) like some FA3 releases."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2), None


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_attention_backend_wrappers(model, monkeypatch, backend):
    """The SDPA and flash-attn wrappers (layouts, priorities, tuple outputs) on CPU stand-ins."""
    fn = fast._make_sdpa(["MATH"]) if backend == "sdpa" else fast._make_flash(_fake_flash)
    monkeypatch.setattr(fast, "_resolve_attention", lambda *a: (fn, backend))
    kw = _inputs(model)
    with torch.no_grad():
        ref = model(**kw)
        ops = fast.enable_fast_paths(model)
        out = model(**kw)
    assert f"attention={backend}," in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_backend_failing_its_self_check_falls_back(model, monkeypatch, caplog):
    def broken(q, k, v):
        raise RuntimeError("No available kernel for this layout")

    monkeypatch.setattr(fast, "_resolve_attention", lambda *a: (broken, "flash3"))
    ref, out, ops = _plain_then_fast(model, _inputs(model), caplog, logging.WARNING)
    assert "attention=flash3 on cpu: its self-check raised RuntimeError: No available kernel" in caplog.text
    assert "attention=plain," in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_through_comfy_kitchen_match_plain(kitchen_on_cpu, model, dtype, caplog, parity):
    model = model.to(dtype)
    ref, out, ops = _plain_then_fast(model, _inputs(model), caplog)
    fast.disable_fast_paths(model)
    assert "qk-norm+rope=comfy-kitchen, modulation=comfy-kitchen" in ops.resolved()[f"cpu {dtype}"]
    assert "unavailable" not in caplog.text
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    parity(f"tiny transformer {str(dtype).removeprefix('torch.')}: fast paths (comfy-kitchen) vs plain, "
           "relative L2", rel)
    assert rel < (1e-7 if dtype == torch.float32 else 2.5e-3), rel  # measured 4.2e-8 / 1.1e-3


def test_fused_step_failing_its_self_check_is_switched_off(kitchen_on_cpu, model, monkeypatch, caplog):
    """A kernel that computes wrong on this device is caught at first use, not trusted."""
    import comfy_kitchen

    monkeypatch.setattr(comfy_kitchen, "adaln", lambda x, scale, shift, eps=1e-6: torch.zeros_like(x))
    ref, out, ops = _plain_then_fast(model, _inputs(model, batch=1), caplog)
    assert "fused modulation unavailable on cpu (its self-check is off by" in caplog.text
    assert "qk-norm+rope=comfy-kitchen, modulation=plain" in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_missing_comfy_kitchen_falls_back_naming_the_install(kitchen_on_cpu, model, monkeypatch, caplog):
    monkeypatch.setattr(fast, "kitchen_available", lambda: False)
    ref, out, ops = _plain_then_fast(model, _inputs(model, batch=1), caplog, calls=2, attention="plain")
    msgs = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    # one line each for the two steps, on the first call only
    assert len(msgs) == 2 and all("comfy-kitchen is not installed; pip install" in m for m in msgs), msgs
    assert ops.resolved()["cpu torch.float32"].startswith("attention=plain, qk-norm+rope=plain, modulation=plain")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


calls: list[bool] = []  # per call of _reference_swiglu: True when it made a new tensor (out=None)


def _reference_swiglu(x, out):
    """The one-pass SwiGLU's contract in PyTorch (x [..., 2F] -> out [..., F], out may be a slice)."""
    calls.append(out is None)
    y = PLAIN_OPS.swiglu(x)
    return y if out is None else out.copy_(y)


def test_fused_elementwise_steps_match_plain(model, monkeypatch, caplog):
    """fused_elementwise: gated residuals as addcmul, SwiGLU through the one-pass kernel's seam (the
    single blocks writing into their concatenation buffer, the double blocks' MLPs into a new
    tensor), against the plain path; off with fused_elementwise=False and under compile."""
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fast, "_resolve_swiglu", lambda device, dtype: _reference_swiglu)
    calls.clear()
    kw = _inputs(model)
    ref, out, ops = _plain_then_fast(model, kw, caplog, fused_rope=False, fused_modulation=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert "elementwise=fused, swiglu=triton" in ops.resolved()["cpu torch.float32"]
    n_double, n_single = len(model.double_blocks), len(model.single_blocks)
    assert calls.count(True) == 2 * n_double and calls.count(False) == n_single  # img + txt MLPs; singles in place
    bound = ops.bind(torch.device("cpu"), torch.float32)
    x, y, gate = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 1, 8)
    torch.testing.assert_close(bound.gated_residual(x, gate, y), x + gate * y)
    attn, mlp = torch.randn(2, 5, 8), torch.randn(2, 5, 12)[..., 2:]  # a strided slice, as in a block
    torch.testing.assert_close(bound.attention_and_mlp(attn, mlp), PLAIN_OPS.attention_and_mlp(attn, mlp))

    fast.disable_fast_paths(model)
    calls.clear()
    ref2, out2, ops2 = _plain_then_fast(model, _inputs(model, seed=3), caplog, fused_rope=False,
                                        fused_modulation=False, fused_elementwise=False)
    assert torch.equal(out2, ref2) and not calls
    assert "elementwise=plain, swiglu=plain" in ops2.resolved()["cpu torch.float32"]


def test_fused_elementwise_steps_keep_gradients(model, monkeypatch):
    """With autograd recording (training a LoRA on the fast path), the steps that have no backward
    (the kernel, ``out=``) give way to the plain ops, so gradients match the plain path's."""
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fast, "_resolve_swiglu", lambda device, dtype: _reference_swiglu)
    kw = _inputs(model, seed=7)
    weight = model.double_blocks[0].img_attn.qkv.weight  # every MLP after it records gradients
    grads = []
    for fast_on in (False, True):
        if fast_on:
            fast.enable_fast_paths(model, fused_rope=False, fused_modulation=False)
        weight.requires_grad_(True)
        calls.clear()
        model(**kw).square().mean().backward()
        grads.append(weight.grad.clone())
        weight.grad = None
        weight.requires_grad_(False)
    assert not calls  # the kernel never ran under autograd
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_fused_elementwise_without_the_kernel(model, monkeypatch, caplog):
    """Without the one-pass SwiGLU (CPU, no Triton, a failed self-check) the in-place concatenation
    and addcmul still run, with silu then multiply; a kernel that is off is caught by its check."""
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    with caplog.at_level(logging.DEBUG, logger="klein_core.accel.fast"):
        assert fast._resolve_swiglu(torch.device("cpu"), torch.float32) is None
    assert "one-pass SwiGLU unavailable on cpu" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no news off CUDA
    kw = _inputs(model, seed=5)
    ref, out, ops = _plain_then_fast(model, kw, caplog, fused_rope=False, fused_modulation=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert "elementwise=fused, swiglu=plain" in ops.resolved()["cpu torch.float32"]

    monkeypatch.setattr(fast, "triton_swiglu", lambda x, out: _reference_swiglu(x * 1.1, out))
    assert "off by" in fast._swiglu_self_check(torch.device("cpu"), torch.bfloat16)

    def spills(x, out):  # right values, but also writes before its output slice
        y = PLAIN_OPS.swiglu(x)
        if out is None:
            return y
        out.copy_(y)
        out.as_strided((1,), (1,), out.storage_offset() - 1).fill_(1)
        return out

    monkeypatch.setattr(fast, "triton_swiglu", spills)
    assert "outside its output" in fast._swiglu_self_check(torch.device("cpu"), torch.float32)


def test_bf16_and_dtype_specific_binding(model):
    kw = _inputs(model)
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        ref = m16(**kw)
        ops = fast.enable_fast_paths(m16)
        out = m16(**kw)
    assert list(ops.resolved()) == ["cpu torch.bfloat16"]
    assert torch.equal(out, ref)


def test_bad_arguments():
    with pytest.raises(ValueError, match="attention must be one of"):
        fast.enable_fast_paths(demo.tiny_transformer(), attention="flash4")
    with pytest.raises(TypeError, match="Flux2Transformer"):
        fast.enable_fast_paths(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Flux2VAE"):
        fast.enable_fast_vae(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_compile_wiring_logs_first_call_time(model, caplog):
    """torch.compile of the blocks (eager backend: traced by dynamo, no code generation, so fast)."""
    kw = _inputs(model, batch=1)
    with torch.no_grad():
        ref = model(**kw)
        with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
            ops = fast.enable_fast_paths(model, compile=True, compile_backend="eager")
            out = model(**kw)
            model(**kw)
        blocks = [*model.double_blocks, *model.single_blocks]
        assert all(fast.is_compiled(b) for b in blocks)  # compiled bound forward
        fast.disable_fast_paths(model)
        assert not any("forward" in b.__dict__ for b in blocks)
        assert not model._forward_hooks and not model._forward_pre_hooks
    timed = [r.getMessage() for r in caplog.records if "first forward" in r.getMessage()]
    assert len(timed) == 1 and " s (compilation included" in timed[0]
    assert "qk-norm+rope=inductor" in next(iter(ops.resolved().values()))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fast_vae_decode_and_restore():
    vae = demo.tiny_vae()
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0))
    ref = vae.decode(lat)
    fast.enable_fast_vae(vae, compile=False, channels_last=True)  # the eager NHWC decode, for measuring
    assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(vae.decode(lat), ref, rtol=1e-4, atol=1e-4)
    fast.disable_fast_vae(vae)
    assert not vae.decode_channels_last and vae.decoder.conv_in.weight.is_contiguous()
    assert torch.equal(vae.decode(lat), ref)
    fast.enable_fast_vae(vae, compile=False, dtype=torch.bfloat16)  # encoder and BatchNorm untouched
    out = vae.decode(lat)
    assert out.dtype == torch.bfloat16 and vae.dtype == torch.float32
    assert vae.bn.running_mean.dtype == torch.float32
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-2  # bf16 through a random net
    fast.disable_fast_vae(vae)  # back to fp32 (the bf16-rounded weights stay rounded)
    assert vae.decoder_dtype == torch.float32 and vae.decode(lat).dtype == torch.float32


def test_compiled_vae_decoder_and_eager_fused_encoder(monkeypatch) -> None:
    """enable_fast_vae() compiles the decoder (eager backend here: dynamo traces, nothing generated),
    channels-last. The encoder stays eager with the fused norms where comfy-kitchen's kernel can serve
    it (bf16/fp16 with comfy-kitchen; measured faster on an H200: 43.6 ms against 55.8 compiled for two
    1024² references), and is compiled otherwise (an fp32 VAE, no comfy-kitchen) or when
    ``compile_encoder=True``. Results equal the plain ones; disable restores eager NCHW, plain norms."""
    require("comfy_kitchen")

    def fused(part: torch.nn.Module) -> set:
        return {type(m.fused) for m in part.modules() if isinstance(m, GroupNormAct)}

    vae = demo.tiny_vae().to(torch.bfloat16)
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    px = (torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(torch.bfloat16)
    ref_dec, ref_enc = vae.decode(lat), vae.encode(px)
    fast.enable_fast_vae(vae, compile_backend="eager")
    assert fast.is_compiled(vae.decoder) and not fast.is_compiled(vae.encoder) and vae.decode_channels_last
    assert fused(vae.encoder) == {fast.FastVAENorm} and fused(vae.decoder) == {type(None)}  # Inductor's
    for got, want in ((vae.decode(lat), ref_dec), (vae.encode(px), ref_enc)):  # bf16, another layout
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 5e-2
    fast.enable_fast_vae(vae, compile_backend="eager", compile_encoder=True)
    assert fast.is_compiled(vae.decoder) and fast.is_compiled(vae.encoder)
    assert fused(vae) == {type(None)}
    fast.disable_fast_vae(vae)
    assert not fast.is_compiled(vae.decoder) and not fast.is_compiled(vae.encoder)
    assert fused(vae) == {type(None)} and not vae.decode_channels_last and torch.equal(vae.decode(lat), ref_dec)

    vae32 = demo.tiny_vae()  # fp32: the kernel takes bf16/fp16 only, so the encoder is compiled
    px32 = px.float()
    ref_enc32 = vae32.encode(px32)
    fast.enable_fast_vae(vae32, compile_backend="eager")
    assert fast.is_compiled(vae32.decoder) and fast.is_compiled(vae32.encoder) and fused(vae32) == {type(None)}
    torch.testing.assert_close(vae32.encode(px32), ref_enc32, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(fast, "kitchen_available", lambda: False)  # bf16 without comfy-kitchen: compiled too
    fast.enable_fast_vae(vae, compile_backend="eager")
    assert fast.is_compiled(vae.encoder)
    fast.enable_fast_vae(vae32, compile_backend="eager", compile_encoder=False)
    assert not fast.is_compiled(vae32.encoder) and fused(vae32.encoder) == {fast.FastVAENorm}
    monkeypatch.setattr(fast, "kitchen_available", lambda: True)
    fast.enable_fast_vae(vae, compile_backend="eager", fused_norm=False)  # no fused norms: compiled
    assert fast.is_compiled(vae.encoder) and fused(vae) == {type(None)}


def test_fused_norms_store_only_their_own_part_channels_last(kitchen_on_cpu) -> None:
    """Review: when the fused kernel is chosen it stores the convolution weights of the parts it serves
    channels-last. It converted the whole VAE, so under ``compile`` with ``channels_last=False`` the
    compiled NCHW decoder turned channels-last at the first reference encode (a layout its graph was
    not traced for). Only the encoder, which the kernel serves, is converted now."""
    vae = demo.tiny_vae().to(torch.bfloat16)
    px = (torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(torch.bfloat16)
    fast.enable_fast_vae(vae, compile_backend="eager", channels_last=False)
    vae.encode(px)  # the kernel is chosen at the encoder's first pass
    convs = {name: [m.weight for m in getattr(vae, name).modules() if isinstance(m, torch.nn.Conv2d)]
             for name in ("encoder", "decoder")}
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs["encoder"] if w.shape[-1] > 1)
    assert all(w.is_contiguous() for w in convs["decoder"])
    assert not vae.decode_channels_last


def test_generate_with_fast_paths_matches_plain(kitchen_on_cpu):
    tr, te, vae = demo.build_tiny_components()
    kw = dict(prompt="a fox", width=64, height=80, seed=3, cache=None)
    plain = klein_core.generate(tr, te, vae, **kw)
    ops = fast.enable_fast_paths(tr)
    fast.enable_fast_vae(vae, dtype=None)
    quick = klein_core.generate(tr, te, vae, **kw)
    assert "qk-norm+rope=comfy-kitchen, modulation=comfy-kitchen" in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(quick.latents, plain.latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quick.pixels, plain.pixels, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ref_mode", ["joint", "timestep_zero", "kv"])
def test_edit_through_comfy_kitchen_matches_plain(kitchen_on_cpu, ref_mode):
    """Every reference mode (joint tokens, timestep-zero modulation, the KV reference pass) with
    comfy-kitchen's fused steps, fp32: the same latents as the plain path."""
    import numpy as np
    from PIL import Image

    tr, te, vae = demo.build_tiny_components()
    pixels = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    kw = {"prompt": "a fox", "references": [Image.fromarray(pixels)], "width": 64, "height": 80, "seed": 3,
          "cache": None, "ref_mode": ref_mode, "kv_cache": None, "output": "latent"}
    plain = klein_core.generate(tr, te, vae, **kw)
    ops = fast.enable_fast_paths(tr)
    quick = klein_core.generate(tr, te, vae, **kw)
    assert "qk-norm+rope=comfy-kitchen, modulation=comfy-kitchen" in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(quick.latents, plain.latents, rtol=0, atol=1e-6)  # measured 4.8e-7


# ---------------------------------------------------------------------------------------------
# benchmarks/speed.py


def _speed_module():
    return load_script("klein_speed_benchmark", REPO / "benchmarks" / "speed.py")


def test_weight_conversion_round_trips_through_the_loader():
    """BFL -> diffusers names in the benchmark is the inverse of klein_core's diffusers loader."""
    speed = _speed_module()
    tr, _, vae = demo.build_tiny_components()
    d_tr = speed.bfl_to_diffusers_transformer(tr.state_dict(), tr.config)
    back = klein_core.load_transformer(d_tr)
    for k, v in tr.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    d_vae = speed.bfl_to_diffusers_vae(vae.state_dict(), vae.config)
    back_vae = klein_core.load_vae(d_vae)
    for k, v in vae.state_dict().items():
        assert torch.equal(back_vae.state_dict()[k], v), k


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers is not installed")
def test_speed_benchmark_tiny_cpu(tmp_path, capsys):
    speed = _speed_module()
    out = tmp_path / "speed.json"
    report = speed.main(["--tiny", "--runs", "1", "--warmup", "0", "--cases", "a,b,c", "--out", str(out)])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["results"][0]["model"] == "tiny" and saved["env"]["device"] == "cpu"
    cases = report["results"][0]["cases"]
    assert set(cases) == {"a", "b", "c"}
    for key, case in cases.items():
        variants = case["variants"]
        assert list(variants) == ["diffusers", "plain", "default"]
        for name, v in variants.items():
            assert v["finite"], (key, name)
            assert v["e2e_ms"] > 0 and v["stages_ms"]["text"] > 0 and v["stages_ms"]["decode"] > 0
            assert len(v["stages_ms"]["steps"]) == 4, (key, name)  # --tiny runs every case in 4 steps
            wall = v["engine_wall_ms"]  # klein_core's own stage clocks beside the spans; none for diffusers
            assert (wall is None) == (name == "diffusers") and (wall is None or wall["denoise"] > 0), (key, name)
            # same weights, fp32: klein_core agrees with diffusers (batched CFG included)
            assert v["diff_vs_diffusers"]["latents_max_abs"] < 1e-4, (key, name)
            assert v["diff_vs_diffusers"]["image_max_abs_255"] <= 2, (key, name)
        assert variants["diffusers"]["stages_ms"].get("references", 0) > 0 if key == "b" else True
    assert "vs diffusers" in printed and "latents max|d|" in printed and "step TFLOP/s" in printed
    assert cases["a"]["step_gflop"] > 0 and cases["a"]["variants"]["default"]["step_tflops"] > 0
    assert "outside the stages" in printed and "garbage collections gen0/1/2" in printed
    for case in cases.values():  # every variant's timed runs audited; eager runs compile nothing
        assert set(case["host_audit"]) == {"diffusers", "plain", "default"}
        assert all(a["compiles"].get("frames", 0) == 0 for a in case["host_audit"].values())


def test_speed_benchmark_times_the_text_encoder_without_module_hooks():
    """A hook on the text encoder's modules turns its CUDA graph replay off (compile speed), so the
    benchmark times ``encode`` from outside: the span is recorded and the modules stay hook-free."""
    speed = _speed_module()
    te = demo.tiny_text_encoder()
    probe = speed.Probe(speed.Clock(torch.device("cpu")))
    probe.around("text", te, "encode")
    ids, mask = tokenize_prompts(["a fox"], max_length=16)
    plain = type(te).encode(te, ids, mask)
    out = te.encode(ids, mask)  # inactive: not timed
    probe.active = True
    assert torch.equal(te.encode(ids, mask), plain) and torch.equal(out, plain)
    assert len(probe.spans["text"]) == 1 and probe.result()["text"] > 0
    assert not any(getattr(m, d) for m in te.modules()
                   for d in ("_forward_hooks", "_forward_pre_hooks"))
    probe.remove()
    assert "encode" not in te.__dict__
    # an instance attribute it wrapped (the graph replay's forward) is put back, not dropped
    enable_fast_text_encoder(te, compile=False, graphs=True)
    replaying = te.__dict__["forward"]
    probe.around("text", te, "forward")
    assert te.__dict__["forward"] is not replaying
    probe.remove()
    assert te.__dict__["forward"] is replaying
    disable_fast_text_encoder(te)


def test_step_flops_counts_every_matmul():
    """Against an independent count: one forward's Linear FLOPs from the layers' own shapes (forward
    hooks on every nn.Linear) plus 4 * L^2 * hidden per block for the attention products."""
    speed = _speed_module()
    model = demo.tiny_transformer()
    counted = []

    def hook(mod, args, out):
        counted.append(2 * args[0].shape[:-1].numel() * mod.in_features * mod.out_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    kw = _inputs(model, batch=2)
    with torch.no_grad():
        model(**kw)
    for h in handles:
        h.remove()
    n, t, cfg = kw["img"].shape[1], kw["txt"].shape[1], model.config
    # modulation and time embedding Linears run on [B, D] vectors: left out of step_flops as negligible
    per_vector = sum(2 * 2 * m.in_features * m.out_features for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and ("modulation" in name or "time_in" in name))
    attention = 2 * 4 * (n + t) ** 2 * cfg.hidden_size * (cfg.depth + cfg.depth_single)
    assert speed.step_flops(cfg, n, t, batch=2) == sum(counted) - per_vector + attention


def test_speed_benchmark_variant_selection(tmp_path):
    speed = _speed_module()
    report = speed.main(["--tiny", "--runs", "1", "--warmup", "0", "--cases", "c", "--no-diffusers",
                         "--variants", "default+step_cache,plain,default", "--cache-threshold",
                         "0.5", "--out", str(tmp_path / "s.json")])
    case = report["results"][0]["cases"]["c"]
    # the documented order
    assert list(case["variants"]) == ["plain", "default", "default+step_cache"]
    # on the CPU the default speed is exactly the plain path (its text encoder's graph is never recorded)
    assert case["variants"]["default"]["diff_vs_plain"]["latents_max_abs"] == 0
    cached = case["variants"]["default+step_cache"]
    assert "diff_vs_default" in cached and cached["finite"]
    assert case["step_cache"]["default+step_cache"]["skipped"] >= 0
    with pytest.raises(SystemExit):
        speed.main(["--tiny", "--variants", "turbo", "--out", "/dev/null"])


def test_speed_benchmark_trim_variants_count_the_tokens_they_ran(tmp_path):
    """default+trim runs the prompt padded to 64 tokens: its difference against default is
    reported, and its TFLOP/s come from the FLOPs of 64 text tokens, not 512."""
    speed = _speed_module()
    report = speed.main(["--tiny", "--runs", "1", "--warmup", "0", "--cases", "a", "--no-diffusers",
                         "--variants", "default,default+trim", "--out", str(tmp_path / "s.json")])
    case = report["results"][0]["cases"]["a"]
    trim = case["variants"]["default+trim"]
    assert trim["text_tokens"] == 64 and "text_tokens" not in case["variants"]["default"]
    assert trim["diff_vs_default"]["latents_rel_l2"] > 0 and trim["finite"]
    n_img = (speed._cases(True)["a"].size // 16) ** 2
    flops = {t: speed.step_flops(speed._spec("tiny").transformer, n_img, t, 1) for t in (64, 512)}
    assert flops[64] < flops[512]
    for name, tokens in (("default+trim", 64), ("default", 512)):
        v = case["variants"][name]
        assert v["step_tflops"] == pytest.approx(flops[tokens] / (v["stages_ms"]["step_median"] * 1e-3) / 1e12)


def test_speed_benchmark_says_clearly_when_diffusers_is_missing(monkeypatch):
    speed = _speed_module()
    monkeypatch.setitem(sys.modules, "diffusers", None)  # makes `import diffusers` fail
    with pytest.raises(SystemExit, match="diffusers is not installed.*--no-diffusers"):
        speed.main(["--tiny", "--runs", "1", "--out", "/dev/null"])


def test_kitchen_group_norm_widths():
    """comfy-kitchen 0.2.36's CUDA GroupNorm takes C % 8 == 0 with C / 8 dividing 256 (its source):
    the FLUX.2 VAE's 128/256/512 qualify, the small decoder's 96 and oversized batches do not."""
    from klein_core.accel.comfy_kitchen import kitchen_serves_group_norm

    assert all(kitchen_serves_group_norm(c, 32, 1) for c in (32, 128, 256, 512))
    assert not kitchen_serves_group_norm(96, 32, 1)
    assert not kitchen_serves_group_norm(128, 32, 70_000)
    assert not kitchen_serves_group_norm(128, 3, 1)  # groups must divide the channels


def _vae_io(dtype):
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    px = (torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(dtype)
    return lat, px


def test_fast_vae_fuses_group_norm_and_silu(kitchen_on_cpu, monkeypatch, caplog, parity):
    """speed='fast' on the VAE: every GroupNorm (+ its SiLU) goes through comfy-kitchen's kernel, the
    attention blocks' norms without SiLU; decode and encode match the plain path; 'plain' restores it."""
    from klein_core.accel.speed import apply_speed
    from klein_core.models.vae import GroupNormAct

    vae = demo.tiny_vae().to(torch.bfloat16)
    lat, px = _vae_io(torch.bfloat16)
    ref_dec, ref_enc = vae.decode(lat), vae.encode(px)
    calls: list[tuple[int, bool]] = []
    real = fast.group_norm_silu

    def spy(x, weight, bias, groups, eps, silu):
        calls.append((x.shape[-1], silu))
        out = real(x, weight, bias, groups, eps, silu)
        assert out.is_contiguous(memory_format=torch.channels_last)
        y = torch.nn.functional.group_norm(x, groups, weight, bias, eps)  # each call against torch's own
        torch.testing.assert_close(out, torch.nn.functional.silu(y) if silu else y, rtol=1.6e-2, atol=1.6e-2)
        return out

    monkeypatch.setattr(fast, "group_norm_silu", spy)
    first_conv_layout: list[bool] = []
    for conv in (vae.decoder.conv_in, vae.encoder.conv_in):
        conv.register_forward_pre_hook(
            lambda m, a: first_conv_layout.append(m.weight.is_contiguous(memory_format=torch.channels_last)))
    with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
        apply_speed(vae=vae, speed="fast")
        dec, enc = vae.decode(lat), vae.encode(px)
    assert "GroupNorm+SiLU=comfy-kitchen" in caplog.text and "unavailable" not in caplog.text
    assert first_conv_layout == [True, True]  # chosen before each pass's first convolution, not mid-pass
    convs = [m.weight for m in vae.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)  # stored NHWC once chosen
    norms = [m for m in vae.modules() if isinstance(m, GroupNormAct)]
    used = [c for c in calls if c[0] != 13]  # 13: the self-check's width
    assert len(used) == len(norms)  # each norm ran once, fused
    assert sum(not silu for _, silu in used) == sum(not m.silu for m in norms) == 2  # the attention norms
    for name, out, ref in (("decode", dec, ref_dec), ("encode", enc, ref_enc)):
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        parity(f"tiny VAE bf16 {name}: fused GroupNorm+SiLU (comfy-kitchen, CPU) vs plain, relative L2", rel)
        assert rel < 5e-2, (name, rel)  # bf16 through a random net, as for the bf16 decoder (measured 2.3e-2)
    apply_speed(vae=vae, speed="plain")
    assert all(m.fused is None for m in norms) and all(w.is_contiguous() for w in convs)
    assert not vae.decoder._forward_pre_hooks and not vae.encoder._forward_pre_hooks
    assert torch.equal(vae.decode(lat), ref_dec) and torch.equal(vae.encode(px), ref_enc)


def test_fast_vae_norm_falls_back_to_plain(kitchen_on_cpu, monkeypatch, caplog):
    """A kernel that fails its self-check, and a float32 VAE, run the plain GroupNorm (bit-exact),
    each with one line naming why; the check runs once per device and dtype."""
    lat, _ = _vae_io(torch.bfloat16)
    vae = demo.tiny_vae().to(torch.bfloat16)
    ref = vae.decode(lat)
    checks = []

    def broken(x, weight, bias, groups, eps, silu):
        checks.append(1)
        return torch.zeros_like(x)

    monkeypatch.setattr(fast, "group_norm_silu", broken)
    fast.enable_fast_vae(vae, compile=False)
    with caplog.at_level(logging.WARNING, logger="klein_core.accel.fast"):
        assert torch.equal(vae.decode(lat), ref) and torch.equal(vae.decode(lat), ref)
    assert len(checks) == 2  # the self-check (with and without SiLU), once
    assert caplog.text.count("fused VAE GroupNorm unavailable on cpu (its self-check is off") == 1
    norm = vae.decoder.norm_out.fused
    assert norm.resolved() == {"cpu torch.bfloat16": False}

    caplog.clear()
    vae32 = demo.tiny_vae()
    ref32 = vae32.decode(lat.float())
    fast.enable_fast_vae(vae32, compile=False)
    with caplog.at_level(logging.WARNING, logger="klein_core.accel.fast"):
        assert torch.equal(vae32.decode(lat.float()), ref32)
    assert "its kernel takes bf16/fp16, the VAE runs in torch.float32" in caplog.text


def test_fast_vae_on_cpu_is_plain(caplog):
    """Without the test switch the fused kernel is for CUDA: on the CPU speed='fast' decodes exactly
    like plain, with no warning."""
    from klein_core.accel.speed import apply_speed

    vae = demo.tiny_vae().to(torch.bfloat16)
    lat, px = _vae_io(torch.bfloat16)
    ref_dec, ref_enc = vae.decode(lat), vae.encode(px)
    with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
        apply_speed(vae=vae, speed="fast")
        assert torch.equal(vae.decode(lat), ref_dec) and torch.equal(vae.encode(px), ref_enc)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert vae.decoder.norm_out.fused.resolved() == {"cpu torch.bfloat16": False}
    assert all(p.is_contiguous() for p in vae.parameters())  # NCHW where the kernel did not run
