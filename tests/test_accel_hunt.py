"""Hunt in klein_core.accel (speed switches, compile wrappers, step cache, text-encoder replay), on the CPU.

Every test here either shows a bug (fixed with it) named in its docstring, or covers an edge case the
other accel tests (test_fast, test_speed, test_step_cache, test_text_graph, ...) do not. CUDA facts
are played by the stand-ins those tests use (a recorder for the CUDA graph, comfy-kitchen's eager
backend on the CPU, a compiler that fails).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from extras import require
from test_step_cache import _smooth_in_time  # the step cache skips on it (trained-like timesteps)
from text_encoder_files import fresh_dynamo, tokens  # noqa: F401 - fresh_dynamo is autouse

import klein_core as kc
from klein_core import testing as demo
from klein_core.accel import fast, speed
from klein_core.accel.text_encoder import enable_fast_text_encoder
from klein_core.accel.text_graph import GraphedTextForward, graphed_forward
from klein_core.models.block_ops import PLAIN_OPS
from klein_core.pipeline.sampling import position_ids, text_position_ids


def _inputs(model, batch: int = 1, seed: int = 0, length: int = 5):
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(batch, 12, 128, generator=g), "img_ids": position_ids(3, 4),
            "txt": torch.randn(batch, length, model.config.context_dim, generator=g),
            "txt_ids": text_position_ids(length), "timesteps": torch.full((batch,), 0.7)}


def _compile_that_fails(*args, **kwargs):
    def compiled(*a, **k):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error (stand-in)")
    return compiled


def _lora_for(model):
    """A LoRA on one Linear of the first double block (its copy then has every block copied)."""
    w = model.double_blocks[0].img_attn.qkv.weight
    g = torch.Generator().manual_seed(2)
    key = "diffusion_model.double_blocks.0.img_attn.qkv"
    return kc.load_lora({f"{key}.lora_down.weight": torch.randn(2, w.shape[1], generator=g),
                         f"{key}.lora_up.weight": torch.randn(w.shape[0], 2, generator=g)})


def _kitchen_rope_calls(monkeypatch) -> list[int]:
    """comfy-kitchen's fused steps used on the CPU (as on CUDA), each rms_rope call counted."""
    require("comfy_kitchen")
    import comfy_kitchen

    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    calls: list[int] = []
    real = comfy_kitchen.rms_rope

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(comfy_kitchen, "rms_rope", counted)
    return calls


# --- speed switches ----------------------------------------------------------------------------------

def test_plain_speed_after_fast_paths_enabled_by_hand_restores_the_plain_transformer():
    """Was a bug (speed.apply_speed / speed_of): ``enable_fast_paths`` by hand clears the speed mark, so
    ``speed_of`` says "plain" and ``apply_speed(..., "plain")`` (also ``Engine(speed="plain")``,
    ``generate(speed="plain")``) does nothing: the blocks stay compiled with the fast ops. The
    module doc promises that switching by hand makes the next ``apply_speed`` act."""
    model = demo.tiny_transformer()
    fast.enable_fast_paths(model, compile=True, compile_backend="eager")
    speed.apply_speed(model, None, "plain")
    assert model.ops is PLAIN_OPS
    assert not any(fast.is_compiled(b) for b in [*model.double_blocks, *model.single_blocks])


def test_plain_speed_after_fast_vae_enabled_by_hand_restores_the_plain_decode():
    """Was a bug (speed.apply_speed): the VAE as the transformer above. ``enable_fast_vae(vae,
    dtype=torch.bfloat16)`` by hand, then ``apply_speed(vae=vae, speed="plain")``: the decoder
    stays bf16, compiled and channels-last, so the decode is not the plain path's."""
    vae = demo.tiny_vae()
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0))
    fast.enable_fast_vae(vae, compile_backend="eager", dtype=torch.bfloat16)
    speed.apply_speed(vae=vae, speed="plain")
    assert not fast.is_compiled(vae.decoder) and not vae.decode_channels_last
    assert vae.decoder_dtype == torch.float32 and vae.decode(lat).dtype == torch.float32


def test_plain_speed_after_the_text_encoder_was_compiled_by_hand_restores_it():
    """Was a bug (speed.apply_speed): the text encoder as the transformer above: compiled layers and the
    CUDA-graph forward set by ``enable_fast_text_encoder`` survive ``apply_speed(..., "plain")``."""
    te = demo.tiny_text_encoder()
    enable_fast_text_encoder(te, compile_backend="eager")
    speed.apply_speed(None, None, "plain", te)
    assert graphed_forward(te) is None and not any(fast.is_compiled(layer) for layer in te.layers)


def test_describe_speed_does_not_call_hand_enabled_fast_paths_plain():
    """Was a bug (speed.describe_speed / speed_of): after ``enable_fast_paths(model, compile=True)`` by
    hand and a forward, ``describe_speed`` (what the CLI prints and provenance records as
    "fast_paths") starts with "plain", the name of the reference path, while its own details say
    compile=True and the blocks ran compiled."""
    model = demo.tiny_transformer()
    fast.enable_fast_paths(model, compile=True, compile_backend="eager")
    with torch.no_grad():
        model(**_inputs(model))
    text = speed.describe_speed(model)
    assert "compile=True" in text
    assert not text.startswith("plain"), text


def test_plain_after_compile_after_fast_gives_the_plain_bits_for_all_three_models(monkeypatch):
    """Edge case: fast -> compile -> plain through ``apply_speed`` on the transformer, the
    VAE and the text encoder together, each run once at every speed: the plain run afterwards gives
    the bits of the untouched models (test_speed switches without running the compiled models).
    Dynamo's eager backend (traced, nothing generated), as test_native_model does."""
    monkeypatch.setattr(speed, "enable_fast_paths", lambda m, compile=False: fast.enable_fast_paths(
        m, compile=compile, compile_backend="eager"))
    monkeypatch.setattr(speed, "enable_fast_vae", lambda v, compile=False: fast.enable_fast_vae(
        v, compile=compile, compile_backend="eager"))
    monkeypatch.setattr(speed, "enable_fast_text_encoder", lambda t, **kw: enable_fast_text_encoder(
        t, **kw, compile_backend="eager") if kw.get("compile", True) else enable_fast_text_encoder(t, **kw))
    tr, te, vae = demo.build_tiny_components()
    kw = _inputs(tr)
    ids, mask = tokens()
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = (tr(**kw), te.encode(ids, mask), vae.decode(lat))
        for s in ("fast", "compile"):
            speed.apply_speed(tr, vae, s, te)
            tr(**kw), te.encode(ids, mask), vae.decode(lat)
        assert fast.is_compiled(tr.double_blocks[0]) and fast.is_compiled(te.layers[0])
        speed.apply_speed(tr, vae, "plain", te)
        out = (tr(**kw), te.encode(ids, mask), vae.decode(lat))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert speed.describe_speed(tr) == "plain"


# --- compile wrappers --------------------------------------------------------------------------------

def test_a_compiler_failure_in_a_lora_copy_is_said_once_per_copy(monkeypatch, caplog):
    """Was a bug (fast._compiled_forward, ``rebind``'s ``copy_failed``): when compilation fails for a
    ``with_loras`` copy of a compiled transformer (a ComfyUI session whose LoRA copy is the model
    that runs), each copied block falls back on its own: one warning and one failed compile attempt
    per block (25 for Klein 4B, 32 for 9B), and again for every new copy (another strength). The
    original's group falls back as one, with one warning; a copy should too."""
    model = demo.tiny_transformer()
    kw = _inputs(model)
    attempts = []

    def compile_that_fails(*args, **kwargs):
        def compiled(*a, **k):
            attempts.append(1)
            raise RuntimeError("InductorError: CppCompileError: C++ compile error (stand-in)")
        return compiled

    monkeypatch.setattr(fast.torch, "compile", compile_that_fails)
    fast.enable_fast_paths(model, compile=True)
    patched = kc.with_loras(model, [(_lora_for(model), 1.0)])
    again = kc.with_loras(model, [(_lora_for(model), 0.5)])  # another strength: another copy
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=fast.__name__):
        patched(**kw)
        patched(**kw)
        again(**kw)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len([*patched.double_blocks, *patched.single_blocks]) > 1
    assert len(warnings) == 1, warnings
    assert len(attempts) == 1, f"{len(attempts)} compile attempts after the first failure said it all"
    assert all(fast.is_compiled(b) for b in model.double_blocks)  # the original's blocks are its own


def test_after_a_compiler_failure_lora_copies_no_longer_time_compilations(monkeypatch, caplog):
    """The compile timer's hooks (a log line and a device wait at each new shape) are dropped with
    compilation: from the model, and in its LoRA copies, which carry copies of its hook dicts."""
    model = demo.tiny_transformer()
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    fast.enable_fast_paths(model, compile=True)
    patched = kc.with_loras(model, [(_lora_for(model), 1.0)])
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=fast.__name__):
        model(**_inputs(model))  # the original fails: compilation is given up for every copy too
        caplog.clear()
        patched(**_inputs(model, batch=2))  # a new shape
    assert "compilation included" not in caplog.text


def test_a_compiler_failure_in_the_original_after_a_copy_was_made_keeps_outputs_exact(monkeypatch, caplog):
    """Edge case: the original's group falls back to eager after a LoRA copy was made from
    it while compiled; both the original and the copy still give their eager outputs (the copy's
    branches run), and the original's fallback leaves the copy's own compiled forwards alone."""
    model = demo.tiny_transformer()
    kw = _inputs(model)
    lora = _lora_for(model)
    with torch.no_grad():
        want_base = model(**kw)
        want_lora = kc.with_loras(model, [(lora, 1.0)])(**kw)
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    fast.enable_fast_paths(model, compile=True)
    patched = kc.with_loras(model, [(lora, 1.0)])
    with torch.no_grad():
        got_base = model(**kw)
        assert not fast.is_compiled(model.double_blocks[0])
        assert fast.is_compiled(patched.double_blocks[0])  # not yet run: still its own compiled forward
        got_lora = patched(**kw)
    assert torch.equal(got_base, want_base) and torch.equal(got_lora, want_lora)
    assert not torch.equal(got_lora, got_base)


def test_after_a_compiler_failure_the_blocks_run_the_fast_path_not_the_plain_one(monkeypatch, caplog):
    """Was a bug (fast._compile_group's ``on_failure`` with ``FastOps._resolve``): a compiler failure
    warns "running them eagerly (the fast path without compilation)", but the model keeps the
    compile speed's ops, whose fused kernels (comfy-kitchen, elementwise) are off because Inductor
    was to fuse them: every later step runs the plain QK-norm + RoPE and modulation, slower than
    ``speed="fast"``, and ``describe_speed`` still says they ran in Inductor."""
    calls = _kitchen_rope_calls(monkeypatch)
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    model = demo.tiny_transformer()
    kw = _inputs(model)
    speed.apply_speed(model, None, "compile")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=fast.__name__):
        model(**kw)  # fails to compile: eager from now on
        assert "the fast path without compilation" in caplog.text
        assert not fast.is_compiled(model.double_blocks[0])
        calls.clear()
        model(**kw)
    assert calls, "after the fallback the blocks ran the plain QK-norm + RoPE, not the fast path"
    assert "inductor" not in speed.describe_speed(model)


def test_after_a_compiler_failure_the_vae_runs_its_fused_norms(monkeypatch, caplog):
    """The VAE decoder at speed compile runs no fused GroupNorm (Inductor fuses it); after it fails
    to compile, it runs eagerly with the fused GroupNorm + SiLU, as speed fast does (the
    channels-last decode with plain GroupNorms is the slow one: docs/speed.md, "The VAE"). The
    encoder, eager under compile, has the fused norms throughout; plain takes every norm back."""
    require("comfy_kitchen")
    from klein_core.models.vae import GroupNormAct

    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    calls = []
    real = fast.group_norm_silu
    monkeypatch.setattr(fast, "group_norm_silu", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    vae = demo.tiny_vae().to(torch.bfloat16)
    lat = torch.randn(1, 128, 3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    speed.apply_speed(vae=vae, speed="compile")
    assert all(m.fused is None for m in vae.decoder.modules() if isinstance(m, GroupNormAct))
    with caplog.at_level(logging.WARNING, logger=fast.__name__):
        want = vae.decode(lat)  # fails to compile: run eagerly, then the fused norms are on
        assert "VAE decoder" in caplog.text and not calls
        got = vae.decode(lat)
    decoder_norms = [m for m in vae.decoder.modules() if isinstance(m, GroupNormAct)]
    assert calls and all(m.fused is not None for m in decoder_norms)
    assert all(m.fused is not None for m in vae.encoder.modules() if isinstance(m, GroupNormAct))
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel < 5e-2  # bf16 through a random net (test_fast: 2.3e-2 fused against plain)
    speed.apply_speed(vae=vae, speed="plain")
    assert all(m.fused is None for m in vae.modules() if isinstance(m, GroupNormAct))
    assert not vae.decoder._forward_pre_hooks


# --- fast ops ----------------------------------------------------------------------------------------

def test_kitchen_rope_tables_follow_new_tables_of_the_same_shape():
    """Edge case: comfy-kitchen's rotation matrices are cached by the identity of the RoPE
    tables; a forward with other positions of the same shape (other ids, new tables) must not reuse
    the previous tables' matrices. Each forward matches the plain path at its own positions."""
    require("comfy_kitchen")
    model = demo.tiny_transformer()
    kw = _inputs(model)
    other_ids = position_ids(3, 4) + torch.tensor([0, 5, 7, 0])  # same shape, other positions
    with torch.no_grad():
        ref = model(**kw)
        ref_other = model(**{**kw, "img_ids": other_ids})
        assert not torch.equal(ref, ref_other)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
            ops = fast.enable_fast_paths(model, attention="plain")
            out = model(**kw)
            out_other = model(**{**kw, "img_ids": other_ids})
            out_again = model(**kw)
    assert "qk-norm+rope=comfy-kitchen" in ops.resolved()["cpu torch.float32"]
    for a, b in ((out, ref), (out_other, ref_other), (out_again, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fast_ops_resolved_per_dtype_after_the_model_changes_dtype():
    """Edge case: one ``FastOps`` across ``model.to(bfloat16)`` and back: each dtype is
    bound (and self-checked) on its own, and every forward equals the plain path in its dtype."""
    model = demo.tiny_transformer()
    kw = _inputs(model)
    twin = copy.deepcopy(model)
    ops = fast.enable_fast_paths(model)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            model.to(dtype)
            twin.to(dtype)
            assert torch.equal(model(**kw), twin(**kw))
    assert sorted(ops.resolved()) == ["cpu torch.bfloat16", "cpu torch.float32"]


# --- the bridged native MODEL's speed -----------------------------------------------------------------

@pytest.mark.parametrize("chosen", ["fast", "compile"])
def test_the_bridged_view_of_a_compile_speed_model_runs_the_fast_kernels(comfy_pack, monkeypatch, chosen):
    """Was a bug (nodes/native_model.bridge + accel.fast: ``FastOps`` with ``compile=True``): Klein Model
    to MODEL runs a ``module_view`` of the transformer, which drops the compiled forwards (docs: "the
    bridged MODEL runs the fast path eagerly"). Under ``speed="compile"`` the view keeps the compile
    speed's ops, whose fused kernels are off because "Inductor fuses these itself"; nothing is
    compiled in the view, so it runs neither Inductor nor comfy-kitchen (nor the elementwise
    kernels): "fast + compile" bridges to a slower model than "fast". Here the kitchen's rms_rope
    must run in the view at both speeds (it runs at ``fast``, not at ``compile``)."""
    import importlib

    native = importlib.import_module("klein_pack_nodes.native_model")
    calls = _kitchen_rope_calls(monkeypatch)
    model = demo.tiny_transformer()
    kw = _inputs(model)
    speed.apply_speed(model, None, chosen)
    view = native.KleinDiffusionModel(model, "tiny").transformer  # what Klein Model to MODEL runs
    assert not fast.is_compiled(view.double_blocks[0])  # the view runs eagerly (documented)
    with torch.no_grad():
        view(**kw)
    assert calls, f"speed {chosen}: the bridged view ran the plain QK-norm + RoPE"


# --- step cache --------------------------------------------------------------------------------------

def _denoise(model, seed, steps=12, neg=True, grid=(6, 6), callback=None):
    from klein_core.pipeline.sampling import denoise, get_schedule

    g = torch.Generator().manual_seed(seed)
    d = model.config.context_dim
    noise = torch.randn(1, 128, *grid, generator=g)
    txt = torch.randn(1, 8, d, generator=g)
    neg_txt = torch.randn(1, 8, d, generator=g) if neg else None
    sigmas = get_schedule(steps, grid[0] * grid[1])
    with torch.no_grad():
        return denoise(model, noise, txt, sigmas, neg_txt=neg_txt, guidance=4.0 if neg else 1.0,
                       callback=callback)


def test_step_cache_after_a_cancelled_run_and_cfg_switched_off_and_on():
    """Edge case: a run cancelled midway (the callback raises after a skip was possible),
    then a run without CFG, then one with CFG at the same shapes as the cancelled one, warmup 0 (a
    stale residual would be used at once): each equals the same run on a fresh copy of the model
    with its own cache, and the cancelled run's tensors were released."""
    from klein_core.accel import enable_step_cache

    model = _smooth_in_time(demo.tiny_transformer())
    fresh = copy.deepcopy(model)
    cache = enable_step_cache(model, threshold=0.3, warmup=0)

    class Cancel(Exception):
        pass

    def cancel(i, *args, **kwargs):
        if i >= 6:
            raise Cancel

    with pytest.raises(Cancel):
        _denoise(model, seed=1, callback=cancel)
    assert all(p.residual is None and p.prev_first is None for p in cache._passes.values())
    got = [_denoise(model, seed=2, neg=False), _denoise(model, seed=3)]
    want = []
    for neg, seed in ((False, 2), (True, 3)):
        enable_step_cache(fresh, threshold=0.3, warmup=0)
        want.append(_denoise(fresh, seed=seed, neg=neg))
    assert cache.last_run == fresh.step_cache.last_run and cache.last_run.skipped > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --- the text encoder's CUDA-graph replay ---------------------------------------------------------------

@pytest.fixture
def frozen_graphs(monkeypatch):
    """Replay allowed on the CPU (as test_text_graph's ``cpu_graphs``), with a recorder that keeps
    what a real CUDA graph keeps: the kernels chosen at capture, here the autocast state then (a
    graph replays the recorded kernels whatever context the caller is in at replay)."""
    original = GraphedTextForward._check

    def check(self, input_ids, attention_mask, activations, left_padded):
        why, weights = original(self, input_ids, attention_mask, activations, left_padded)
        return (None if why == "not on a CUDA device" else why), weights

    def record(self, ids, mask, left_padded):
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

        def run():
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                return self._eager(ids, mask, None, left_padded=left_padded)

        out = run()

        def replay():
            with torch.inference_mode():
                out.copy_(run())
        return replay, out

    monkeypatch.setattr(GraphedTextForward, "_check", check)
    monkeypatch.setattr(GraphedTextForward, "_record", record)


def test_replay_under_another_autocast_state_gives_the_eager_features(frozen_graphs):
    """Was a bug (text_graph.GraphedTextForward._check / the graph key): "eager whenever replay could
    differ from it", but the autocast state is neither a reason to run eagerly nor part of the
    graph's key. A graph recorded outside autocast and replayed inside it (or the reverse: a script
    that wraps one generate in ``torch.autocast``) returns the kernels of the other state. Shown
    with autocast on the CPU, where the stand-in recorder keeps the capture's state as a graph does."""
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_autocast = te.encode(ids, mask)
    want = te.encode(ids, mask)
    assert not torch.equal(want, want_autocast.to(want.dtype))
    enable_fast_text_encoder(te, compile=False, graphs=True)
    assert torch.equal(te.encode(ids, mask), want)  # recorded outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = te.encode(ids, mask)
    assert got.dtype == want_autocast.dtype and torch.equal(got, want_autocast)


def test_replay_after_load_state_dict_and_a_merged_lora_reads_the_new_weights(frozen_graphs):
    """Edge case: the weights replaced the two ways a host does it, ``load_state_dict``
    (copied in place: same addresses, replayed) and a merged LoRA (``apply_loras(mode="merge")``:
    new tensors, recorded again), then the LoRA removed: every encode equals the eager forward of
    the weights at that moment, never the recorded ones."""
    from klein_core.lora import apply_loras

    te = demo.tiny_text_encoder()
    other = demo.tiny_text_encoder(seed=5)
    ids, mask = tokens()
    proj = te.layers[0].self_attn.q_proj
    g = torch.Generator().manual_seed(1)
    lora = kc.load_lora({"text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight":
                         torch.randn(4, proj.in_features, generator=g),
                         "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight":
                         torch.randn(proj.out_features, 4, generator=g)})
    enable_fast_text_encoder(te, compile=False, graphs=True)
    forward = graphed_forward(te)

    def eager():
        with torch.no_grad():
            return type(te).forward(te, *[t.clone() for t in (ids, mask)], left_padded=False)

    first = te.encode(ids, mask)
    assert torch.equal(first, eager())
    te.load_state_dict(other.state_dict())
    second = te.encode(ids, mask)
    assert torch.equal(second, eager()) and not torch.equal(second, first)
    handle = apply_loras(te, [(lora, 1.0)], mode="merge")
    third = te.encode(ids, mask)
    assert torch.equal(third, eager()) and not torch.equal(third, second)
    handle.remove()
    assert torch.equal(te.encode(ids, mask), second)
    assert forward.replays >= 3
