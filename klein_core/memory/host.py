"""The machine's CPU memory: how much there is to the process (a container's limit included).

Asked when it is needed, never at import. Everything here answers None rather than guess where the
system does not say (an unreadable ``/proc``, an unknown platform).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number (about 2**63) for "no limit"


def ram_total(root: Path = Path("/")) -> int | None:
    """Bytes of CPU memory the process may use: the machine's physical memory, or its cgroup's
    memory limit (a container's) if that is lower; None if it cannot be told. ``root`` is where
    ``/proc`` and ``/sys`` are found (the tests point it at a made-up tree)."""
    total = _physical() if root == Path("/") else _meminfo_total(root)
    limit = _cgroup_limit(root) if sys.platform.startswith("linux") or root != Path("/") else None
    if total is None:
        return limit
    return total if limit is None else min(total, limit)


def ram_available(root: Path = Path("/")) -> tuple[int, int] | None:
    """``(available, swap_free)`` bytes of CPU memory on Linux: what can be had without swapping
    (``MemAvailable``, or less within a cgroup's limit: the limit less what the cgroup uses but its
    reclaimable file cache) and what swapping could add; None elsewhere or if unreadable."""
    if root == Path("/") and not sys.platform.startswith("linux"):
        return None
    info = _meminfo(root)
    if "MemAvailable" not in info:
        return None
    available, swap = info["MemAvailable"], info.get("SwapFree", 0)
    room = _cgroup_room(root)
    if room is not None:
        available = min(available, room[0])
        swap = swap if room[1] is None else min(swap, room[1])
    return available, swap


def shortfall(nbytes: int, root: Path = Path("/")) -> str | None:
    """What taking ``nbytes`` more CPU memory would mean, when it does not fit what is available
    (:func:`ram_available`): swapping, or more than memory and swap together (where Linux ends a
    process); None when it fits, or where the system does not say."""
    room = ram_available(root)
    if room is None or nbytes <= room[0]:
        return None
    available, swap = room
    told = f"{nbytes / 1e9:.1f} GB of CPU memory, and {available / 1e9:.1f} GB is available"
    if nbytes <= available + swap:
        return f"it takes {told}: the system will swap (slowly)"
    return (f"it takes {told} ({swap / 1e9:.1f} GB more as swap): the system may end the process "
            "(Linux's out-of-memory killer) before it finishes")


def _meminfo(root: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (root / "proc" / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _cgroup_room(root: Path) -> tuple[int, int | None] | None:
    """Within the process's cgroup (v2, else v1) with a memory limit: the bytes it may still take
    (its reclaimable file cache counted as free, as the kernel would reclaim it) and the swap it
    may still use (None: no limit of its own). None without a limited cgroup."""
    for base, limit_name, usage_name, stat_name, file_key in (
            (Path("sys/fs/cgroup"), "memory.max", "memory.current", "memory.stat", "inactive_file"),
            (Path("sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
             "total_inactive_file")):
        folder = _own_cgroup(root, base, v2=limit_name == "memory.max")
        if folder is None:
            continue
        limit = _read_limit(folder / limit_name)
        usage = _read_limit(folder / usage_name)
        if limit is None or usage is None:
            continue
        stat = _stat(folder / stat_name)
        room = max(0, limit - usage + stat.get(file_key, 0))
        swap = None
        swap_max = _read_limit(folder / "memory.swap.max") if limit_name == "memory.max" else None
        if swap_max is not None:
            swap = max(0, swap_max - (_read_limit(folder / "memory.swap.current") or 0))
        elif limit_name == "memory.max" and (folder / "memory.swap.max").exists() and \
                (folder / "memory.swap.max").read_text().strip() == "0":
            swap = 0
        return room, swap
    return None


def _own_cgroup(root: Path, base: Path, *, v2: bool) -> Path | None:
    """The folder of the process's own cgroup under ``base`` (v2: the unified hierarchy; v1: the
    memory controller's), if it exists."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (v2 and hierarchy == "0" and controllers == "") or (not v2 and "memory" in controllers.split(",")):
            folder = root / base / path.strip("/")
            return folder if folder.is_dir() else (root / base if (root / base).is_dir() else None)
    return None


def _stat(path: Path) -> dict[str, int]:
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}


def _physical() -> int | None:
    if sys.platform == "win32":
        return _windows_total()
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _windows_total() -> int | None:
    import ctypes

    class MemoryStatus(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = MemoryStatus()
    status.dwLength = ctypes.sizeof(MemoryStatus)
    try:
        ok = ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
    return int(status.ullTotalPhys) if ok else None


def _meminfo_total(root: Path) -> int | None:
    try:
        for line in (root / "proc" / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit(root: Path) -> int | None:
    """The lowest memory limit of the process's cgroup and its parents (v2), or of its v1 memory
    cgroup; None if there is none."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            base, name = root / "sys" / "fs" / "cgroup", "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            base, name = root / "sys" / "fs" / "cgroup" / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        # Inside a container the cgroup namespace usually makes the container's cgroup the root of
        # what is mounted, and the path says "/": the limit is then in the mount's top folder.
        for depth in range(len(parts), -1, -1):
            limit = _read_limit(base.joinpath(*parts[:depth]) / name)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _NO_LIMIT else None


__all__ = ["ram_available", "ram_total", "shortfall"]
