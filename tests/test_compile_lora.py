"""LoRA branches on a compiled model (``speed="compile"``): ``with_loras`` makes shallow copies of the
modules on the way to each adapted Linear. Two things made the LoRA silently ignored under compile
(found by these tests; the output was the base model's exactly): a compiled ``forward`` is bound to
the module it was made for, so a block's copy ran the original block, whose children have no
branches; and dynamo does not guard on the hooks of inlined modules by default, so a graph traced
for the original was reused for the copy. Each copy now gets its own compiled forward
(``klein_rebind``), and compiled calls run with dynamo's hook guards on.

Dynamo's eager backend here (traced, nothing generated), so compiled and eager give the same bits.
"""

from __future__ import annotations

import pytest
import torch

import klein_core as kc
from klein_core import testing as demo
from klein_core.accel import fast
from klein_core.accel.text_encoder import enable_fast_text_encoder
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.pipeline.tokenizer import tokenize_prompts
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.save import save_lora


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A LoRA with a transformer part (every block) and a text-encoder part, large enough to matter."""
    tr_lora = LoRASet(demo.tiny_transformer(), preset("full", rank=2), seed=1)
    te_lora = LoRASet(demo.tiny_text_encoder(), text_encoder_preset(rank=2), seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in [*tr_lora.layers.values(), *te_lora.layers.values()]:
            layer.up.copy_(torch.randn(layer.up.shape, generator=g))
    path = tmp_path_factory.mktemp("lora") / "both.safetensors"
    save_lora(path, tr_lora, text_lora=te_lora)
    return kc.load_lora(path)


def _transformer_inputs(model):
    g = torch.Generator().manual_seed(0)
    return dict(img=torch.randn(1, 12, 128, generator=g), img_ids=position_ids(3, 4),
                txt=torch.randn(1, 5, model.config.context_dim, generator=g), txt_ids=text_position_ids(5),
                timesteps=torch.tensor([0.7]))


def test_lora_branches_run_on_a_compiled_transformer(lora):
    model = demo.tiny_transformer()
    kw = _transformer_inputs(model)
    initial = torch._dynamo.config.skip_nnmodule_hook_guards
    with torch.no_grad():
        base = model(**kw)
        want = kc.with_loras(model, [(lora, 1.0)])(**kw)
        assert (want - base).abs().max() > 1e-2  # the LoRA matters
        fast.enable_fast_paths(model, compile=True, compile_backend="eager")
        first = model(**kw)  # the original compiles first: its graphs have no branch hooks
        patched = kc.with_loras(model, [(lora, 1.0)])
        got = patched(**kw)  # dynamo must not reuse them for the hooked copy (hook guards)
        after = model(**kw)
    assert torch.equal(got, want)
    assert torch.equal(first, base) and torch.equal(after, base)  # the compiled original is untouched
    assert torch._dynamo.config.skip_nnmodule_hook_guards is initial  # set only around our calls
    block, copy = model.double_blocks[0], patched.double_blocks[0]
    assert copy is not block and fast.is_compiled(copy) and copy.forward is not block.forward


def test_lora_branches_run_on_a_compiled_text_encoder(lora):
    te = demo.tiny_text_encoder()
    ids, mask = tokenize_prompts(["a red fox", "rain"], max_length=24)
    base = te.encode(ids, mask)
    want = kc.with_loras(te, [(lora, 1.0)]).encode(ids, mask)
    assert (want - base).abs().max() > 1e-2
    enable_fast_text_encoder(te, compile_backend="eager")
    assert torch.equal(te.encode(ids, mask), base)  # compiled without hooks first
    got = kc.with_loras(te, [(lora, 1.0)]).encode(ids, mask)
    assert torch.equal(got, want) and torch.equal(te.encode(ids, mask), base)


def test_a_compiler_failure_in_a_copy_falls_back_for_that_copy(lora, monkeypatch, caplog):
    def fails(*args, **kwargs):
        def compiled(*a, **k):
            raise RuntimeError("InductorError: stand-in")
        return compiled

    model = demo.tiny_transformer()
    kw = _transformer_inputs(model)
    with torch.no_grad():
        want = kc.with_loras(model, [(lora, 1.0)])(**kw)
        fast.enable_fast_paths(model, compile=True, compile_backend="eager")
        monkeypatch.setattr(fast.torch, "compile", fails)  # the copies' compiled forwards fail
        patched = kc.with_loras(model, [(lora, 1.0)])
        got = patched(**kw)
    assert torch.equal(got, want)
    assert any("a copy of the transformer blocks" in r.getMessage() for r in caplog.records)
    assert not fast.is_compiled(patched.double_blocks[0]) and fast.is_compiled(model.double_blocks[0])


def test_another_strength_on_a_compiled_model_is_not_the_first_ones(lora):
    """A second copy at another strength reuses the LoRA graph (no recompilation) and gives that
    strength's output, not the first one's (a strength baked into the graph would)."""
    import torch._dynamo.utils as dynamo_utils

    model = demo.tiny_transformer()
    kw = _transformer_inputs(model)
    with torch.no_grad():
        want = {s: kc.with_loras(model, [(lora, s)])(**kw) for s in (1.0, 0.5)}
        assert (want[1.0] - want[0.5]).abs().max() > 1e-2
        fast.enable_fast_paths(model, compile=True, compile_backend="eager")
        dynamo_utils.counters.clear()
        first = kc.with_loras(model, [(lora, 1.0)])(**kw)
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        second = kc.with_loras(model, [(lora, 0.5)])(**kw)
    assert torch.equal(first, want[1.0]) and torch.equal(second, want[0.5])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_switching_the_speed_of_a_lora_copy_leaves_the_model_alone(tmp_path):
    """``with_loras`` copies every block (not only the adapted ones) and the speed switches remove
    hooks from the module they are given: putting a LoRA copy of a compiled model on ``plain``
    uncompiles the copy's blocks and timing hooks only. (Nothing is called compiled here, so
    Inductor never runs.)"""
    from klein_core.accel import speed

    tr, te = demo.tiny_transformer(), demo.tiny_text_encoder()
    tr_lora = LoRASet(tr, preset("style", rank=2), seed=1)  # double blocks: the single ones are not adapted
    te_lora = LoRASet(te, text_encoder_preset(rank=2), seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in [*tr_lora.layers.values(), *te_lora.layers.values()]:
            layer.up.copy_(torch.randn(layer.up.shape, generator=g))
    lora = kc.load_lora(save_lora(tmp_path / "style.safetensors", tr_lora, text_lora=te_lora))
    kw = _transformer_inputs(tr)
    ids, mask = tokenize_prompts(["a red fox"], max_length=16)
    with torch.no_grad():
        want_tr = kc.with_loras(tr, [(lora, 1.0)])(**kw)
    want_te = kc.with_loras(te, [(lora, 1.0)]).encode(ids, mask)
    speed.apply_speed(tr, None, "compile", te)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in (tr, te.layers[0], te.layers[-1])]
    tr_copy, te_copy = kc.with_loras(tr, [(lora, 1.0)]), kc.with_loras(te, [(lora, 1.0)])
    speed.apply_speed(tr_copy, None, "plain", te_copy)
    blocks = [*tr.double_blocks, *tr.single_blocks, *te.layers]
    copies = [*tr_copy.double_blocks, *tr_copy.single_blocks, *te_copy.layers]
    assert all(fast.is_compiled(b) for b in blocks) and not any(fast.is_compiled(b) for b in copies)
    assert not {id(b) for b in blocks} & {id(b) for b in copies}
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in (tr, te.layers[0], te.layers[-1])] == hooks
    assert hooks[0] != (0, 0) and not tr_copy._forward_pre_hooks and not te_copy.layers[0]._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(tr_copy(**kw), want_tr)
    assert torch.equal(te_copy.encode(ids, mask), want_te)
    assert speed.speed_of(tr) == speed.speed_of(te) == "compile"


def test_dora_branches_run_on_a_compiled_transformer():
    """DoRA branches (rows scaled on the output in place, and a per-column one kept dense) traced by
    dynamo give the bits of the eager copy, and leave the compiled original alone."""
    model = demo.tiny_transformer()
    g = torch.Generator().manual_seed(4)
    sd = {}
    for name, axis in (("double_blocks.0.img_attn.qkv", 1), ("single_blocks.0.linear2", 1),
                       ("double_blocks.0.img_mlp.0", 0)):
        w = model.get_submodule(name).weight.detach()
        key = f"diffusion_model.{name}"
        sd[f"{key}.lora_down.weight"] = torch.randn(2, w.shape[1], generator=g) * 0.3
        sd[f"{key}.lora_up.weight"] = torch.randn(w.shape[0], 2, generator=g) * 0.3
        norms = w.norm(dim=axis, keepdim=True)
        sd[f"{key}.dora_scale"] = norms * (0.5 + torch.rand(norms.shape, generator=g))
    dora = kc.load_lora(sd)
    kw = _transformer_inputs(model)
    with torch.no_grad():
        base = model(**kw)
        want = kc.with_loras(model, [(dora, 0.8)])(**kw)
        assert (want - base).abs().max() > 1e-2
        fast.enable_fast_paths(model, compile=True, compile_backend="eager")
        model(**kw)
        got = kc.with_loras(model, [(dora, 0.8)])(**kw)
        after = model(**kw)
    assert torch.equal(got, want) and torch.equal(after, base)
