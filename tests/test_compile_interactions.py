"""``speed="compile"`` meeting the rest of klein_core: many models in one process, and training.

Each test compares the compiled model with an eager reference computed before compiling. Dynamo's
eager / aot_eager backends (traced, nothing generated), so compiled and eager give the same bits;
a counting backend tells whether the compiled graphs ran at all.

* Dynamo keeps at most ``recompile_limit`` (8) graphs per code object, and every model and LoRA copy
  of a process shares the blocks' code objects. Past it, every new model size or LoRA structure ran
  eagerly for the rest of the process (one line in torch's log). The compiled calls now run with a
  higher limit (:data:`klein_core.accel.fast.RECOMPILE_LIMIT`).
* Non-reentrant gradient checkpointing stops its recomputation by raising an exception from inside
  the block's forward; the compiled forward took it for a compiler failure, re-ran the block eagerly
  and training crashed at the first backward pass. And leaving the checkpointing context removed the
  blocks' compiled forwards: every later step ran eagerly.
"""

from __future__ import annotations

import pytest
import torch

from klein_core import testing as demo
from klein_core.accel import fast
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.train.adapters import LoRASet, gradient_checkpointing, preset


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _CountingBackend:
    """A dynamo backend that runs the traced graph as it is and counts the calls of compiled graphs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            self.calls += 1
            return gm.forward(*args)
        return run


def _inputs(model, batch=1, h=3, w=4, length=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(batch, h * w, 128, generator=g), "img_ids": position_ids(h, w),
            "txt": torch.randn(batch, length, model.config.context_dim, generator=g),
            "txt_ids": text_position_ids(length), "timesteps": torch.full((batch,), 0.7)}


@torch._dynamo.config.patch(recompile_limit=8)  # torch's default, whatever the environment set
def test_many_models_in_one_process_all_stay_compiled():
    """Ten transformers of different sizes (as a session loading models and LoRAs makes graphs): each
    compiles its own graphs and runs them, none silently eager past dynamo's default limit of 8."""
    models = [demo.tiny_transformer(demo.TinySpec(hidden=16 * k, heads=k, depth=1, depth_single=1))
              for k in range(1, 11)]
    with torch.no_grad():
        wants = [m(**_inputs(m)) for m in models]
    backend = _CountingBackend()
    ran, diffs = [], []
    with torch.no_grad():
        for model, want in zip(models, wants):
            fast.enable_fast_paths(model, compile=True, compile_backend=backend)
            before = backend.calls
            got = model(**_inputs(model))
            ran.append(backend.calls - before)
            diffs.append((got - want).abs().max().item())
            assert torch.equal(got, want)
    assert ran == [2] * len(models), f"compiled block calls per model: {ran}"  # one double, one single
    assert max(diffs) == 0.0
    assert torch._dynamo.config.recompile_limit == 8  # raised only around our compiled calls


def test_lora_training_with_gradient_checkpointing_on_a_compiled_model():
    """One training step through gradient checkpointing (the trainer's default) on a compiled
    transformer: the compiled blocks run, with the same loss and LoRA gradients as eager, and the
    backward pass's recomputation does not crash."""
    def step(model, lora):
        lora.zero_grad(set_to_none=True)
        with gradient_checkpointing(model):
            loss = model(**_inputs(model, batch=2)).square().mean()
            ran.append(backend.calls)
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in lora.parameters()]

    model = demo.tiny_transformer()
    lora = LoRASet(model, preset("full", rank=2), seed=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in lora.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))  # up starts at zero: make every grad nonzero
    lora.attach(model)
    backend, ran = _CountingBackend(), []
    want_loss, want_grads = step(model, lora)
    assert all(g.abs().max() > 0 for g in want_grads)
    fast.enable_fast_paths(model, compile=True, compile_backend=backend)
    loss, grads = step(model, lora)
    assert ran == [0, 3]  # the compiled double block and both single blocks ran in the forward pass
    diff = max((a - b).abs().max().item() for a, b in zip(grads, want_grads))
    assert torch.equal(loss, want_loss) and diff == 0.0, f"max abs grad diff {diff}"
    # Leaving the checkpointing context puts the compiled forwards back: the next step runs them too
    # (popping the blocks' forward had left the model eager while its speed still said "compile").
    assert all(fast.is_compiled(b) for b in [*model.double_blocks, *model.single_blocks])
    before = backend.calls
    step(model, lora)
    assert ran[-1] - before == 3, f"compiled block calls in the second step's forward: {ran[-1] - before}"
