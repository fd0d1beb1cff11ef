"""CPU memory available, as Linux and a container's cgroup say it (klein_core.memory.host), and the
warning before a CPU load that does not fit it. The trees under tmp_path stand in for /proc and
/sys; the load warning is checked with the available memory stood in."""

from __future__ import annotations

import logging

import pytest
import torch

import klein_core as kc
from klein_core.memory import host
from klein_core.testing import write_tiny_model_files

GB = 10**9
MEMINFO = "MemTotal:       65536000 kB\nMemFree:         100000 kB\nMemAvailable:   20000000 kB\nSwapFree:        4000000 kB\n"


def _tree(tmp_path, cgroup: str = "0::/\n", files: dict[str, str] | None = None, meminfo: str = MEMINFO):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(meminfo)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    (tmp_path / "sys" / "fs" / "cgroup").mkdir(parents=True)
    for path, text in (files or {}).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


V2 = "sys/fs/cgroup/"


@pytest.mark.parametrize("cgroup, files, want", [
    ("0::/\n", {}, (20000000 * 1024, 4000000 * 1024)),  # the machine's MemAvailable and SwapFree
    ("0::/\n", {V2 + "memory.max": "max\n", V2 + "memory.current": "5000000000\n"},
     (20000000 * 1024, 4000000 * 1024)),  # no limit
    # a container of 8 GB using 6, 1.5 of it reclaimable file cache, no swap of its own
    ("0::/\n", {V2 + "memory.max": "8000000000\n", V2 + "memory.current": "6000000000\n",
                V2 + "memory.stat": "anon 4500000000\ninactive_file 1500000000\n", V2 + "memory.swap.max": "0\n"},
     (3500000000, 0)),
    ("0::/kubepods/pod1\n", {V2 + "kubepods/pod1/memory.max": "30000000000\n",
                             V2 + "kubepods/pod1/memory.current": "1000000000\n",
                             V2 + "kubepods/pod1/memory.swap.max": "1000000000\n",
                             V2 + "kubepods/pod1/memory.swap.current": "250000000\n"},
     (20000000 * 1024, 750000000)),  # more room than the machine has: the machine's; its own swap bound
    ("9:memory:/docker/x\n", {"sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes": "4000000000\n",
                              "sys/fs/cgroup/memory/docker/x/memory.usage_in_bytes": "3000000000\n",
                              "sys/fs/cgroup/memory/docker/x/memory.stat": "total_inactive_file 500000000\n"},
     (1500000000, 4000000 * 1024)),  # cgroup v1
], ids=["machine", "v2 no limit", "v2 container", "v2 nested", "v1"])
def test_ram_available_reads_the_machine_and_its_cgroup(tmp_path, cgroup, files, want):
    assert host.ram_available(_tree(tmp_path, cgroup, files)) == want


def test_ram_available_is_none_where_linux_does_not_say(tmp_path):
    assert host.ram_available(_tree(tmp_path, meminfo="MemTotal: 1 kB\n")) is None  # a kernel before 3.14
    assert host.shortfall(10**15, tmp_path) is None


def test_shortfall_says_swap_or_the_end_of_the_process(tmp_path):
    root = _tree(tmp_path)  # 20.5 GB available, 4.1 GB of swap
    assert host.shortfall(20 * GB, root) is None
    swap = host.shortfall(22 * GB, root)
    assert "22.0 GB of CPU memory, and 20.5 GB is available" in swap and "swap" in swap and "end" not in swap
    end = host.shortfall(30 * GB, root)
    assert "(4.1 GB more as swap)" in end and "out-of-memory killer" in end


def test_a_cpu_load_larger_than_the_memory_available_is_said_first(tmp_path, monkeypatch, caplog):
    """The warning names the component, the file and the bytes the load takes in CPU memory (as
    loaded: the dtype asked for, not the file's), before the load; a load that fits says nothing,
    and a load onto another device never asks."""
    files = write_tiny_model_files(tmp_path)
    path = files["klein_4b"]
    seen = []
    monkeypatch.setattr(host, "ram_available", lambda root=None: seen.append(1) or (1000, 0))
    with caplog.at_level(logging.WARNING, logger="klein_core.files.materialize"):
        tr = kc.load_transformer(path, device="cpu", dtype=torch.float32)
    said = [r.getMessage() for r in caplog.records if "into CPU memory" in r.getMessage()]
    assert len(said) == 1 and "transformer: loading " in said[0] and f"{path.name} into CPU memory" in said[0]
    nbytes = sum(t.nbytes for t in tr.state_dict().values())
    assert f"it takes {nbytes / 1e9:.1f} GB" in said[0] and "out-of-memory killer" in said[0]
    caplog.clear()
    monkeypatch.setattr(host, "ram_available", lambda root=None: seen.append(1) or (10**12, 0))
    with caplog.at_level(logging.WARNING, logger="klein_core.files.materialize"):
        kc.load_transformer(path, device="cpu")
        n = len(seen)
        kc.load_transformer(path, device="meta")
    assert not [r for r in caplog.records if "into CPU memory" in r.getMessage()]
    assert len(seen) == n  # not asked for a load that takes no CPU memory


def test_windows_total_reads_global_memory_status(monkeypatch):
    """On Windows the machine's memory comes from GlobalMemoryStatusEx (stood in here: the call
    fills the structure it is given, which must announce its size, 64 bytes, as Windows checks)."""
    import ctypes
    from types import SimpleNamespace

    seen = []

    def status_ex(ref):
        status = ref._obj
        seen.append(status.dwLength)
        status.ullTotalPhys = 34359738368
        return 1

    monkeypatch.setattr(ctypes, "windll", SimpleNamespace(kernel32=SimpleNamespace(GlobalMemoryStatusEx=status_ex)),
                        raising=False)
    assert host._windows_total() == 34359738368 and seen == [64]
    monkeypatch.setattr(ctypes, "windll", SimpleNamespace(kernel32=SimpleNamespace(GlobalMemoryStatusEx=lambda r: 0)))
    assert host._windows_total() is None  # the call failed
    monkeypatch.delattr(ctypes, "windll")
    assert host._windows_total() is None  # not Windows at all
