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
    total = _physical() if root == Path("/") else _meminfo(root).get("MemTotal")
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
        available = available if room[0] is None else min(available, room[0])
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


# Per cgroup version: the mount under /sys/fs/cgroup, and its files for the limit, the usage, the
# statistics and the reclaimable file cache's entry in them.
_CGROUPS = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
            "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def _cgroup_folders(root: Path) -> list[tuple[str, list[Path]]]:
    """For each memory cgroup hierarchy of the process (v2, v1): its own folder, then its parents
    up to the mount. Inside a container the cgroup namespace usually makes the container's cgroup
    the mount's top folder, and the path says "/"."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = "v2" if hierarchy == "0" and controllers == "" else \
            "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        mount = root / "sys" / "fs" / "cgroup" / _CGROUPS[version][0]
        parts = [p for p in path.strip("/").split("/") if p]
        out.append((version, [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]))
    return out


def _cgroup_room(root: Path) -> tuple[int | None, int | None] | None:
    """Within the process's cgroups and every parent of theirs with a bound (the kernel reclaims,
    or ends a process, at the tightest): the bytes of memory they may still take, their
    reclaimable file cache counted as free, as the kernel would reclaim it (None: no limit), and
    the swap they may still use (None: no bound). None without any bound."""
    rooms, swaps = [], []
    for version, folders in _cgroup_folders(root):
        _, limit_name, usage_name, file_key = _CGROUPS[version]
        for folder in folders:
            limit, usage = _read_limit(folder / limit_name), _read_limit(folder / usage_name)
            if limit is not None and usage is not None:
                rooms.append(max(0, limit - usage + _stat(folder / "memory.stat").get(file_key, 0)))
            if version == "v2":  # "max" (no bound of its own) reads as None
                swap_max = _read_int(folder / "memory.swap.max")
                if swap_max is not None:
                    swaps.append(max(0, swap_max - (_read_int(folder / "memory.swap.current") or 0)))
            elif limit is not None and usage is not None:
                # v1 bounds memory and swap together (docker's --memory-swap): what is left of that,
                # less the memory still free, may be swapped
                both, both_used = (_read_limit(folder / "memory.memsw.limit_in_bytes"),
                                   _read_limit(folder / "memory.memsw.usage_in_bytes"))
                if both is not None and both_used is not None:
                    swaps.append(max(0, (both - both_used) - (limit - usage)))
    if not rooms and not swaps:
        return None
    return (min(rooms) if rooms else None), (min(swaps) if swaps else None)


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
        _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),  # DWORD: 32 bits
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


def _cgroup_limit(root: Path) -> int | None:
    """The lowest memory limit of the process's cgroups and their parents; None if there is none."""
    limits = [limit for version, folders in _cgroup_folders(root) for folder in folders
              if (limit := _read_limit(folder / _CGROUPS[version][1])) is not None]
    return min(limits) if limits else None


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None for "max", a missing file or anything else."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_limit(path: Path) -> int | None:
    """A cgroup limit or usage in bytes; None for none ("max", v1's huge number, 0, no file)."""
    value = _read_int(path)
    return value if value is not None and 0 < value < _NO_LIMIT else None


__all__ = ["ram_available", "ram_total", "shortfall"]
