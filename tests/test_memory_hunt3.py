"""Hunt (third round) in the page-locked packing (klein_core.memory.pinned), the machine's memory
(klein_core.memory.host) and the threaded reads (klein_core.files.staging).

Each test says whether it was a bug (fixed with it) or covers an edge case no other test covers.
Only OS facts are stood in (/proc and /sys trees, os.preadv results), and page-locked memory by
tests/test_pinned.py's StandIn (it records the chunks' allocations).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_pinned import StandIn
from test_staging import small_pieces  # noqa: F401 - parallel reads from 64 KiB up, 16 KiB pieces
from torch import nn

from klein_core.errors import WeightFormatError
from klein_core.files import staging
from klein_core.files.safetensors import open_safetensors
from klein_core.memory import host, pinned
from klein_core.memory.placement import pin_memory_

GB = 10**9
MEMINFO = "MemTotal:       65536000 kB\nMemFree:         100000 kB\nMemAvailable:   20000000 kB\nSwapFree:        4000000 kB\n"


def _tree(tmp_path, cgroup: str, files: dict[str, str], meminfo: str = MEMINFO):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(meminfo)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    (tmp_path / "sys" / "fs" / "cgroup").mkdir(parents=True)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def _bytes_file(tmp_path, n: int, seed: int = 0):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


# --------------------------------------------------------------------------------------------------
# pinned.py / placement.pin_memory_
# --------------------------------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as an LM head and its embedding often are


def test_tied_weights_are_page_locked_once_and_stay_tied(monkeypatch):
    """Was a bug. A parameter shared by two modules is one tensor; ``module.to()`` keeps it shared.
    pin_memory_ gets it twice from ``_slots`` (one slot per owner), pin_tensors packs two copies
    (twice the page-locked bytes, twice the budget) and ``_set`` gives each owner its own
    Parameter: the tie is broken (a later in-place update of one no longer reaches the other)."""
    m = Tied()
    want = m.embed.weight.detach().clone()
    stand_in = StandIn(monkeypatch, chunk=1 << 16)
    pin_memory_(m)
    assert torch.equal(m.embed.weight, want) and torch.equal(m.head.weight, want)
    locked = sum(c.nbytes for c in stand_in.chunks)
    assert locked == pinned.next_pow2(want.nbytes), f"locked {locked} bytes for one {want.nbytes}-byte weight"
    assert m.head.weight is m.embed.weight


def test_a_tied_weight_is_copied_once_for_a_stage_and_stays_tied():
    """Every placement walks one slot per tensor (``_slots``): a stage on another device copies a
    tied weight once, both owners hold that one copy inside the stage, and the original after."""
    from klein_core.memory.placement import on_device

    m = Tied()
    original = m.embed.weight
    with on_device(m, "meta"):
        assert m.head.weight is m.embed.weight and m.embed.weight.device.type == "meta"
    assert m.head.weight is m.embed.weight
    assert m.embed.weight.data_ptr() == original.data_ptr()


def test_a_weight_a_block_shares_with_a_module_outside_the_blocks_is_on_the_device_while_streaming():
    """A head tied to the first block's weight: while the blocks stream, the head (outside the
    blocks) has the weight on the device like the other non-block weights, and every weight is the
    original tensor's values at home again afterwards."""
    from klein_core.memory.placement import BlockOffloader

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 8)
            self.head.weight = self.blocks[0].weight

    m = Model()
    want = m.head.weight.detach().clone()
    with BlockOffloader(m, "meta", blocks=[m.blocks]):
        assert m.head.weight.device.type == "meta" and m.head.bias.device.type == "meta"
    assert all(t.device.type == "cpu" for t in m.state_dict().values())
    assert torch.equal(m.head.weight, want) and torch.equal(m.blocks[0].weight, want)


def test_a_non_dense_view_is_counted_at_what_pinning_it_locks(monkeypatch):
    """Was a bug. A strided tensor is pinned alone by ``t.pin_memory()``, which allocates (torch's
    ``_pin_memory``) ``computeStorageNbytes(sizes, strides)``: for a view with gaps (a column slice
    of a larger weight) the whole span, here 252 KiB for 2 KiB of values. pin_tensors counts and
    checks against the budget ``next_pow2(t.nbytes)`` (2 KiB): a 4 KiB budget lets 256 KiB be
    locked, and the report says 2048 bytes are locked."""
    t = torch.randn(64, 1024)[:, :8]
    assert not t.is_contiguous() and t.nbytes == 2048
    StandIn(monkeypatch)
    tensors = [t]
    report = pinned.pin_tensors(tensors, budget=4096)
    copy = tensors[0]
    assert torch.equal(copy, t)
    held = copy.untyped_storage().nbytes()
    assert report.locked >= held, f"reported {report.locked} bytes locked, the copy holds {held}"


def test_an_expanded_buffer_is_not_taken_for_the_system_refusing(monkeypatch, caplog):
    """Was a bug. A broadcast (expanded, stride 0 along a dimension of size > 1) buffer, such as
    ``torch.arange(n).expand(heads, -1)``, is not contiguous so it goes to ``t.pin_memory()``, which
    (torch's ``_pin_memory``) allocates a storage with the same strides and ``copy_``s into it: a
    stride-0 destination raises RuntimeError ("more than one element of the written-to tensor
    refers to a single memory location"). pin_tensors takes that for "the system refused to lock
    more": every strided tensor after it (a channels-last conv weight) stays unpinned, and the
    once-per-process warning is spent on a false refusal (a real one later is never said)."""

    class WithPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("position_ids", torch.arange(64).expand(4, -1), persistent=False)
            self.conv = nn.Conv2d(8, 16, 3)
            self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)

    m = WithPositions()
    stand_in = StandIn(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="klein_core.memory.pinned"):
        pin_memory_(m)
    said = [r.getMessage() for r in caplog.records if "ordinary CPU memory" in r.getMessage()]
    assert not any("refused" in s for s in said), said
    assert stand_in.holds(m.conv.weight)
    assert torch.equal(m.position_ids, torch.arange(64).expand(4, -1))


def test_smaller_chunks_that_fit_are_pinned_after_a_larger_one_that_does_not(monkeypatch):
    """Was a bug. pin_tensors stops at the first chunk over the budget, and the first chunk is the largest
    (a tensor above CHUNK_BYTES gets its own, rounded up to a power of two: 4B's Qwen3
    ``embed_tokens``, 778 MB, takes 1 GiB). With a budget that holds the other tensors' chunk but
    not that one, nothing is pinned at all, though the docstring leaves in ordinary memory only what
    is beyond the budget."""
    stand_in = StandIn(monkeypatch)  # chunks of 16 KiB
    big = torch.randn(5000)  # 20000 bytes: a chunk of its own, 32 KiB
    small = [torch.randn(250) for _ in range(10)]  # 10 x 1 KiB (aligned): one 16 KiB chunk
    tensors = [big, *small]
    report = pinned.pin_tensors(tensors, budget=16 << 10)
    assert report.locked <= 16 << 10
    assert all(stand_in.holds(t) for t in tensors[1:]), report


def test_every_dtype_and_a_scalar_keep_their_bits_when_packed(monkeypatch):
    """Edge case (not covered: tests/test_pinned.py packs float32 models only). Packed copies of
    1-, 2-, 4-, 8- and 16-byte dtypes, float8/float4 storage dtypes, a 0-dim tensor, a conjugate view
    and a negative view are views of a chunk at 512-byte offsets holding the original bits."""
    dtypes = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64,
              torch.bfloat16, torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]
    g = torch.Generator().manual_seed(0)
    raw = [torch.randint(0, 256, (37 * d.itemsize,), dtype=torch.uint8, generator=g) for d in dtypes]
    tensors = [r.view(d) if d != torch.bool else (r % 2).view(torch.bool) for r, d in zip(raw, dtypes)]
    tensors += [torch.tensor(3.5), torch.randn(3, 4, dtype=torch.complex64, generator=g).conj(),
                torch.randn(3, generator=g)._neg_view(), torch.randn(5000, generator=g)]
    want = [t.resolve_conj().resolve_neg().clone() for t in tensors]
    stand_in = StandIn(monkeypatch, chunk=1 << 12)
    report = pinned.pin_tensors(tensors)
    assert report.left == 0 and report.pinned == sum(t.nbytes for t in want)
    for got, w in zip(tensors, want):
        assert stand_in.holds(got) and got.dtype == w.dtype and got.shape == w.shape
        assert got.storage_offset() * got.itemsize % pinned.ALIGN == 0  # its offset in its chunk
        assert torch.equal(got.view(torch.uint8) if got.dim() else got.reshape(1).view(torch.uint8),
                           w.view(torch.uint8) if w.dim() else w.reshape(1).view(torch.uint8))


def test_views_of_one_storage_are_packed_apart_with_their_own_values(monkeypatch):
    """Edge case (not covered: the other tests pin separate tensors). A fused weight split into
    views (nonzero storage offsets into one storage) and a view of its tail: each copy is its own
    region of a chunk, no two overlap, each holds its view's values, and none is the old storage."""
    fused = torch.randn(3 * 64 + 5, 64)
    q, k, v = fused[:192].split(64)
    tail = fused[190:]
    tensors = [q, k, v, tail]
    want = [t.clone() for t in tensors]
    stand_in = StandIn(monkeypatch, chunk=1 << 16)
    report = pinned.pin_tensors(tensors)
    assert report.pinned == sum(t.nbytes for t in want) and report.left == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    assert all(stand_in.holds(t) and torch.equal(t, w) for t, w in zip(tensors, want))
    assert all(t.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr() for t in tensors)


def test_the_bound_counts_the_hosts_locked_memory_and_never_goes_negative(monkeypatch):
    """Edge case (test_pinned covers the shares, not ``other_locked`` nor the clamp). ComfyUI's
    own page-locked bytes come off the bound; more locked than the bound gives 0, never a negative
    budget; a machine under 4 GiB keeps 40 %."""
    gib = 1 << 30
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(pinned, "_locked_now", lambda: 0)
    monkeypatch.setattr(pinned, "other_locked", lambda: 5 * gib)
    assert pinned.pin_budget(32 * gib) == 23 * gib
    monkeypatch.setattr(pinned, "other_locked", lambda: 40 * gib)
    assert pinned.pin_budget(32 * gib) == 0
    monkeypatch.setattr(pinned, "other_locked", None)
    assert pinned.pin_budget(2 * gib) == int(0.4 * 2 * gib)


# --------------------------------------------------------------------------------------------------
# host.py
# --------------------------------------------------------------------------------------------------

V2 = "sys/fs/cgroup/"


def test_ram_available_is_bounded_by_a_tighter_parent_cgroup(tmp_path):
    """Was a bug. _cgroup_room takes the nearest cgroup with a limit and stops there. A parent slice of
    16 GB whose other members use 12 GB leaves this process 2 GB, though its own cgroup (limit 12 GB,
    2 GB used) has 10 GB of room: the kernel reclaims or OOM-kills at the parent's limit.
    ram_available says 10 GB (so shortfall says nothing before an 8 GB load), while ram_total
    already takes the lowest limit of all ancestors."""
    root = _tree(tmp_path, "0::/user.slice/app.scope\n", {
        V2 + "user.slice/memory.max": "16000000000\n", V2 + "user.slice/memory.current": "14000000000\n",
        V2 + "user.slice/app.scope/memory.max": "12000000000\n",
        V2 + "user.slice/app.scope/memory.current": "2000000000\n"})
    assert host.ram_total(root) == 12_000_000_000
    available, _ = host.ram_available(root)
    assert available == 2_000_000_000, available
    assert host.shortfall(8 * GB, root) is not None


def test_ram_available_is_bounded_by_a_parent_cgroups_swap(tmp_path):
    """Was a bug (the same root cause as above). The swap bound is read only in the nearest cgroup with a
    memory limit: a parent slice that may not swap (``memory.swap.max`` 0) under a child whose own
    swap bound is "max" leaves no swap, but ram_available gives the machine's SwapFree (4.1 GB)."""
    root = _tree(tmp_path, "0::/work.slice/app.scope\n", {
        V2 + "work.slice/memory.max": "16000000000\n", V2 + "work.slice/memory.current": "3000000000\n",
        V2 + "work.slice/memory.swap.max": "0\n", V2 + "work.slice/memory.swap.current": "0\n",
        V2 + "work.slice/app.scope/memory.max": "12000000000\n",
        V2 + "work.slice/app.scope/memory.current": "2000000000\n",
        V2 + "work.slice/app.scope/memory.swap.max": "max\n"})
    assert host.ram_available(root) == (10_000_000_000, 0)


def test_ram_available_v1_counts_a_container_without_swap(tmp_path):
    """Was a bug. A cgroup v1 container given no swap (``docker run --memory 4g --memory-swap 4g``:
    ``memory.memsw.limit_in_bytes`` equal to ``memory.limit_in_bytes``) may not swap, but
    ram_available gives the machine's SwapFree (4.1 GB) as its swap, so shortfall says "the system
    will swap (slowly)" for a load the kernel will end the process over."""
    d = "sys/fs/cgroup/memory/docker/x/"
    root = _tree(tmp_path, "9:memory:/docker/x\n", {
        d + "memory.limit_in_bytes": "4000000000\n", d + "memory.usage_in_bytes": "3000000000\n",
        d + "memory.memsw.limit_in_bytes": "4000000000\n", d + "memory.memsw.usage_in_bytes": "3000000000\n",
        d + "memory.stat": "total_inactive_file 0\n"})
    assert host.ram_available(root) == (1_000_000_000, 0)
    assert "out-of-memory killer" in host.shortfall(2 * GB, root)


def test_v1_unlimited_child_uses_its_limited_parent(tmp_path):
    """Edge case (test_host_memory covers v1 with the limit on the process's own cgroup only).
    v1's "no limit" (about 2**63) on the process's cgroup, a real limit on its parent: the parent's
    limit, usage and reclaimable cache give the room."""
    p = "sys/fs/cgroup/memory/docker/"
    root = _tree(tmp_path, "9:memory:/docker/x\n", {
        p + "x/memory.limit_in_bytes": "9223372036854771712\n", p + "x/memory.usage_in_bytes": "100\n",
        p + "memory.limit_in_bytes": "4000000000\n", p + "memory.usage_in_bytes": "3500000000\n",
        p + "memory.stat": "total_inactive_file 500000000\n"})
    assert host.ram_total(root) == 4_000_000_000
    assert host.ram_available(root) == (1_000_000_000, 4_000_000 * 1024)


# --------------------------------------------------------------------------------------------------
# staging.py
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EPERM], ids=["ENOSYS", "EPERM"])
def test_a_system_that_refuses_nonwaiting_reads_still_reads(tmp_path, monkeypatch, small_pieces, err):  # noqa: F811
    """Was a bug. Where preadv2 itself is refused (a seccomp profile without it, as older container
    runtimes have: EPERM; a kernel or sandbox without the call: ENOSYS), every read of 64 MiB or
    more fails ("cannot read tensor") though plain reads work: _read_pieces falls back only for
    EOPNOTSUPP and EINVAL. A failed non-waiting read loses nothing by falling back to the ordered
    reads (a real I/O error is raised there)."""
    path, data = _bytes_file(tmp_path, 200_000)
    real = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if flags:
            raise OSError(err, os.strerror(err))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    out = torch.empty(200_000, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as fh:
        assert staging.read_full(fh, memoryview(out.numpy())) == 200_000
    assert torch.equal(out, data)


def test_read_full_fills_a_view_of_wider_items(tmp_path, monkeypatch, small_pieces):  # noqa: F811
    """Was a bug (public helper; the project's own callers pass uint8 views). read_full's threaded path
    sizes and offsets pieces with ``len(view)``, which counts items, not bytes: a float32 view of
    400 KB is read as 100 000 bytes at the wrong offsets and the count says 100 000. The sequential
    path (below PARALLEL_BYTES) fills it whole and returns 400 000."""
    path, data = _bytes_file(tmp_path, 400_000, seed=3)
    out = np.zeros(100_000, dtype=np.float32)
    with open(path, "rb", buffering=0) as fh:
        n = staging.read_full(fh, memoryview(out))
    assert n == 400_000
    assert torch.equal(torch.from_numpy(out.view(np.uint8)), data)


def test_short_and_refused_nonwaiting_reads_give_the_file_bytes(tmp_path, monkeypatch, small_pieces):  # noqa: F811
    """Edge case (test_staging drives the real page cache only). preadv returning fewer bytes than
    asked, with and without RWF_NOWAIT, and EAGAIN part way through a piece: every byte lands once,
    in place, and the count and position are right."""
    path, data = _bytes_file(tmp_path, 300_001, seed=4)
    real = os.preadv
    calls = {"n": 0}

    def preadv(fd, buffers, offset, flags=0):
        calls["n"] += 1
        (buf,) = buffers
        if flags and calls["n"] % 5 == 0:
            raise BlockingIOError(errno.EAGAIN, "not cached")
        short = memoryview(buf)[: max(1, len(buf) // 3 + 7)]
        return real(fd, [short], offset, flags) if flags else real(fd, [short], offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(1)
        out = torch.zeros(300_000, dtype=torch.uint8)
        assert staging.read_full(fh, memoryview(out.numpy())) == 300_000 and fh.tell() == 300_001
    assert torch.equal(out, data[1:])


def test_an_io_error_in_a_read_thread_reaches_the_caller(tmp_path, monkeypatch, small_pieces):  # noqa: F811
    """Edge case (not covered). An I/O error is not swallowed: a failing non-waiting read in a pool
    thread leaves that piece to the ordered read, whose error read_full raises, and
    SafetensorsFile.read names the file and tensor."""
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(100_000)}, str(path))
    f = open_safetensors(path)
    real = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if offset > f.header_bytes + 8 + 100_000:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, flags) if flags else real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(WeightFormatError, match="cannot read tensor 'w'.*Input/output error"):
        f.read("w")


def test_a_read_across_the_4_gib_offset(tmp_path, small_pieces):  # noqa: F811
    """Edge case (not covered). A threaded read starting just below 4 GiB in a (sparse) file and
    ending past it: the offsets stay 64-bit, the bytes are the file's."""
    path = tmp_path / "sparse.bin"
    base = (1 << 32) - 100_000
    data = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    try:
        with open(path, "wb") as fh:
            fh.seek(base)
            fh.write(data.numpy().tobytes())
    except OSError:
        pytest.skip("no sparse files here")
    with open(path, "rb", buffering=0) as fh:
        fh.seek(base - 1000)
        out = torch.empty(201_000, dtype=torch.uint8)
        assert staging.read_full(fh, memoryview(out.numpy())) == 201_000 and fh.tell() == base + 200_000
    assert not out[:1000].any() and torch.equal(out[1000:], data)
