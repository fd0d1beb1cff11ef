"""Memory modes on the device: resident, swap, blocks and minimum (and auto) give the latents of the
resident run, the caller's modules are left as they were, and block streaming keeps its bound.

Placement copies weights, never converts them, and every mode runs the same kernels on the same
values, so the latents are expected to be bit-identical; the assertion allows bf16 tolerance on CUDA
(relative L2 1e-2, far below the 8% the dtype itself costs) so a legitimately different kernel
choice would not fail the run, and the parity table shows whether it was exact (0.0). On the CPU
they must be equal.
"""

from __future__ import annotations

import logging

import pytest
import torch

import klein_core as kc
from klein_core.memory.placement import BlockOffloader, pin_memory_

from .helpers import (
    forward,
    host_copy,
    load_small,
    max_abs,
    peak_bytes,
    reference_images,
    rel_l2,
    tag,
    transformer_inputs,
)

MODES = ("resident", "swap", "blocks", "minimum", "auto")


def _assert_same(gpu, parity, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = parity(tag(gpu, f"{name} vs resident, max abs"), max_abs(got, want))
    if gpu.cpu:
        assert diff == 0.0, diff
    else:
        assert rel_l2(got, want) < 1e-2, (name, diff)


def test_memory_modes_give_the_resident_latents(gpu, caplog, parity):
    """Components held on the CPU (pinned on CUDA), computed on the device in each mode."""
    on_device = load_small(gpu)
    held = load_small(gpu, device="cpu")
    for m in held:
        pin_memory_(m)
    homes = [{k: (v.device, v.data_ptr()) for k, v in m.state_dict().items()} for m in held]
    refs = reference_images(gpu.ref_sizes[:1])
    kw = {"prompt": "a quiet harbour", "references": refs, "steps": 3, "seed": 5, "cache": None}
    want = kc.generate(*on_device, memory="resident", **kw)
    for mode in MODES:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="klein_core"):
            got = kc.generate(*held, memory=mode, device=gpu.device, **kw)
        assert f"memory mode {mode} -> " in caplog.text
        if mode in ("blocks", "minimum"):
            assert "Block offload" in caplog.text  # the transformer's blocks really streamed
        _assert_same(gpu, parity, f"memory mode {mode}: latents", got.latents, want.latents)
        _assert_same(gpu, parity, f"memory mode {mode}: pixels", got.pixels, want.pixels)
        # the caller's modules keep their own (CPU) tensors
        assert [{k: (v.device, v.data_ptr()) for k, v in m.state_dict().items()} for m in held] == homes, mode
    if not gpu.cpu:
        assert all(p.is_pinned() for m in held for p in m.parameters())


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_block_offloader_on_the_device(gpu, prefetch, parity):
    """The transformer's blocks stream from CPU memory (a side CUDA stream on a GPU): outputs equal
    the resident model's, at most prefetch + 1 blocks are on the device, everything comes back."""
    resident = load_small(gpu)[0]
    model = load_small(gpu, device="cpu")[0]
    inputs = transformer_inputs(resident, gpu, 8, 8, ref=(4, 6), batch=2)
    want = forward(resident, inputs)
    off = BlockOffloader(model, gpu.device, prefetch=prefetch).attach()
    try:
        assert (off._stream is not None) == (gpu.device.type == "cuda")
        first = forward(model, inputs)
        second = forward(model, inputs)
    finally:
        off.detach()
    _assert_same(gpu, parity, f"BlockOffloader prefetch {prefetch}", first, want)
    assert torch.equal(first, second)
    assert off.stats.max_resident == min(prefetch, len(off.blocks) - 1) + 1
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_streamed_blocks_are_packed_in_page_locked_chunks(gpu):
    """Streaming pins the blocks' CPU homes packed into a few page-locked chunks
    (klein_core.memory.pinned): every block weight is page-locked, they share the planned chunks, and
    torch's page-locked allocator holds no more than those chunks for them (not one power of two per
    weight). On the CPU nothing is page-locked."""
    from klein_core.memory.pinned import plan_chunks
    from klein_core.memory.placement import find_block_lists

    model = load_small(gpu, device="cpu")[0]
    weights = [t for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()]]
    chunks = plan_chunks([t.nbytes for t in weights if t.numel()])
    stats = getattr(torch.cuda, "host_memory_stats", None) if not gpu.cpu else None
    before = stats().get("allocated_bytes.current") if stats else None
    BlockOffloader(model, gpu.device).attach().detach()
    weights = [t for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()]]
    if gpu.cpu:
        assert not any(t.is_pinned() for t in weights)
        return
    assert all(t.is_pinned() for t in weights if t.numel())
    assert len({t.untyped_storage().data_ptr() for t in weights if t.numel()}) == len(chunks)
    if before is not None:
        grew = stats()["allocated_bytes.current"] - before
        assert grew <= sum(size for size, _ in chunks), (grew, chunks)


def test_pin_memory_copies_a_device_model_into_page_locked_chunks(gpu):
    """pin_memory_ on a model on the device: its tensors copied straight into page-locked chunks
    (no ordinary CPU copy of the whole model first), the same values, all on the CPU."""
    model = load_small(gpu)[0]
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    pin_memory_(model)
    got = model.state_dict()
    assert all(v.device.type == "cpu" for v in got.values())
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(v.is_pinned() for v in got.values() if v.numel()) == (not gpu.cpu)


# ---------------------------------------------------------------------------------------------
# Full size


@pytest.mark.full_size(50)
def test_full_4b_memory_modes(gpu, full4b, parity):
    """Klein 4B at 1024x1024 with the components in pinned CPU memory: every mode gives the resident
    latents, and the peaks are ordered minimum <= blocks <= swap <= resident (5% slack). With the
    components held on the CPU even "resident" copies each one in for its stage only."""
    held = [host_copy(m) for m in full4b]
    kw = {"prompt": "a red fox in the snow", "seed": 7, "cache": None, "output": "latent", "device": gpu.device}
    want = kc.generate(*full4b, memory="resident", **{k: v for k, v in kw.items() if k != "device"}).latents
    peaks = {}
    for mode in MODES:
        res, peaks[mode] = peak_bytes(gpu.device, lambda m=mode: kc.generate(*held, memory=m, **kw))
        _assert_same(gpu, parity, f"full 4B memory mode {mode}: latents", res.latents, want)
        parity(tag(gpu, f"full 4B memory mode {mode}: peak GiB above start"), peaks[mode] / 1024**3)
        for stage, seconds in res.timings.items():
            parity(tag(gpu, f"full 4B memory mode {mode}: {stage} seconds"), seconds)
    slack = 1.05
    assert peaks["minimum"] <= peaks["blocks"] * slack, peaks
    assert peaks["blocks"] <= peaks["swap"] * slack, peaks
    assert peaks["swap"] <= peaks["resident"] * slack, peaks
    # minimum streams the text encoder's layers too: embeddings, non-block weights and two blocks of
    # each model stay (about 2 GiB) against 7.2 GiB of transformer weights for the resident stages
    assert peaks["minimum"] < 0.5 * peaks["resident"], peaks


@pytest.mark.parametrize("mode", ["blocks", "minimum"])
def test_streaming_leaves_a_device_resident_model_on_the_device(gpu, mode):
    """Components already on the device, run in a streaming mode: afterwards every tensor is back on
    the device (the offloader's CPU staging copies must not become the model's weights)."""
    comps = load_small(gpu)
    kc.generate(*comps, prompt="x", width=gpu.size, height=gpu.size, steps=2, seed=1, cache=None, memory=mode,
                output="latent")
    for m in comps[:2]:
        wrong = [n for n, t in m.state_dict().items() if t.device.type != gpu.device.type]
        assert not wrong, f"{type(m).__name__} left on another device after {mode}: {wrong[:4]}"


def test_kv_reference_mode_streamed(gpu, parity):
    """KV mode (Klein 9B-KV) computes the references' keys/values in their own pass through the
    blocks: streamed blocks must serve that pass too and give the resident latents."""
    on_device = load_small(gpu, source="flux-2-klein-9b-kv.safetensors")
    held = load_small(gpu, device="cpu", source="flux-2-klein-9b-kv.safetensors")
    for m in held:
        pin_memory_(m)
    refs = reference_images(gpu.ref_sizes)
    kw = {"prompt": "make it night", "references": refs, "steps": 3, "seed": 2, "cache": None, "kv_cache": None}
    want = kc.generate(*on_device, memory="resident", **kw)
    assert kc.Engine(*on_device).ref_mode == "kv"
    for mode in ("blocks", "minimum"):
        got = kc.generate(*held, memory=mode, device=gpu.device, **kw)
        _assert_same(gpu, parity, f"KV mode, memory {mode}: latents", got.latents, want.latents)
