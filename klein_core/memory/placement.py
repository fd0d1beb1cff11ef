"""Placing components on the compute device only while they run, and streaming blocks.

Both tools are exact (weights are copied, never converted) and device-agnostic: on the CPU the same
code runs with CPU-to-CPU copies and no streams, which is how the tests check it.

* :func:`on_device` moves a component to the compute device for one stage and puts its original (CPU,
  ideally pinned) tensors back afterwards, copying nothing back: peak memory is about the largest
  component, not the sum.
* :class:`BlockOffloader` keeps a model's repeated blocks in pinned CPU memory and copies block
  ``i + 1`` on a side CUDA stream while block ``i`` computes; the non-block weights stay resident.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from ..pipeline.request import indexed_device
from ..quant.fp8 import holds_float8, is_fp8
from . import pinned

logger = logging.getLogger(__name__)

# Methods of a block, besides ``forward``, that a model calls directly: forward hooks never see those
# calls, so the offloader wraps them too. ``Flux2Transformer.reference_kv`` (KV mode) runs each block's
# ``reference`` pass; unwrapped, it would compute with the blocks' CPU home weights on device inputs.
STREAMED_METHODS: tuple[str, ...] = ("reference",)


@dataclass
class _Slot:
    """One parameter or buffer: where it lives in the module tree (``also``: more places of the same
    tensor, a tied weight) and its home (offload) copy."""

    owner: nn.Module
    name: str
    is_param: bool
    home: torch.Tensor
    also: list[tuple[nn.Module, str]] = field(default_factory=list)
    # The Parameter the module had: put back (not a new one over the same home) when the home is
    # unchanged, so its version counter, which caches key weights on (``weights_state``), survives:
    # a new Parameter starts at 0 and would match a key made before an in-place load_state_dict.
    param: nn.Parameter | None = None


def _slots(module: nn.Module) -> list[_Slot]:
    """One slot per tensor: a weight tied between modules (one Parameter in two places) is one slot,
    so it is moved, copied and page-locked once and stays tied, as ``module.to()`` keeps it."""
    out: list[_Slot] = []
    seen: dict[int, _Slot] = {}
    for owner in module.modules():
        for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) in seen:
                    seen[id(t)].also.append((owner, name))
                    continue
                seen[id(t)] = slot = _Slot(owner, name, is_param, t.data if is_param else t,
                                           param=t if is_param else None)
                out.append(slot)
    return out


def _places(slot: _Slot) -> list[tuple[nn.Module, str]]:
    return [(slot.owner, slot.name), *slot.also]


def _set(slot: _Slot, t: torch.Tensor) -> None:
    places = _places(slot)
    if slot.is_param:
        # A new Parameter rather than ``.data =``: that refuses some device pairs (e.g. meta).
        old = slot.owner._parameters[slot.name]
        grad = bool(old is not None and old.requires_grad)
        param = None
        if slot.param is not None and t is slot.home:
            if slot.param.data_ptr() == t.data_ptr() and slot.param.device == t.device:
                param = slot.param.requires_grad_(grad)
            else:  # the home was replaced (page-locked, moved): the old Parameter would only hold its memory
                slot.param = None
        if param is None:
            param = nn.Parameter(t, requires_grad=grad)
        for owner, name in places:
            owner._parameters[name] = param
    else:
        for owner, name in places:
            owner._buffers[name] = t


def _modules_once(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    """``module`` and its submodules, each once; those whose id is in ``seen`` (which it extends)
    are skipped, with what they hold."""
    stack = [module]
    while stack:
        owner = stack.pop()
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        yield owner
        stack.extend(child for child in owner._modules.values() if child is not None)


def module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``module``, each submodule visited once (as :func:`_slots`,
    without building slots). The planner and each stage walk whole models on every run, before the
    GPU has work or between its stages; a plain stack walks a 4B text encoder's 381 modules in half
    the time of ``module.modules()``, which builds a name for each (0.25 against 0.54 ms, 2-core
    CPU machine). The order is not :func:`_slots`' order."""
    for owner in _modules_once(module, set()):
        for t in owner._parameters.values():
            if t is not None:
                yield t
        for t in owner._buffers.values():
            if t is not None:
                yield t


def _footprint(module: nn.Module, seen: set[int]) -> tuple[int, int]:
    """Bytes of the parameters and buffers of ``module``'s submodules not in ``seen`` (which it
    extends), as :func:`module_bytes` counts them, and their parameters' element count, a parameter
    tied in two places once (as ``module.parameters()``): one walk, as :func:`module_tensors`."""
    nbytes = numel = 0
    counted: set[int] = set()
    for owner in _modules_once(module, seen):
        for t in owner._parameters.values():
            if t is not None:
                nbytes += t.nbytes
                if id(t) not in counted:
                    counted.add(id(t))
                    numel += t.numel()
        for t in owner._buffers.values():
            if t is not None:
                nbytes += t.nbytes
    return nbytes, numel


def block_footprint(model: nn.Module) -> tuple[int, tuple[int, ...], int]:
    """``(total bytes, each block's bytes in forward order, the largest block's parameter count)``
    of ``model`` (blocks: :func:`find_block_lists`), in one walk of its modules. The planner sizes
    every component on every run before the GPU has work; three walks of a full-size 4B transformer,
    text encoder and VAE (bytes of each block, bytes of the whole, parameters of each block) took
    3.2 ms of host time on a 2-core AMD EPYC, one walk 1.2 ms (the best of 6 runs). Each submodule counts once, in the
    first block that holds it (a module shared by two blocks is not in the second one's bytes)."""
    seen: set[int] = set()
    blocks, largest = [], 0
    for block in (b for lst in find_block_lists(model) for b in lst):
        nbytes, numel = _footprint(block, seen)
        blocks.append(nbytes)
        largest = max(largest, numel)
    rest, _ = _footprint(model, seen)
    return rest + sum(blocks), tuple(blocks), largest


def tensor_devices(module: nn.Module) -> set[torch.device]:
    """The devices ``module``'s parameters and buffers are on."""
    return {t.device for t in module_tensors(module)}


def module_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module``."""
    return sum(t.nbytes for t in module_tensors(module))


def _pinnable() -> bool:
    # Pinning needs a CUDA driver; asked at call time, never at import.
    return torch.cuda.is_available()


def pin_memory_(module: nn.Module) -> nn.Module:
    """Move ``module``'s tensors to pinned (page-locked) CPU memory, in place.

    Pinned memory lets host-to-device copies run asynchronously at full PCIe speed. The tensors
    are packed into a few page-locked chunks (:mod:`klein_core.memory.pinned`), within the share
    of the machine's memory that may be locked; beyond it they stay in ordinary CPU memory (said
    once). Without CUDA the tensors are just moved to the CPU.
    """
    slots = _slots(module)
    _pin_homes(slots, type(module).__name__)  # a device tensor is copied straight into its chunk
    for slot in slots:  # what was not page-locked (no CUDA, over the bound) moves to ordinary memory
        if slot.home.device.type != "cpu":
            slot.home = slot.home.to("cpu")
            _set(slot, slot.home)
    return module


def _pin_homes(slots: Sequence[_Slot], what: str) -> None:
    """Each slot's CPU home replaced by its page-locked copy (:func:`~klein_core.memory.pinned.pin_tensors`),
    where there is one, as soon as it is made (the original is freed then, unless held elsewhere);
    nothing without CUDA."""
    if not _pinnable():
        return

    def replace(i: int, copy: torch.Tensor) -> None:
        slots[i].home = copy
        _set(slots[i], copy)

    pinned.pin_tensors([s.home for s in slots], budget=pinned.pin_budget, what=what, on_pinned=replace)


@contextlib.contextmanager
def on_device(
    module: nn.Module, device: torch.device | str, *, non_blocking: bool = True
) -> Iterator[nn.Module]:
    """Run a stage with ``module`` on ``device``; afterwards its original tensors are back.

    ``with on_device(text_encoder, "cuda"): emb = text_encoder.encode(ids, mask)``. The module's
    tensors are copied to ``device`` on entry and the copies dropped on exit (weights are not
    modified by inference, so nothing is copied back). A module already on ``device`` is left
    alone. Keep offloaded modules in pinned CPU memory (:func:`pin_memory_`) for fast copies.
    """
    device = indexed_device(device)
    slots = _slots(module)
    if all(_same_device(s.home.device, device) for s in slots):
        yield module
        return
    try:
        for s in slots:
            _set(s, s.home.to(device, non_blocking=non_blocking, copy=True))
        yield module
    finally:
        for s in slots:
            _set(s, s.home)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    # "cuda" means the current device: the tensors of a module on cuda:1 are not on "cuda" while
    # cuda:0 is current.
    return indexed_device(a) == indexed_device(b)


def find_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The direct ``nn.ModuleList`` children of ``model``, in forward order (the blocks)."""
    return [m for m in model.children() if isinstance(m, nn.ModuleList)]


@dataclass
class OffloadStats:
    """Instrumentation: block copies issued, bytes copied, and block residency on the device."""

    loads: int = 0
    bytes_copied: int = 0
    resident: int = 0
    max_resident: int = 0


class BlockOffloader:
    """Stream the repeated blocks of ``model`` through ``device``; keep the rest resident.

    Args:
        model: e.g. a :class:`~klein_core.models.transformer.Flux2Transformer` or a Qwen3 encoder.
        device: the compute device.
        blocks: the block lists in forward order (default: the model's ``nn.ModuleList`` children).
        prefetch: how many blocks ahead to copy (at most ``prefetch + 1`` on the device); the last block
            prefetches the next forward's first blocks.

    :meth:`attach` (or ``with``) installs the hooks; :meth:`detach` puts every weight back (or on ``to``).
    ``attach(hooks=False)`` places the weights but installs no hooks: the caller then runs each block
    through :meth:`run` (training does, so that the backward pass's recomputation streams too).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        *,
        blocks: Sequence[nn.ModuleList] | None = None,
        prefetch: int = 1,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.model = model
        self.device = indexed_device(device)
        lists = list(blocks) if blocks is not None else find_block_lists(model)
        self.blocks: list[nn.Module] = [b for lst in lists for b in lst]
        if not self.blocks:
            raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to offload")
        self.prefetch = min(prefetch, len(self.blocks) - 1)
        self.stats = OffloadStats()
        self._slots = [_slots(b) for b in self.blocks]
        self._loaded: dict[int, torch.cuda.Event | None] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._wrapped: list[tuple[nn.Module, str]] = []  # (block, method) wrapped as STREAMED_METHODS says
        self._stream: torch.cuda.Stream | None = None
        self._resident: list[_Slot] = []
        # Events marking the end of released blocks' compute: their memory may still be in use.
        self._freeing: collections.deque[torch.cuda.Event] = collections.deque()
        self._attached = False

    # -- lifecycle ------------------------------------------------------------------------------

    def attach(self, *, hooks: bool = True) -> BlockOffloader:
        if self._hooks or self._attached:
            return self
        self._attached = True
        try:
            return self._attach(hooks)
        except BaseException:  # out of memory part-way (or cancelled): every weight back home
            self.detach()
            raise

    def _attach(self, hooks: bool) -> BlockOffloader:
        in_blocks = {(id(o), n) for slots in self._slots for s in slots for o, n in _places(s)}
        # Non-block weights are on the device while attached; their own tensors come back at
        # detach, so an offloaded model leaves nothing behind on the device. A weight a block
        # shares with a module outside the blocks is resident in that module (a copy of its own).
        self._resident = []
        for slot in _slots(self.model):
            outside = [(o, n) for o, n in _places(slot) if (id(o), n) not in in_blocks]
            if outside:
                (owner, name), *also = outside
                self._resident.append(_Slot(owner, name, slot.is_param, slot.home, also, slot.param))
        for slot in self._resident:
            if not _same_device(slot.home.device, self.device):
                _set(slot, slot.home.to(self.device, copy=True))
        for slots in self._slots:
            for s in slots:
                s.home = s.home.to("cpu")
                _set(s, s.home)
        # All blocks at once: packed together, they waste least of the page-locked chunks.
        _pin_homes([s for slots in self._slots for s in slots], f"{type(self.model).__name__} blocks")
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        for i, block in enumerate(self.blocks if hooks else ()):
            self._hooks.append(block.register_forward_pre_hook(self._make_pre_hook(i)))
            self._hooks.append(block.register_forward_hook(self._make_post_hook(i)))
            for name in STREAMED_METHODS:
                if callable(getattr(block, name, None)):
                    # An instance attribute shadows the class's method until detach removes it.
                    block.__dict__[name] = self._streamed(i, block, getattr(block, name))
                    self._wrapped.append((block, name))
        n = sum(module_bytes(b) for b in self.blocks)
        logger.info("Block offload: %d blocks (%.2f GB) stream to %s, %d ahead", len(self.blocks), n / 1e9,
                    self.device, self.prefetch)
        return self

    def detach(self, to: torch.device | str | None = None) -> None:
        """Remove the hooks; block weights go back to their CPU home, or to ``to`` if given."""
        self._attached = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for block, name in self._wrapped:
            block.__dict__.pop(name, None)
        self._wrapped.clear()
        for i in list(self._loaded):
            self._release(i)
        self._freeing.clear()  # the allocator itself keeps freed memory until the GPU is done with it
        for slot in self._resident:
            _set(slot, slot.home if to is None else slot.home.to(to))
        self._resident = []
        if to is not None:
            for slots in self._slots:
                for s in slots:
                    s.home = s.home.to(to)
                    _set(s, s.home)

    def __enter__(self) -> Self:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- streaming ------------------------------------------------------------------------------

    def run(self, i: int, fn: Callable[..., Any], *args: Any, ahead: int = 1, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with block ``i``'s weights on the device, then released; block
        ``i + ahead`` (if it exists; ``ahead`` 0 = none, -1 = the previous block, as a backward pass
        goes) is copied meanwhile."""
        if not self._attached:
            raise RuntimeError("BlockOffloader.run needs attach() first")
        self._acquire(i)
        if ahead and 0 <= i + ahead < len(self.blocks):
            self._load(i + ahead)
        try:
            return fn(*args, **kwargs)
        finally:
            self._release(i)

    def _make_pre_hook(self, i: int):
        def hook(module: nn.Module, args: object) -> None:
            self._acquire(i)
            for k in range(1, self.prefetch + 1):
                self._load((i + k) % len(self.blocks))

        return hook

    def _make_post_hook(self, i: int):
        def hook(module: nn.Module, args: object, output: object) -> None:
            self._release(i)

        return hook

    def _streamed(self, i: int, block: nn.Module, method):
        """``method`` of block ``i`` with the block's forward hooks around it."""
        pre, post = self._make_pre_hook(i), self._make_post_hook(i)

        @functools.wraps(method)
        def call(*args, **kwargs):
            pre(block, args)
            out = method(*args, **kwargs)
            post(block, args, out)
            return out

        return call

    def _load(self, i: int) -> None:
        """Issue the copy of block ``i`` to the device (asynchronously on CUDA)."""
        if i in self._loaded:
            return
        slots = self._slots[i]
        event = None
        try:
            if self._stream is not None:
                # The CPU runs ahead of the GPU: a released block's memory is only reusable once the
                # GPU has run it. Wait for the oldest such block before allocating another, so the
                # device never holds more than prefetch + 1 blocks however far ahead the CPU is.
                while self._freeing and len(self._loaded) + len(self._freeing) > self.prefetch:
                    self._freeing.popleft().synchronize()
                with torch.cuda.stream(self._stream):
                    for s in slots:
                        _set(s, s.home.to(self.device, non_blocking=True, copy=True))
                    event = torch.cuda.Event()
                    event.record(self._stream)
            else:
                for s in slots:
                    _set(s, s.home.to(self.device, copy=True))
        except BaseException:
            # A copy that failed midway (out of memory, an interrupt): the tensors copied so far go
            # home, or they would stay on the device, unknown to detach(), which puts back loaded blocks.
            for s in slots:
                _set(s, s.home)
            raise
        self._loaded[i] = event
        st = self.stats
        st.loads += 1
        st.bytes_copied += sum(s.home.numel() * s.home.element_size() for s in slots)
        st.resident = len(self._loaded)
        st.max_resident = max(st.max_resident, st.resident)

    def _acquire(self, i: int) -> None:
        """Make block ``i``'s weights usable by the compute stream."""
        self._load(i)  # not prefetched (first forward, or prefetch=0): copy now
        event = self._loaded[i]
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            # The copies were allocated on the side stream: tell the allocator they are used on
            # the compute stream, so their memory is not reused before this block has run.
            for s in self._slots[i]:
                t = s.owner._parameters[s.name] if s.is_param else s.owner._buffers[s.name]
                t.record_stream(compute)  # type: ignore[union-attr]

    def _release(self, i: int) -> None:
        if self._loaded.pop(i, "absent") == "absent":
            return
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._freeing.append(done)
        for s in self._slots[i]:
            _set(s, s.home)
        self.stats.resident = len(self._loaded)


class StagePlacer:
    """Applies a memory plan stage by stage.

    ``components`` maps ``"text_encoder"`` / ``"transformer"`` / ``"vae"`` to modules and
    ``placements`` maps them to ``"resident"`` (already on ``device``: run in place; elsewhere:
    copied in for the stage like ``"staged"``), ``"staged"`` (on ``device`` only inside
    :meth:`stage`) or ``"blocks"`` (blocks streamed inside :meth:`stage`). Modules are never moved
    for good. Offloaded modules live on the CPU; on CUDA their tensors are page-locked at their first
    stage (:func:`pin_memory_`'s packing, within its bound), in place.

    ``with placer.stage("transformer") as model: ...`` runs a stage.
    """

    def __init__(
        self, device: torch.device | str, components: dict[str, nn.Module], placements: dict[str, str],
        *, prefetch: int = 1,
    ) -> None:
        unknown = {p for p in placements.values()} - {"resident", "staged", "blocks"}
        if unknown:
            raise ValueError(f"unknown placements {sorted(unknown)}; use resident, staged or blocks")
        self.device = indexed_device(device)
        self.components = components
        self.placements = placements
        self.prefetch = prefetch

    def in_place(self, component: str) -> bool:
        """Whether :meth:`stage` runs ``component`` where it is: when its tensors are all on the
        device already, whatever its placement (else it is copied in, or its blocks streamed, for
        the stage only)."""
        return held_on(self.components[component], self.device)

    @contextlib.contextmanager
    def stage(self, component: str) -> Iterator[nn.Module]:
        module = self.components[component]
        placement = self.placements.get(component, "resident")
        here = self.in_place(component)
        if not here and not holds_float8(self.device) and any(is_fp8(t.dtype) for t in module_tensors(module)):
            # Copying them in would fail inside torch with a dtype message that names neither.
            raise ValueError(
                f"the {component.replace('_', ' ')} holds fp8 weights, which {self.device.type} cannot hold; load "
                f"it with quantize=klein_core.files.loaders.quantize_for(path, {component!r}, {self.device.type!r}) "
                "(its fp8 layers dequantised as it loads), or load it straight onto the device")
        if placement == "resident" and here:
            yield module
        elif placement in ("resident", "staged"):
            # A resident component that lives elsewhere is copied in for the stage, never moved for
            # good: the caller's module keeps its device. Its CPU tensors are page-locked first (once,
            # as streamed blocks are): a copy from ordinary memory runs synchronously through the
            # driver's bounce buffer, at a fraction of the bus's speed, every stage.
            if self.device.type == "cuda":  # (only CPU tensors: one on another GPU stays there)
                _pin_homes([s for s in _slots(module) if s.home.device.type == "cpu"],
                           f"{type(module).__name__} (copied in per stage)")
            with on_device(module, self.device):
                yield module
        elif here and self.device.type != "cpu":
            # Already on the device: streaming would copy every block to CPU memory, and the
            # detach leave them there (the model moved for good) or copy them back: neither helps.
            logger.warning("%s is already on %s, so it runs there as it is: streaming its blocks saves GPU "
                           "memory only for a %s held in CPU memory (load it on the CPU for that)",
                           component, self.device, component)
            yield module
        else:
            with BlockOffloader(module, self.device, prefetch=self.prefetch):
                yield module


def device_census(modules: Sequence[nn.Module], device: torch.device | str) -> tuple[list[bool], int]:
    """For each of ``modules`` whether it is :func:`held_on` ``device``, and the bytes their
    parameters and buffers occupy there (a tensor shared between them once): one walk of each. The
    planner asks both of every component on every run before the GPU has work, and walked each one
    twice for them."""
    device = torch.device(device)
    held, nbytes, seen = [], 0, set()
    same: dict[torch.device, bool] = {}
    for module in modules:
        here = True
        for t in module_tensors(module):
            d = t.device
            ok = same.get(d)
            if ok is None:
                ok = same[d] = _same_device(d, device)
            if not ok:
                here = False
            elif id(t) not in seen:
                seen.add(id(t))
                nbytes += t.nbytes
        held.append(here)
    return held, nbytes


def held_on(module: nn.Module, device: torch.device | str) -> bool:
    """Whether every tensor of ``module`` is on ``device`` ("cuda" is the current GPU)."""
    device = torch.device(device)
    return all(_same_device(d, device) for d in tensor_devices(module))


def offload_blocks(model: nn.Module, device: torch.device | str, *, prefetch: int = 1) -> BlockOffloader:
    """Attach a :class:`BlockOffloader` to ``model`` and return it (``.detach()`` to undo)."""
    return BlockOffloader(model, device, prefetch=prefetch).attach()


__all__ = [
    "BlockOffloader", "OffloadStats", "StagePlacer", "block_footprint", "device_census", "find_block_lists", "held_on",
    "module_bytes",
    "module_tensors",
    "offload_blocks", "on_device", "pin_memory_", "tensor_devices",
]
