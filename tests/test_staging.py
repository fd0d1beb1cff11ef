"""Device loads read through page-locked slots (klein_core.files.staging), on the CPU.

The stager's CUDA parts (page-locked slots, copies queued without waiting, an event per slot) run
on a GPU only (tests/gpu/test_gpu_pipeline.py::test_device_loads_equal_the_cpu_load); here the CPU
stands in for the device, with slots small enough that every tensor crosses several of them at odd
offsets, so the slicing and the order of the reads are checked byte for byte. A stand-in device
whose copies run only when waited for (:class:`LateCopies`) checks the waits: no slot is read into
again while its copy may still be queued.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

import klein_core as kc
from klein_core import testing as demo
from klein_core.errors import WeightFormatError
from klein_core.files import materialize as materialize_mod
from klein_core.files import staging
from klein_core.files.safetensors import open_safetensors
from klein_core.files.staging import DeviceStager, reading_through


def _file(tmp_path, seed: int = 0):
    path = tmp_path / "flux-2-klein-4b.safetensors"
    save_file({k: v.contiguous() for k, v in demo.tiny_transformer(seed=seed).state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize("slot_bytes, slots", [(1000, 2), (4096, 1), (1 << 20, 3)])
def test_reads_through_slots_give_the_stored_bytes(tmp_path, slot_bytes, slots):
    path = _file(tmp_path)
    f = open_safetensors(path)
    stager = DeviceStager(torch.device("cpu"), slot_bytes=slot_bytes, slots=slots)
    total = 0
    for key, info in f.tensors.items():
        plain = f.read(key)
        with reading_through(stager):
            staged = f.read(key)
        assert staged.dtype == plain.dtype and staged.shape == plain.shape, key
        assert torch.equal(staged.view(torch.uint8) if staged.numel() else staged,
                           plain.view(torch.uint8) if plain.numel() else plain), key
        total += info.nbytes
    stager.finish()
    assert stager.bytes_read == total
    with reading_through(None):  # no stager: the ordinary read
        assert torch.equal(f.read("img_in.weight"), f.read("img_in.weight"))
    assert staging.active_stager() is None  # the block ended, also for the reads after it


def test_a_file_changed_after_opening_is_refused_through_the_stager_too(tmp_path):
    path = _file(tmp_path)
    f = open_safetensors(path)
    _file(tmp_path, seed=1)  # rewritten under the same name
    stager = DeviceStager(torch.device("cpu"), slot_bytes=1000)
    with reading_through(stager), pytest.raises(WeightFormatError, match="changed on disk"):
        f.read("img_in.weight")
    with pytest.raises(ValueError, match="positive"):
        DeviceStager(torch.device("cpu"), slot_bytes=0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 file", "fp8 file"])
def test_a_load_reads_its_plain_weights_through_the_stager(tmp_path, monkeypatch, fp8):
    """load_transformer reads every weight stored as-is through the stager the device gets (here a
    CPU one, forced), and the model equals the one read the ordinary way, tensor for tensor. From
    an fp8 file the fp8 weights' bytes go through it too (their scales and ComfyUI's markers are
    read the ordinary way)."""
    path = _file(tmp_path)
    quant_keys: set[str] = set()
    if fp8:
        from klein_core.files.fp8 import quantize_state_dict
        from klein_core.quant.fp8 import block_linear_names

        tiny = demo.tiny_transformer()
        q = quantize_state_dict({k: v.contiguous() for k, v in tiny.state_dict().items()},
                                block_linear_names(tiny), style="comfy_quant")
        quant_keys = {k for k in q if k.endswith(("weight_scale", "comfy_quant"))}
        assert any(v.dtype == torch.float8_e4m3fn for v in q.values()) and quant_keys
        save_file(q, str(path))
    stagers: list[DeviceStager] = []

    @contextlib.contextmanager
    def forced(device):
        stagers.append(DeviceStager(torch.device(device), slot_bytes=777, slots=2))
        try:
            yield stagers[-1]
        finally:
            stagers[-1].finish()

    plain = kc.load_transformer(path, device="cpu", dtype=torch.float32)
    monkeypatch.setattr(materialize_mod, "device_stager", forced)
    staged = kc.load_transformer(path, device="cpu", dtype=torch.float32)
    (stager,) = stagers
    assert stager.bytes_read == sum(i.nbytes for k, i in open_safetensors(path).tensors.items() if k not in quant_keys)
    a, b = plain.state_dict(), staged.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_only_cuda_loads_are_staged(monkeypatch, caplog):
    with staging.device_stager("cpu") as stager:
        assert stager is None
    with staging.device_stager("meta") as stager:
        assert stager is None

    def refused(*a, **k):
        raise RuntimeError("CUDA error: out of memory (page-locked)")

    monkeypatch.setattr(staging, "DeviceStager", refused)  # no page-locked memory to be had
    monkeypatch.setattr(staging, "_refused_said", False)
    for _ in range(3):  # ordinary reads then, said once
        with staging.device_stager(torch.device("cuda", 0)) as stager:
            assert stager is None
    said = [r for r in caplog.records if "ordinary memory" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    monkeypatch.setattr(staging, "STAGED_READS", False)
    with staging.device_stager(torch.device("cuda", 0)) as stager:  # turned off: not even built
        assert stager is None


def test_a_gguf_load_reads_its_blocks_through_the_stager(tmp_path, monkeypatch):
    """A GGUF transformer: its blocks kept packed and its float tensors go through the stager as
    bytes (every byte of the file's tensors), and the model equals the ordinary load."""
    pytest.importorskip("gguf")
    from gguf_files import write_tiny_gguf_transformer

    from klein_core.files.gguf import _scan
    from klein_core.quant.ggml import ggml_layers

    path = write_tiny_gguf_transformer(tmp_path / "flux-2-klein-4b-Q8_0.gguf", "Q8_0")
    stagers: list[DeviceStager] = []

    @contextlib.contextmanager
    def forced(device):
        stagers.append(DeviceStager(torch.device(device), slot_bytes=999, slots=2))
        yield stagers[-1]

    plain = kc.load_transformer(path, device="cpu")
    monkeypatch.setattr(materialize_mod, "device_stager", forced)
    staged = kc.load_transformer(path, device="cpu")
    assert ggml_layers(staged)
    assert stagers[0].bytes_read == sum(st.nbytes for st, _ in _scan(path)[0].values())
    a, b = plain.state_dict(), staged.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class LateCopies(DeviceStager):
    """A device whose copies run only when waited for, as a GPU's may run long after they are
    queued: a slot read into again before its copy has run would give that copy the new bytes."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        super().__init__(torch.device("cpu"), slot_bytes=slot_bytes, slots=slots)
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0  # the copies run so far, in the order queued (one stream)
        self.most_pending = 0

    def _queue_copy(self, dst, src):
        self.queued.append((dst, src))
        self.most_pending = max(self.most_pending, len(self.queued) - self.ran)
        return len(self.queued)  # waiting for it runs every copy queued up to it, as a CUDA event does

    def _wait(self, token):
        for dst, src in self.queued[self.ran:token]:
            dst.copy_(src)
        self.ran = max(self.ran, token)

    def _wait_all(self):
        LateCopies._wait(self, len(self.queued))


class RefillsEarly(LateCopies):
    """The bug the stager guards against (the control): never waits before reading into a slot."""

    def _wait(self, token):
        pass


@pytest.mark.parametrize("slot_bytes, slots", [(1000, 2), (4096, 1), (333, 3)])
def test_no_slot_is_refilled_before_its_copy_has_run(tmp_path, slot_bytes, slots):
    """With copies that run late (a GPU's), every tensor read through the stager still has the
    stored bytes once the stager has finished; the same reads that refill a slot without waiting
    (the control) give other bytes, so the check can fail."""
    f = open_safetensors(_file(tmp_path))
    big = [k for k, i in f.tensors.items() if i.nbytes > 2 * slot_bytes]
    assert big  # tensors spanning several slots: slots are reused within one tensor
    results = {}
    for cls in (LateCopies, RefillsEarly):
        stager = cls(slot_bytes, slots)
        with reading_through(stager):
            staged = {k: f.read(k) for k in f.tensors}
        assert stager.ran < len(stager.queued)  # copies still pending when the reads returned
        stager.finish()
        assert stager.ran == len(stager.queued) and stager.most_pending >= slots
        results[cls] = staged
    plain = {k: f.read(k) for k in f.tensors}
    same = {cls: [k for k in plain if torch.equal(r[k].view(torch.uint8), plain[k].view(torch.uint8))]
            for cls, r in results.items()}
    assert same[LateCopies] == list(plain)
    assert not set(big) <= set(same[RefillsEarly])


@pytest.fixture
def small_pieces(monkeypatch):
    """Parallel reads from 64 KiB up, in pieces of 16 KiB, so that tiny files take that path."""
    if not hasattr(os, "preadv") or not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no positioned reads without waiting here: reads are sequential")
    monkeypatch.setattr(staging, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(staging, "PIECE_BYTES", 1 << 14)
    monkeypatch.setattr(staging, "READ_THREADS", 4)


def test_parallel_reads_give_the_file_bytes_and_leave_the_position_after_them(tmp_path, small_pieces):
    data = torch.randint(0, 256, (300_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.numpy().tobytes())
    with open(path, "rb", buffering=0) as fh:
        fh.seek(1000)
        out = torch.empty(200_000, dtype=torch.uint8)
        assert staging.read_full(fh, memoryview(out.numpy())) == 200_000
        assert torch.equal(out, data[1000:201_000]) and fh.tell() == 201_000
        rest = torch.zeros(150_000, dtype=torch.uint8)  # past the end: what there is, then a short count
        assert staging.read_full(fh, memoryview(rest.numpy())) == 99_001
        assert torch.equal(rest[:99_001], data[201_000:]) and not rest[99_001:].any() and fh.tell() == 300_001


def test_a_load_through_parallel_reads_equals_the_sequential_one(tmp_path, monkeypatch, small_pieces):
    """Every tensor of a tiny model file, read with the parallel path where large enough (CPU load
    and through the stager): the same tensors as read sequentially."""
    path = _file(tmp_path)
    f = open_safetensors(path)
    big = [k for k, i in f.tensors.items() if i.nbytes >= 1 << 16]
    assert big
    calls = []
    real = staging._read_pieces
    monkeypatch.setattr(staging, "_read_pieces", lambda *a: calls.append(a[3]) or real(*a))
    stager = DeviceStager(torch.device("cpu"), slot_bytes=1 << 17)
    for key in f.tensors:
        got = f.read(key)
        with reading_through(stager):
            staged = f.read(key)
        monkeypatch.setattr(staging, "PARALLEL_BYTES", 1 << 40)
        want = f.read(key)  # sequential
        monkeypatch.setattr(staging, "PARALLEL_BYTES", 1 << 16)
        assert torch.equal(got, want) and torch.equal(staged, want), key
    stager.finish()
    assert calls and max(calls) > 1


@pytest.mark.parametrize("in_cache", [True, False], ids=["in the page cache", "on disk"])
def test_only_what_the_page_cache_holds_is_read_in_parallel(tmp_path, monkeypatch, small_pieces, in_cache):
    """Data in the page cache is read by the pool's threads without waiting; data that must come
    from the disk is read afterwards by the calling thread in file order, one read at a time, so a
    spinning disk is never asked for several places at once. The bytes are the file's either way."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("cannot drop a file from the page cache here")
    data = torch.randint(0, 256, (400_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "bytes.bin"
    with open(path, "wb") as fh:
        fh.write(data.numpy().tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    calls = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        calls.append((offset, bool(flags and flags[0] & os.RWF_NOWAIT), threading.current_thread() is threading.main_thread()))
        return real(fd, buffers, offset, *flags)

    with open(path, "rb", buffering=0) as fh:
        if in_cache:
            fh.read()
        else:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            try:  # the kernel may keep the pages (another process reading, memory to spare): then no test
                os.preadv(fh.fileno(), [bytearray(4096)], 0, os.RWF_NOWAIT)
                pytest.skip("the page cache kept the file after POSIX_FADV_DONTNEED")
            except BlockingIOError:
                pass  # not cached: what the test needs
            except OSError as exc:  # RWF_NOWAIT refused by this file system: the test cannot tell either way
                pytest.skip(f"RWF_NOWAIT reads are not supported here ({exc})")
        fh.seek(0)
        monkeypatch.setattr(os, "preadv", preadv)
        out = torch.empty(400_000, dtype=torch.uint8)
        assert staging.read_full(fh, memoryview(out.numpy())) == 400_000
    assert torch.equal(out, data)
    waiting = [offset for offset, nowait, main in calls if not nowait]
    assert all(main for _, nowait, main in calls if not nowait)  # the disk reads: the calling thread's
    assert waiting == sorted(waiting)  # in file order
    assert bool(waiting) == (not in_cache)
