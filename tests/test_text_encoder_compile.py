"""The text encoder under ``speed="compile"`` (klein_core.accel.text_encoder), on the CPU with dynamo's
eager backend (traced, no code generated, so fast): the layers compiled as one graph, the same
features as the plain path, the first encode at a shape timed, a compiler failure answered with the
plain path and one warning, and the switch through ``apply_speed`` / ``Engine(speed=)``. Inductor's
fused kernels are compared with the plain path on a GPU (tests/gpu/test_gpu_fast.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from text_encoder_files import fresh_dynamo, tokens  # noqa: F401 - fresh_dynamo is autouse

import klein_core
from klein_core import testing as demo
from klein_core.accel import fast, speed
from klein_core.accel.text_encoder import disable_fast_text_encoder, enable_fast_text_encoder


def _compile_that_fails(*args, **kwargs):
    def compiled(*a, **k):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error (stand-in)")
    return compiled


def test_compiled_layers_give_the_plain_features_and_one_graph(caplog):
    import torch._dynamo.utils as dynamo_utils

    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    other_ids, other_mask = tokens(("an old boat", "rain on a window"))  # the same shape, other tokens
    plain = te.encode(ids, mask)
    plain_other = te.encode(other_ids, other_mask)
    plain32 = te.encode(ids, mask, activations=torch.float64)
    dynamo_utils.counters.clear()
    with caplog.at_level(logging.INFO, logger="klein_core.accel.fast"):
        enable_fast_text_encoder(te, compile_backend="eager")
        assert all(fast.is_compiled(layer) for layer in te.layers)
        first = te.encode(ids, mask)
        other = te.encode(other_ids, other_mask)
        again = te.encode(ids, mask)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1  # 27 layers, one graph, no recompile
    assert torch.equal(first, plain) and torch.equal(again, plain) and torch.equal(other, plain_other)
    assert not torch.equal(other, first)
    timed = [r.getMessage() for r in caplog.records if "first forward" in r.getMessage()]
    assert len(timed) == 1 and "[(2, 40, 32), (1, 1, 40, 16)" in timed[0], timed  # x [B, L, H], cos, ...
    # ComfyUI's way (activations in a wider dtype, each layer's weights cast by hooks around its call)
    assert torch.equal(te.encode(ids, mask, activations=torch.float64), plain32)
    disable_fast_text_encoder(te)
    assert not any(fast.is_compiled(layer) for layer in te.layers)
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in te.layers)


def test_a_compiler_failure_falls_back_to_the_plain_path_with_one_warning(monkeypatch, caplog):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    enable_fast_text_encoder(te)
    with caplog.at_level(logging.WARNING, logger="klein_core.accel.fast"):
        out = te.encode(ids, mask)
        again = te.encode(ids, mask)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "torch.compile failed for the text encoder layers" in warnings[0]
    assert not any(fast.is_compiled(layer) for layer in te.layers)
    assert torch.equal(out, plain) and torch.equal(again, plain)


def test_apply_speed_and_the_engine_switch_the_text_encoder():
    tr, te, vae = demo.build_tiny_components()
    speed.apply_speed(tr, vae, "fast", te)
    assert speed.speed_of(te) == "fast" and not any(fast.is_compiled(layer) for layer in te.layers)
    speed.apply_speed(tr, vae, "compile", te)  # compiled lazily: nothing runs here
    assert speed.speed_of(te) == "compile" and all(fast.is_compiled(layer) for layer in te.layers)
    speed.apply_speed(tr, vae, "compile", te)  # idempotent
    speed.apply_speed(tr, vae, "plain", te)
    assert speed.speed_of(te) == "plain" and not any(fast.is_compiled(layer) for layer in te.layers)
    klein_core.Engine(tr, te, vae, speed="compile")
    assert all(fast.is_compiled(layer) for layer in te.layers)
    klein_core.Engine(tr, te, vae, speed="plain")
    assert not any(fast.is_compiled(layer) for layer in te.layers)
    with pytest.raises(TypeError, match="Qwen3TextEncoder"):
        enable_fast_text_encoder(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
