"""klein_core.accel.speed (the nodes' and the CLI's one switch over the fast paths), the attention
choice table, and the compile fallback, on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch

import klein_core
from klein_core import testing as demo
from klein_core.accel import fast, speed
from klein_core.cli import main as cli_main
from klein_core.models.block_ops import PLAIN_OPS
from klein_core.pipeline.sampling import position_ids, text_position_ids


def _inputs(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(img=torch.randn(1, 12, 128, generator=g), img_ids=position_ids(3, 4),
                txt=torch.randn(1, 5, model.config.context_dim, generator=g),
                txt_ids=text_position_ids(5), timesteps=torch.tensor([0.7]))


def test_fast_on_the_cpu_is_the_plain_path_without_a_warning(caplog):
    model, vae = demo.tiny_transformer(), demo.tiny_vae()
    kw = _inputs(model)
    with torch.no_grad():
        ref = model(**kw)
        with caplog.at_level(logging.DEBUG, logger="klein_core"):
            speed.apply_speed(model, vae, "fast")
            out = model(**kw)
    assert isinstance(model.ops, fast.FastOps) and speed.speed_of(model) == speed.speed_of(vae) == "fast"
    assert torch.equal(out, ref)  # bit for bit: nothing fast runs on the CPU
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert speed.describe_speed(model) == ("fast (cpu torch.float32: attention=plain, qk-norm+rope=plain, "
                                           "modulation=plain, elementwise=plain, swiglu=plain, compile=False)")


def test_apply_speed_is_idempotent_and_switches_back():
    model, vae = demo.tiny_transformer(), demo.tiny_vae()
    speed.apply_speed(model, vae, "fast")
    ops = model.ops
    speed.apply_speed(model, vae, "fast")
    assert model.ops is ops  # not rebuilt: no repeated self-checks or recompilation
    speed.apply_speed(model, vae, "compile")  # compiled lazily: nothing runs here
    blocks = [*model.double_blocks, *model.single_blocks]
    assert all(fast.is_compiled(b) for b in blocks)
    # an fp32 VAE: comfy-kitchen's norms cannot serve its encoder, so it is compiled too
    assert fast.is_compiled(vae.decoder) and fast.is_compiled(vae.encoder) and vae.decode_channels_last
    assert model.ops.settings.compile
    speed.apply_speed(model, vae, "plain")
    assert model.ops is PLAIN_OPS and not any(fast.is_compiled(b) for b in blocks)
    assert not fast.is_compiled(vae.decoder) and not vae.decode_channels_last
    assert speed.speed_of(model) == "plain"


def test_switching_by_hand_makes_the_next_apply_speed_act():
    model = demo.tiny_transformer()
    speed.apply_speed(model, None, "fast")
    fast.disable_fast_paths(model)  # by hand
    assert model.ops is PLAIN_OPS and speed.speed_of(model) == "plain"
    speed.apply_speed(model, None, "fast")
    assert isinstance(model.ops, fast.FastOps)


def test_bad_speed_is_refused_before_anything_changes():
    model = demo.tiny_transformer()
    with pytest.raises(ValueError, match="speed must be one of fast, compile, plain; got 'turbo'"):
        speed.apply_speed(model, None, "turbo")
    with pytest.raises(ValueError, match="speed must be one of"):
        klein_core.Engine(model, speed="turbo")
    with pytest.raises(ValueError, match="memory must be one of"):  # a later argument wrong: model untouched
        klein_core.Engine(model, memory="lots", speed="fast")
    assert model.ops is PLAIN_OPS


def test_engine_and_generate_take_a_speed_and_default_to_leaving_models_alone():
    tr, te, vae = demo.build_tiny_components()
    kw = dict(prompt="a cat", width=64, height=64, steps=2, seed=3, cache=None)
    plain = klein_core.generate(tr, te, vae, **kw)
    assert tr.ops is PLAIN_OPS  # speed=None: as the models are
    fast_run = klein_core.generate(tr, te, vae, speed="fast", **kw)
    assert isinstance(tr.ops, fast.FastOps) and speed.speed_of(vae) == "fast"
    assert torch.equal(plain.latents, fast_run.latents)
    klein_core.Engine(tr, te, vae, speed="plain")
    assert tr.ops is PLAIN_OPS


@pytest.mark.parametrize("capability, expected", [((9, 0), "sdpa_cudnn"), ((8, 0), "sdpa"), ((12, 0), "sdpa")])
def test_auto_attention_table(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fast.auto_attention(torch.device("cuda", 0)) == expected
    assert fast.auto_attention(torch.device("cpu")) == "plain"


def test_auto_attention_resolves_silently_to_the_table_entry(monkeypatch, caplog):
    """On an sm_90 GPU ``auto`` builds the cuDNN-first SDPA (no warning); FlashAttention packages
    are not what auto picks (they were not measured)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    made = []
    monkeypatch.setattr(fast, "_make_sdpa", lambda names: made.append(list(names)) or (lambda q, k, v: q))
    with caplog.at_level(logging.WARNING, logger="klein_core.accel.fast"):
        fn, name = fast._resolve_attention("auto", torch.device("cuda", 0), torch.bfloat16, 128)
    assert name == "sdpa_cudnn" and made == [["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]]
    assert not caplog.records


def _compile_that_fails(*args, **kwargs):
    def compiled(*a, **k):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error (stand-in)")
    return compiled


def test_compile_failure_falls_back_to_eager_once_with_a_warning(monkeypatch, caplog):
    model = demo.tiny_transformer()
    kw = _inputs(model)
    with torch.no_grad():
        ref = model(**kw)
        monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
        fast.enable_fast_paths(model, compile=True)
        with caplog.at_level(logging.WARNING, logger="klein_core.accel.fast"):
            out = model(**kw)
            again = model(**kw)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "torch.compile failed for the transformer blocks" in warnings[0]
    assert "CppCompileError" in warnings[0]
    assert not any(fast.is_compiled(b) for b in [*model.double_blocks, *model.single_blocks])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, again)


def test_an_input_error_under_compile_is_raised_and_compilation_stays(monkeypatch):
    """When eager fails too, the input was at fault: that error is raised, compile stays on."""
    model = demo.tiny_transformer()
    monkeypatch.setattr(fast.torch, "compile", _compile_that_fails)
    fast.enable_fast_paths(model, compile=True)
    block = model.single_blocks[0]
    with pytest.raises(TypeError, match="cannot unpack"):
        block(torch.randn(1, 3, 7), None, None, None)  # no modulation: eager fails as well
    assert fast.is_compiled(block)


def test_regional_compilation_compiles_each_block_kind_once():
    """3 double and 4 single blocks: dynamo captures two graphs (one per block class), not seven."""
    import dataclasses

    import torch._dynamo.utils as dynamo_utils

    from klein_core.testing.tiny import TINY_4B

    torch._dynamo.reset()
    model = demo.tiny_transformer(dataclasses.replace(TINY_4B, depth=3, depth_single=4))
    fast.enable_fast_paths(model, compile=True, compile_backend="eager")
    dynamo_utils.counters.clear()
    with torch.no_grad():
        model(**_inputs(model))
        model(**_inputs(model, seed=1))  # another input of the same shape: no recompilation
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_cli_speed_flag(tmp_path, capsys):
    out = tmp_path / "plain.png"
    assert cli_main(["--demo", "--out", str(out), "--speed", "plain", "--steps", "1"]) == 0
    assert "speed plain" in capsys.readouterr().err
    assert cli_main(["--demo", "--out", str(tmp_path / "fast.png"), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "speed fast (cpu" in err and "attention=plain" in err
    with pytest.raises(SystemExit):
        cli_main(["--demo", "--speed", "turbo"])
    assert "invalid choice: 'turbo'" in capsys.readouterr().err
