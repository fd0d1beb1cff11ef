"""Where the host waited for a CUDA device, named by the code that asked for the wait.

``torch.cuda.set_sync_debug_mode("warn")`` warns at every call that makes the host wait for the
device. The warning's own location is the innermost Python frame, and for a wait made through one of
torch's Python wrappers (``torch.cuda.Stream.synchronize``, ``Event.synchronize``) that frame is
torch's: on the H100 (torch 2.11, 2026-11-27) both of ``klein_core.transfer``'s intended waits were
reported at ``torch/cuda/streams.py:108``, and the GPU suite's one-wait test failed on them.
:func:`sync_callers` keeps, for each such warning, the innermost frame of the stack outside torch and
outside the warnings machinery.

Usage::

    with sync_callers() as waits:      # switches the debug mode on, and off at the end
        generate(...)
    waits  # ["/path/klein_core/transfer.py:71: called a synchronizing CUDA operation", ...]

Off CUDA there is nothing to record: the list stays empty and the debug mode is not touched.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["is_sync_warning", "sync_callers"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_WARNINGS_FILES = ("warnings.py", "_py_warnings.py")  # the stdlib module (3.14 moved it to _py_warnings)


def is_sync_warning(message: object) -> bool:
    """Whether a warning's message is torch's report of a synchronising CUDA call. torch's one-off
    notice that the debug mode is a prototype is not one."""
    text = str(message)
    return "synchroniz" in text and "prototype feature" not in text


def _caller(stack: Iterable[traceback.FrameSummary], skip: tuple[str, ...]) -> str | None:
    """``file:line`` of the innermost frame outside ``skip`` (folder prefixes), this module and the
    warnings machinery; None if there is none."""
    here = os.path.abspath(__file__)
    for frame in reversed(list(stack)):
        path = os.path.abspath(frame.filename)
        if path == here or os.path.basename(path) in _WARNINGS_FILES or path.startswith(skip):
            continue
        return f"{frame.filename}:{frame.lineno}"
    return None


@contextlib.contextmanager
def sync_callers(*, switch: bool = True, enabled: bool | None = None,
                 skip: tuple[str, ...] = (_TORCH_DIR,)) -> Iterator[list[str]]:
    """Collect ``"file:line: message"`` of each synchronising CUDA call made inside the block, the
    location being the innermost caller outside ``skip`` (torch's own folder by default).

    ``switch``: switch ``torch.cuda.set_sync_debug_mode("warn")`` on at the start (with False the
    caller switches it, for a part of the block only); it is always switched off at the end.
    ``enabled``: record at all (default: when CUDA is available). Other warnings inside the block go
    on to where they went before.
    """
    found: list[str] = []
    if enabled is None:
        enabled = torch.cuda.is_available()
    if not enabled:
        yield found
        return
    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
            if not is_sync_warning(message):
                previous(message, category, filename, lineno, file, line)
                return
            where = _caller(traceback.extract_stack()[:-1], skip) or f"{filename}:{lineno}"
            found.append(f"{where}: {str(message).splitlines()[0]}")

        warnings.simplefilter("always")  # each wait, not the first one per location
        warnings.showwarning = show
        try:
            if switch and torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            yield found
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
