"""LoRAs on the device: merge and branch on a bf16 model and on an fp8 model, exact removal, the
non-mutating copy, and the factors (read on the CPU) following the weights to the GPU.

Tolerances. Merging adds the float32 delta to the weight and rounds once to the weight dtype; the
independent expectation does the same sum on the CPU, so weights agree to one bf16 rounding and the
outputs within 1% relative L2 on CUDA (exact in fp32: 1e-5). A branch computes ``x @ A^T @ B^T``
in the weight dtype beside the unchanged layer: against merge, bf16 rounding of both, within 2% (fp32:
1e-4). On fp8 weights the merge re-quantises the merged weight (e4m3, 3 mantissa bits) while the
branch keeps the LoRA in bf16: within 2.5% (CPU: 0.86% fp32, 1.0% bf16). The LoRAs move the output
by 22-28% (CPU), and every bound is also held under a quarter of that effect, so a LoRA that did
nothing could not pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import klein_core as kc
from klein_core.lora import has_loras
from klein_core.quant.fp8 import FP8Linear, block_linear_names, quantize_model_

from .helpers import _cpu_states, forward, rel_l2, tag, transformer_inputs


def _lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int, scale: float = 1.0):
    """A BFL-named LoRA state dict over ``shapes`` (module -> (out, in)) and its float32 deltas."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for name, (o, i) in shapes.items():
        a = torch.randn(rank, i, generator=g) * scale / i**0.5
        b = torch.randn(o, rank, generator=g) * scale
        sd[f"diffusion_model.{name}.lora_A.weight"] = a
        sd[f"diffusion_model.{name}.lora_B.weight"] = b
        deltas[name] = b @ a
    return sd, deltas


def _shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    mods = dict(model.named_modules())
    out = {}
    for n in block_linear_names(model):
        m = mods[n]
        out[n] = (m.out_features, m.in_features)
    return out


def _state(gpu) -> dict[str, torch.Tensor]:
    """The small transformer's weights rounded to the target dtype (float32 values)."""
    sd = _cpu_states(0, gpu)["transformer"]
    return {k: v.to(gpu.dtype).float() for k, v in sd.items()}


def _load(gpu, sd):
    return kc.load_transformer(sd, device=gpu.device, dtype=gpu.dtype)


def test_merge_and_branch_on_the_device(gpu, parity):
    sd = _state(gpu)
    model = _load(gpu, sd)
    lora_sd, deltas = _lora(_shapes(model), rank=4, seed=3)
    lora = kc.load_lora(lora_sd)
    inputs = transformer_inputs(model, gpu, 8, 8, ref=(4, 4), batch=2)
    base = forward(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strength = 0.8
    expected_sd = {k: v.clone() for k, v in sd.items()}
    for name, d in deltas.items():
        expected_sd[name + ".weight"] += strength * d
    expected = forward(_load(gpu, expected_sd), inputs)
    # The LoRA must move the output far more than the bounds below, or a no-op would pass them.
    effect = parity(tag(gpu, "LoRA effect: merged weights vs base, relative L2"), rel_l2(expected, base))
    assert effect > 0.03, effect

    handle = kc.apply_loras(model, [(lora, strength)])
    assert len(handle.modules) == len(deltas) and has_loras(model)
    assert all(p.device.type == gpu.device.type for p in model.parameters())
    merged = forward(model, inputs)
    rel = parity(tag(gpu, "LoRA merge vs independent merged weights, relative L2"), rel_l2(merged, expected))
    assert rel < min(1e-2 if gpu.half else 1e-5, effect / 4), rel
    handle.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "merge removal must be exact"

    branch = kc.apply_loras(model, [(lora, strength)], mode="branch")
    branched = forward(model, inputs)
    rel = parity(tag(gpu, "LoRA branch vs merge, relative L2"), rel_l2(branched, merged))
    assert rel < min(2e-2 if gpu.half else 1e-4, effect / 4), rel
    branch.remove()
    assert torch.equal(forward(model, inputs), base)

    copy = kc.with_loras(model, [(lora, strength)])
    assert torch.equal(forward(copy, inputs), branched)  # the same hooks on a copy sharing the weights
    assert torch.equal(forward(model, inputs), base) and not has_loras(model)


@pytest.mark.cuda("torch.compile with inductor needs minutes on 2 CPU cores; tests/test_compile_lora.py "
                  "covers the copies' compiled forwards with the eager backend")
def test_lora_copy_of_a_compiled_model(gpu, parity):
    """``with_loras`` on a model compiled by ``speed="compile"`` (Inductor) and run: the copy runs its
    LoRA branches (before the fix it ran the original's compiled forward and graphs, ignoring them)."""
    from klein_core.accel import fast

    model = _load(gpu, _state(gpu))
    lora = kc.load_lora(_lora(_shapes(model), rank=4, seed=3)[0])
    inputs = transformer_inputs(model, gpu, 8, 8, ref=(4, 4), batch=2)
    base = forward(model, inputs)
    eager = forward(kc.with_loras(model, [(lora, 0.8)]), inputs)
    effect = rel_l2(eager, base)
    try:
        fast.enable_fast_paths(model, compile=True)
        forward(model, inputs)  # the original compiles first: graphs without the branch hooks
        compiled = forward(kc.with_loras(model, [(lora, 0.8)]), inputs)
    finally:
        fast.disable_fast_paths(model)
        torch._dynamo.reset()
    rel = parity(tag(gpu, "LoRA copy of a compiled model vs eager copy, relative L2"),
                 rel_l2(compiled, eager))
    assert rel < min(2e-2 if gpu.half else 1e-5, effect / 4), (rel, effect)


def test_merge_and_branch_on_fp8_weights(gpu, parity):
    model = _load(gpu, _state(gpu))
    quantize_model_(model)
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8 and all(m.weight.device.type == gpu.device.type for m in fp8.values())
    lora_sd, _ = _lora(_shapes(model), rank=4, seed=4)
    lora = kc.load_lora(lora_sd)
    inputs = transformer_inputs(model, gpu, 8, 8, batch=2)
    base = forward(model, inputs)
    saved = {n: (m.weight.detach().clone(), m.weight_scale.clone()) for n, m in fp8.items()}
    handle = kc.apply_loras(model, [(lora, 0.7)])
    merged = forward(model, inputs)
    effect = parity(tag(gpu, "LoRA on fp8: merged vs base, relative L2"), rel_l2(merged, base))
    assert effect > 0.03, effect
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in fp8.values())
    handle.remove()
    for n, m in fp8.items():  # the fp8 bytes and the scale come back exactly
        w, s = saved[n]
        assert torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(m.weight_scale, s), n
    branch = kc.apply_loras(model, [(lora, 0.7)], mode="branch")
    branched = forward(model, inputs)
    branch.remove()
    rel = parity(tag(gpu, "LoRA on fp8: branch vs merge, relative L2"), rel_l2(branched, merged))
    assert rel < min(0.025, effect / 4), rel
    assert torch.equal(forward(model, inputs), base)


# ---------------------------------------------------------------------------------------------
# Full size


@pytest.mark.full_size(40)
def test_full_4b_lora_merge_and_branch(gpu, full4b, parity):
    """A rank-16 LoRA on every block Linear of the full-size 4B transformer (on the GPU): merge vs
    branch at 1024x1024 and an exact restore of the session's weights."""
    tr = full4b[0]
    lora_sd, _ = _lora(_shapes(tr), rank=16, seed=5, scale=0.5)
    lora = kc.load_lora(lora_sd)
    inputs = transformer_inputs(tr, gpu, 64, 64, txt_len=512)
    base = forward(tr, inputs)
    handle = kc.apply_loras(tr, [(lora, 1.0)])
    try:
        merged = forward(tr, inputs)
    finally:
        handle.remove()
    assert torch.equal(forward(tr, inputs), base), "merge removal must restore the weights exactly"
    branch = kc.apply_loras(tr, [(lora, 1.0)], mode="branch")
    try:
        branched = forward(tr, inputs)
    finally:
        branch.remove()
    changed = parity(tag(gpu, "full 4B LoRA: merged vs base, relative L2"), rel_l2(merged, base))
    assert changed > 1e-3
    rel = parity(tag(gpu, "full 4B LoRA branch vs merge, relative L2"), rel_l2(branched, merged))
    assert rel < min(0.05, changed / 4), rel
