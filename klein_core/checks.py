"""NaN and Inf named where they enter, instead of showing up later as a black image.

Inputs are checked when a stage receives them (:func:`require_finite`: the prompt embeddings,
reference pixels and latents, noise, latents to decode) and each stage's output once it is done
(:func:`check_output`). When an output is not finite although its inputs were, the component's
weights are scanned to name the corrupt tensor and its file; only if they are clean is the cause
numeric (an fp16 overflow, an extreme setting). One reduction per tensor: no per-step host syncs.

A run's checks may also wait and be read together (:class:`Checks` with ``defer=True``): reading a
check's answer makes the host wait for every kernel queued before it, which between the stages of
a run left the GPU idle while the host prepared the next stage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import nn
from typing_extensions import Self  # typing.Self needs Python 3.11; 3.10 is supported

from .errors import NonFiniteWeights
from .transfer import to_host

logger = logging.getLogger(__name__)

#: Device types whose checks :class:`Checks` (``defer=True``) queues; tensors on any other device
#: are checked at once. The host has nothing to gain (its tensors are ready when a check reads
#: them); tests add ``"cpu"`` to run the queued path on the CPU.
DEFERRED_DEVICES: tuple[str, ...] = ("cuda",)


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite (float8 included); other dtypes are.

    One reduction: a NaN or an infinity makes the sum NaN or infinite, so a finite sum (in float32,
    float64 for float64) means every value is finite. ``isfinite(t).all()`` takes four passes over
    ``t`` and two temporaries of its size; on the host, for the noise checked before every run,
    those passes sat on the path between the text stage and the first step. Only a sum that
    overflowed is checked again value by value.
    """
    if not t.is_floating_point():
        return True
    t = t.detach()  # a check, not part of any graph (and no warning for a tensor that needs grad)
    if t.dtype.itemsize == 1:  # float8 has no reductions
        t = t.float()
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if math.isfinite(float(total)):
        return True
    return bool(torch.isfinite(t).all())


def require_finite(t: torch.Tensor, what: str) -> None:
    """Raise ValueError naming ``what`` ("reference 2", "the noise") if ``t`` holds NaN or Inf."""
    if not is_finite(t):
        _refuse(what)


def require_within(t: torch.Tensor, what: str, bound: float, hint: str) -> None:
    """Raise ValueError naming ``what`` and the range found if ``|t|`` exceeds ``bound`` anywhere
    (pixels given in 0..255 where [-1, 1] is meant). NaN passes: it is :func:`require_finite`'s."""
    if not _within(t, bound):
        _refuse_range(t, what, hint)


def _within(t: torch.Tensor, bound: float) -> torch.Tensor:
    x = t.detach()
    return (~(x.abs() > bound)).all()


def _refuse_range(t: torch.Tensor, what: str, hint: str) -> NoReturn:
    x = t.detach().float()
    raise ValueError(f"{what} holds values from {x.min().item():g} to {x.max().item():g}; {hint}")


def _refuse(what: str) -> NoReturn:
    raise ValueError(f"{what} contains NaN or infinite values; klein_core does not run on them. Check where "
                     "it came from (a corrupt image or file, or an earlier step that overflowed).")


def non_finite_tensor(module: nn.Module) -> tuple[str, str] | None:
    """The first tensor of ``module`` holding NaN or Inf, as ``(name, what)``, if any: a float
    parameter or buffer (``what`` is ``""``), or a float part packed inside a quantised layer (GGUF
    block scales, NVFP4 scales: layers with a ``float_parts()`` method), named as the file names it
    (``"blocks.0.qkv.weight_scale_2"``) with ``what`` saying which part (``"its NVFP4 per-tensor
    scale"``). Integer payloads (packed codes, scales kept as bit patterns) are never read as floats."""
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            if t is not None and t.device.type != "meta" and not is_finite(t.detach()):
                return dot + name, ""
        parts = getattr(mod, "float_parts", None)
        if callable(parts) and all(t.device.type != "meta" for t in mod.buffers(recurse=False)):
            for name, what, t in parts():
                if not is_finite(t.detach()):
                    return dot + name, what
    return None


def non_finite_weight(module: nn.Module) -> str | None:
    """The name of the first tensor of ``module`` holding NaN or Inf, if any (see
    :func:`non_finite_tensor`; a quantised layer's scales included)."""
    bad = non_finite_tensor(module)
    return None if bad is None else bad[0]


def check_output(t: torch.Tensor, stage: str, module: nn.Module, cause: str) -> None:
    """After a stage: raise if ``t`` is not finite, naming the corrupt weight of ``module`` (a
    :class:`~klein_core.errors.NonFiniteWeights`) or else the numeric ``cause`` (FloatingPointError)."""
    if not is_finite(t):
        _blame(stage, module, cause)


def _blame(stage: str, module: nn.Module, cause: str) -> NoReturn:
    """Raise for a stage whose output was not finite: the corrupt weight of ``module``, else ``cause``."""
    bad = non_finite_tensor(module)
    source = getattr(module, "source", None) or f"the in-memory {type(module).__name__}"
    if bad is not None:
        name, what = bad
        raise NonFiniteWeights(f"{stage} produced NaN/Inf because its weights are corrupt: tensor '{name}'"
                                f"{f' ({what})' if what else ''} of {source} contains NaN or infinite values. "
                                "Download the file again.")
    raise FloatingPointError(f"{stage} produced NaN/Inf values ({source}); likely cause: {cause}.")


class Checks:
    """Where the finiteness checks of a run go: read at once (the default), or queued and read together.

    ``Checks(defer=True)`` queues the check of a tensor on a device of :data:`DEFERRED_DEVICES` as a
    flag computed there (no wait), and :meth:`resolve` reads every flag in one copy, once the run's
    result is on its way to the host anyway. The errors are those of :func:`require_finite` and
    :func:`check_output`, and the one raised is the first check that failed in the order they were
    queued: where the NaN entered (later stages only carry it on). Work queued after a failed check
    runs to no purpose, which happens only on the way to an error. Tensors on other devices (the
    host) are checked at once. Not thread-safe: one per run. As a context manager it resolves what
    is left when its block ends, or settles it when the block fails (:meth:`settle`).
    """

    def __init__(self, *, defer: bool = False) -> None:
        self.defer = defer
        self._queued: list[tuple[torch.Tensor, Callable[[bool], object]]] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Leaving a ``with Checks(...)`` block: what is still queued is resolved (raising as
        :meth:`resolve` does), or settled if the block is leaving on an exception (:meth:`settle`)."""
        if kind is None:
            self.resolve()
        else:
            self.settle()

    @property
    def pending(self) -> int:
        """How many checks wait for :meth:`resolve`."""
        return len(self._queued)

    def _queue(self, t: torch.Tensor, on_result: Callable[[bool], object], flag: torch.Tensor | None = None) -> bool:
        """Queue ``on_result(ok)`` for ``t`` if its check waits; False if the caller must check now.
        ``ok`` is ``flag`` (a boolean computed on the device) if given, else whether ``t`` is finite."""
        if not (self.defer and t.device.type in DEFERRED_DEVICES and t.is_floating_point()):
            return False
        if flag is not None:
            self._queued.append((flag, on_result))
            return True
        x = t.detach()
        if x.dtype.itemsize == 1:  # float8 has no isfinite
            x = x.float()
        self._queued.append((torch.isfinite(x).all(), on_result))  # exact: no sum that could overflow
        return True

    def require_finite(self, t: torch.Tensor, what: str) -> None:
        """:func:`require_finite`, queued where this object defers."""
        if not self._queue(t, lambda ok: ok or _refuse(what)):
            require_finite(t, what)

    def require_within(self, t: torch.Tensor, what: str, bound: float, hint: str) -> None:
        """:func:`require_within`, queued where this object defers."""
        waits = self.defer and t.device.type in DEFERRED_DEVICES and t.is_floating_point()
        if not waits or not self._queue(t, lambda ok: ok or _refuse_range(t, what, hint), flag=_within(t, bound)):
            require_within(t, what, bound, hint)

    def check_output(self, t: torch.Tensor, stage: str, module: nn.Module, cause: str) -> None:
        """:func:`check_output`, queued where this object defers (the weights are scanned only if it fails)."""
        if not self._queue(t, lambda ok: ok or _blame(stage, module, cause)):
            check_output(t, stage, module, cause)

    def when_finite(self, t: torch.Tensor, action: Callable[[], object]) -> None:
        """Call ``action()`` once ``t`` is known to be finite (now, or at :meth:`resolve`); never if
        it is not (a cache that must not keep garbage). Raises nothing itself."""
        if not self._queue(t, lambda ok: ok and action()) and is_finite(t):
            action()

    def resolve(self) -> None:
        """Read every queued flag (one copy per device) and act on them in the order they were queued:
        the first failed check raises; an action of :meth:`when_finite` queued before it still runs.
        The queue is empty afterwards, whatever happens."""
        queued, self._queued = self._queued, []
        for ok, (_, on_result) in zip(_read(queued), queued):
            on_result(ok)

    def settle(self) -> None:
        """After the run failed for another reason (a cancel, out of memory): read the queued flags
        and run each :meth:`when_finite` action whose tensor proved finite, so what a run finished
        before it failed is kept (the prompt cache's new embeddings: the next run does not encode
        them again). Raises nothing, since another error is on its way: the first failed check is
        logged as a warning instead, and a device that cannot be read any more (a CUDA error) only
        empties the queue."""
        queued, self._queued = self._queued, []
        try:
            results = _read(queued)
        except Exception as exc:  # noqa: BLE001 - the error on its way says what went wrong
            logger.debug("the queued checks could not be read after the run failed: %s", exc)
            return
        warned = False
        for ok, (_, on_result) in zip(results, queued):
            if ok or not warned:  # a failed check's message once: where the NaN entered
                try:
                    on_result(ok)
                except Exception as exc:  # noqa: BLE001 - logged, not raised (see above)
                    warned = True
                    logger.warning("the run failed, and a check found besides: %s", exc)


def _read(queued: list[tuple[torch.Tensor, Callable[[bool], object]]]) -> list[bool]:
    """The queued flags' values, read in one copy per device."""
    if not queued:
        return []
    devices = list(dict.fromkeys(flag.device for flag, _ in queued))
    stacked = [torch.stack([flag for flag, _ in queued if flag.device == d]) for d in devices]
    read = {d: iter(host.tolist()) for d, host in zip(devices, to_host(*stacked))}
    return [bool(next(read[flag.device])) for flag, _ in queued]


__all__ = ["DEFERRED_DEVICES", "Checks", "check_output", "is_finite", "non_finite_tensor", "non_finite_weight",
           "require_finite", "require_within"]
