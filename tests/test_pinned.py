"""Page-locked homes for offloaded weights (klein_core.memory.pinned), on the CPU.

The CPU cannot page-lock memory, so a stand-in records each "page-locked" allocation torch would
make (ordinary memory, the same sizes) and reports the tensors inside one as pinned. What is checked:
the packing (every tensor inside its chunk, none overlapping, chunks a power of two), that the
streamed model computes exactly as before from its packed homes, the bound on locked memory and a
refusal (the rest stays in ordinary memory, said once, the results the same), and the machine's
memory as Linux and a container's cgroup say it. The real allocations run in the GPU suite.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from klein_core import testing as demo
from klein_core.memory import host, pinned, placement
from klein_core.memory import placement as placement_mod
from klein_core.memory.pinned import ALIGN, CHUNK_BYTES, next_pow2, pin_budget, plan_chunks
from klein_core.memory.placement import BlockOffloader, find_block_lists, pin_memory_
from klein_core.models.transformer import Flux2Transformer
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.testing.fill import full_size_configs


def _block_sizes(variant) -> list[int]:
    with torch.device("meta"):
        model = Flux2Transformer(full_size_configs(variant)[0]).to(torch.bfloat16)
    return [t.nbytes for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()]]


@pytest.mark.parametrize("variant, weights, one_by_one, packed", [
    (KLEIN_4B, 7020, 10560, 7168), (KLEIN_9B, 16640, 24064, 16896)], ids=["4B", "9B"])
def test_packing_locks_little_more_than_the_weights(variant, weights, one_by_one, packed, parity):
    """The figures of klein_core.memory.pinned's docstring, from the real block shapes (bf16): pinned
    one by one, torch's allocator rounds each weight up to a power of two; packed, the chunks hold
    them with little room to spare."""
    sizes = _block_sizes(variant)
    mib = 1 << 20
    assert round(sum(sizes) / mib) == weights  # (and a few norm weights of 256 bytes)
    assert round(sum(next_pow2(s) for s in sizes) / mib) == one_by_one
    assert sum(size for size, _ in plan_chunks(sizes)) == packed * mib
    parity(f"pinned {variant.name} blocks: locked / weights, packed", packed / weights)


@pytest.mark.parametrize("sizes", [[3, 1000, 70000, 5], [CHUNK_BYTES + 1, 10, CHUNK_BYTES // 2, CHUNK_BYTES // 2],
                                   [256] * 300, []])
def test_chunks_hold_every_tensor_apart(sizes):
    chunk = 1 << 16  # small chunks, so that these sizes fill several
    plan = plan_chunks(sizes, chunk=chunk)
    placed = sorted(i for _, items in plan for i, _ in items)
    assert placed == list(range(len(sizes)))
    for size, items in plan:
        assert size & (size - 1) == 0  # a power of two: torch's allocator rounds nothing up
        spans = sorted((off, off + sizes[i]) for i, off in items)
        assert all(off % ALIGN == 0 and end <= size for off, end in spans)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        assert size <= chunk or len(items) == 1  # only a tensor larger than a chunk has one of its own
    with pytest.raises(ValueError, match="power of two"):
        plan_chunks(sizes, chunk=3000)


class StandIn:
    """Stands in for page-locked memory on the CPU: records the allocations and says which tensors
    lie in one (torch.Tensor.is_pinned); ``refuse_after`` allocations, it refuses as CUDA would."""

    def __init__(self, monkeypatch, refuse_after: int | None = None, budget: int | None = None,
                 chunk: int = 1 << 14) -> None:
        self.chunks: list[torch.Tensor] = []
        self.refuse_after = refuse_after
        monkeypatch.setattr(placement, "_pinnable", lambda: True)
        monkeypatch.setattr(pinned, "CHUNK_BYTES", chunk)  # small chunks: a tiny model fills several
        monkeypatch.setattr(pinned, "_page_locked", self._allocate)
        # the bound less what is locked already, as torch's allocator statistics give it
        self.budget_asked = 0

        def bound(total=None):
            self.budget_asked += 1
            return None if budget is None else max(0, budget - sum(c.nbytes for c in self.chunks))

        monkeypatch.setattr(pinned, "pin_budget", bound)
        monkeypatch.setattr(pinned, "_left_said", False)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: self.holds(t))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.refuse_after is not None and len(self.chunks) >= self.refuse_after:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported asynchronously")
        self.chunks.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.chunks[-1]

    def holds(self, t: torch.Tensor) -> bool:
        p = t.untyped_storage().data_ptr()
        return any(c.data_ptr() <= p < c.data_ptr() + c.nbytes for c in self.chunks)


def _inputs(cfg):
    from klein_core.pipeline.sampling import position_ids, text_position_ids

    g = torch.Generator().manual_seed(0)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    return {"img": torch.randn(1, ids.shape[0], cfg.in_channels, generator=g), "img_ids": ids,
                "txt": torch.randn(1, 5, cfg.context_dim, generator=g), "txt_ids": text_position_ids(5),
                "timesteps": torch.tensor([0.5])}


def _stream(model, inputs):
    with torch.no_grad(), BlockOffloader(model, "cpu", prefetch=1):
        return model(**inputs)


def test_streamed_blocks_live_in_packed_page_locked_chunks(monkeypatch):
    model = demo.tiny_transformer(demo.TinySpec(depth=2, depth_single=3), seed=4)
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = model(**inputs)
    stand_in = StandIn(monkeypatch)
    assert torch.equal(_stream(model, inputs), want)
    blocks = [t for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()]]
    assert blocks and all(stand_in.holds(t) for t in blocks)  # every block weight's home is in a chunk
    assert len(stand_in.chunks) == len(plan_chunks([t.nbytes for t in blocks if t.numel()]))
    assert not stand_in.holds(model.img_in.weight)  # not a block: stays where it was
    n = len(stand_in.chunks)
    assert torch.equal(_stream(model, inputs), want)  # the next run keeps those homes, locks nothing more
    assert len(stand_in.chunks) == n
    assert stand_in.budget_asked == 1  # the bound (files in /proc, torch's statistics) asked at the first only


@pytest.mark.parametrize("refuse", [True, False], ids=["refused", "over the budget"])
def test_what_cannot_be_locked_stays_in_ordinary_memory(monkeypatch, caplog, refuse):
    """Locking refused by the system (as CUDA refuses when little memory is free, or Windows past
    about half of it), or the bound reached: the other weights stay where they are, one warning
    says so and why, and the model streams exactly as before, run after run."""
    model = demo.tiny_transformer(demo.TinySpec(depth=2, depth_single=3), seed=4)
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = model(**inputs)
    sizes = [t.nbytes for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()]]
    first = plan_chunks(sizes, chunk=1 << 14)[0][0]
    # refused after the first allocation, or a bound that holds the first chunk only
    stand_in = StandIn(monkeypatch, refuse_after=1 if refuse else None, budget=None if refuse else first)
    with caplog.at_level(logging.WARNING, logger="klein_core.memory.pinned"):
        for _ in range(2):
            assert torch.equal(_stream(model, inputs), want)
    blocks = [t for lst in find_block_lists(model) for b in lst for t in b.parameters()]
    held = [stand_in.holds(t) for t in blocks]
    assert any(held) and not all(held)
    assert [c.nbytes for c in stand_in.chunks] == [first]
    said = [r.getMessage() for r in caplog.records if "ordinary CPU memory" in r.getMessage()]
    assert len(said) == 1, said
    assert ("refused" in said[0]) == refuse and "slower" in said[0]


def test_pin_memory_packs_a_whole_component_and_keeps_strided_weights_strided(monkeypatch):
    vae = demo.tiny_vae(seed=2)
    conv = vae.decoder.conv_in
    conv.weight.data = conv.weight.data.to(memory_format=torch.channels_last)
    state = {k: v.clone() for k, v in vae.state_dict().items()}
    stand_in = StandIn(monkeypatch)
    pin_memory_(vae)
    assert all(stand_in.holds(t) for t in vae.state_dict().values() if t.numel())
    assert all(torch.equal(v, state[k]) for k, v in vae.state_dict().items())
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # packed with its strides


def test_the_bound_follows_the_machine(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(pinned, "_locked_now", lambda: 0)
    monkeypatch.setattr(sys, "platform", "linux")
    assert pin_budget(64 * gib) == int(0.9 * 64 * gib)  # 90 %
    assert pin_budget(32 * gib) == 28 * gib  # 4 GiB left free
    assert pin_budget(6 * gib) == int(0.4 * 6 * gib)  # at least 40 %
    monkeypatch.setattr(pinned, "_locked_now", lambda: 10 * gib)  # what torch holds locked already counts
    assert pin_budget(32 * gib) == 18 * gib
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(pinned, "_locked_now", lambda: 0)
    assert pin_budget(32 * gib) == int(0.4 * 32 * gib)
    monkeypatch.setattr(pinned, "ram_total", lambda: None)
    assert pin_budget() is None  # unknown: no bound


def _tree(tmp_path, cgroup: str, files: dict[str, str]):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       65536000 kB\nMemFree:        1000 kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


@pytest.mark.parametrize("cgroup, files, want", [
    ("0::/\n", {}, 65536000 * 1024),  # no limit file: the machine's memory
    ("0::/\n", {"sys/fs/cgroup/memory.max": "max\n"}, 65536000 * 1024),
    ("0::/\n", {"sys/fs/cgroup/memory.max": "17179869184\n"}, 16 << 30),  # a container's 16 GiB
    ("0::/user.slice/app.scope\n", {"sys/fs/cgroup/user.slice/memory.max": "8589934592\n",
                                     "sys/fs/cgroup/user.slice/app.scope/memory.max": "max\n"}, 8 << 30),
    ("12:cpu,cpuacct:/docker/x\n7:memory:/docker/x\n",
     {"sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes": "4294967296\n"}, 4 << 30),  # cgroup v1
    ("7:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}, 65536000 * 1024),
], ids=["v2 none", "v2 max", "v2 container", "v2 parent", "v1", "v1 unlimited"])
def test_ram_total_reads_the_machine_and_its_cgroup(tmp_path, cgroup, files, want):
    assert host.ram_total(_tree(tmp_path, cgroup, files)) == want


def test_ram_total_here_is_the_machine_or_less():
    """On this machine: its physical memory as the C library counts it, or a cgroup's lower limit."""
    total = host.ram_total()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert total is not None and 0 < total <= physical
    assert total == physical or host._cgroup_limit(Path("/")) == total


@pytest.mark.parametrize("placement", ["staged", "resident"])
def test_a_component_copied_in_per_stage_is_page_locked_first(monkeypatch, placement):
    """On CUDA a component held on the CPU and copied in for its stage (swap; resident elsewhere) has
    its CPU tensors page-locked before the copy, once, in place (the values unchanged); the copy
    itself is on_device's (stood in here: the CPU cannot copy to CUDA)."""
    vae = demo.tiny_vae(seed=3)
    state = {k: v.clone() for k, v in vae.state_dict().items()}
    stand_in = StandIn(monkeypatch)
    seen = []

    @contextlib.contextmanager
    def copied_in(module, device, **kw):
        seen.append((device, all(stand_in.holds(t) for t in module.state_dict().values() if t.numel())))
        yield module

    monkeypatch.setattr(placement_mod, "on_device", copied_in)
    placer = placement_mod.StagePlacer(torch.device("cuda", 0), {"vae": vae}, {"vae": placement})
    for _ in range(2):
        with placer.stage("vae") as m:
            assert m is vae
    assert seen == [(torch.device("cuda", 0), True)] * 2
    n = len(stand_in.chunks)
    assert n and all(torch.equal(v, state[k]) for k, v in vae.state_dict().items())
    with placer.stage("vae"):
        pass
    assert len(stand_in.chunks) == n  # page-locked once
    cpu = placement_mod.StagePlacer(torch.device("cpu"), {"vae": demo.tiny_vae(seed=3)}, {"vae": placement})
    with cpu.stage("vae"):
        pass
    assert len(stand_in.chunks) == n  # on the CPU nothing is


def test_release_cached_asks_torch_where_it_can(monkeypatch):
    """A dropped model's page-locked chunks stay locked in torch's cache until it is emptied: the
    public call where torch has it, the older private one otherwise, nothing without CUDA in use."""
    calls = []
    assert not pinned.release_cached()  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("accelerator"), raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False)
    assert pinned.release_cached() and calls == ["accelerator"]
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", None)
    assert pinned.release_cached() and calls == ["accelerator", "private"]
    monkeypatch.setattr(torch._C, "_host_emptyCache", None)
    assert not pinned.release_cached()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CUDA never used: nothing to give back
    assert not pinned.release_cached()


def test_each_original_is_freed_before_the_next_chunk_is_made(monkeypatch):
    """Packing a model's blocks never holds them twice: each weight replaced as soon as it is
    copied, the originals of one chunk are gone before the next chunk is allocated (at the end,
    all of them), so streaming 9B's 17 GB of blocks does not need 34 GB of RAM on the way."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = demo.tiny_transformer(demo.TinySpec(depth=2, depth_single=3), seed=4)
    originals = [(StorageWeakRef(t.untyped_storage()), t.nbytes)
                 for lst in find_block_lists(model) for b in lst for t in [*b.parameters(), *b.buffers()] if t.numel()]
    alive_at_allocation = []
    stand_in = StandIn(monkeypatch)
    allocate = stand_in._allocate

    def counting(nbytes):
        alive_at_allocation.append(sum(n for ref, n in originals if not ref.expired()))
        return allocate(nbytes)

    monkeypatch.setattr(pinned, "_page_locked", counting)
    BlockOffloader(model, "cpu").attach().detach()
    assert len(alive_at_allocation) > 2
    assert all(a > b for a, b in itertools.pairwise(alive_at_allocation))
    assert not any(not ref.expired() for ref, _ in originals)


def test_a_lora_copy_of_a_page_locked_model_locks_only_its_factors(monkeypatch):
    """The nodes page-lock a CPU-homed transformer when they load it; a LoRA'd copy (with_loras,
    Klein LoRA Loader) shares its tensors, so streaming the copy locks only the LoRA factors,
    not a second copy of the weights (as it did when the base was left to its first stage)."""
    from test_lora_memory_hunt import _lora

    from klein_core.lora import with_loras

    base = demo.tiny_transformer(demo.TinySpec(depth=2, depth_single=3), seed=4)
    inputs = _inputs(base.config)
    stand_in = StandIn(monkeypatch)
    pin_memory_(base)
    before = sum(c.nbytes for c in stand_in.chunks)
    lora = _lora(base)
    copy = with_loras(base, [(lora, 0.5)])
    with torch.no_grad():
        want = copy(**inputs)
    assert torch.equal(_stream(copy, inputs), want)
    weights = [t for lst in find_block_lists(copy) for b in lst for t in b.parameters()]
    assert weights and all(stand_in.holds(t) for t in weights)  # the base's page-locked tensors
    factors = {id(t) for lst in find_block_lists(copy) for b in lst for t in b.buffers()} - \
        {id(t) for lst in find_block_lists(base) for b in lst for t in b.buffers()}
    grew = sum(c.nbytes for c in stand_in.chunks) - before
    assert grew <= sum(next_pow2(max(1, t.nbytes)) for lst in find_block_lists(copy) for b in lst
                       for t in b.buffers() if id(t) in factors), grew  # at most the LoRA's own tensors
