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


__all__ = ["ram_total"]
