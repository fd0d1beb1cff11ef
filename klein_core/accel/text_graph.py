"""CUDA-graph replay of the text encoder's forward: its compiled forward under ``speed="compile"``, its
plain forward under ``speed="fast"`` (``enable_fast_text_encoder(te, compile=False, graphs=True)``).

Why: even compiled, the text stage is bound by the host. On an H100 (2026-11-27,
``benchmarks/results/2026-11-27_h100``) the compiled encoder took 25.8 ms for one 512-token prompt
whose matmuls are a few milliseconds of GPU work: the host launches the 27 layers' kernels more
slowly than the GPU runs them. Klein's prompts are always padded to the same length, so the forward
has one shape per batch size, the case CUDA graphs are made for: the kernels are recorded once and
replayed with one launch. Measured on an H100 (2026-11-27, ``benchmarks/results/2026-11-27_h100_textgraph``):
the plain forward's text stage 40.1 ms eager, 14.0 ms replayed, the same bits.

A graph is recorded per ``[batch, length]``, input dtypes and padding side, at the first encode of
that shape (two warm-up forwards on a side stream, compilation included, then the capture), and
replayed while the encoder's weights stay at the same device addresses: every call compares the
address, dtype and shape of each parameter and buffer (about 300 tensors at 4B) with the graph's, so
weights moved, replaced or staged elsewhere are re-recorded, never read from stale memory (after
:data:`MAX_MOVES` such moves, as a staged encoder makes on every run, replay is given up for the
encoder). Weights changed in place (a merged LoRA) are read as they are at replay. At most :data:`MAX_GRAPHS` graphs
are kept per encoder (each holds its own activation memory, tens of MB for a 512-token prompt;
0.07 GiB more at the peak of a 4B run on an H100), and none once the encoder runs off the GPU:
they are recorded again on its return. A host about to offload the encoder drops them first
(:func:`release_text_graphs`; the pack's ComfyUI model patcher does, counted as a move), and an
engine stage that copies the encoder in for that stage only, or streams it, runs it eagerly
(:meth:`GraphedTextForward.suspended`): its memory plan does not count graph memory.

Eager (the class's forward, compiled layers and all) whenever replay could differ from it: with
autograd on, an ``activations`` dtype (per-layer casts), a mask whose padding side is not known on
the host, a device other than CUDA, weights off the input's device (streamed blocks), or any hook on
the encoder's modules other than the compile timer's (a LoRA branch, a cast, block streaming).
A capture failure turns replay off for that encoder with one warning; the call runs eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.qwen3 import Qwen3TextEncoder

logger = logging.getLogger(__name__)

MAX_GRAPHS = 2
"""Graphs kept per encoder: one prompt, and a prompt with its negative (batch 1 and 2)."""

MAX_MOVES = 2
"""Times the weights may turn up at new addresses before replay is given up for the encoder (a
staged encoder is copied in anew for each run: it would record a graph every time)."""

NOT_CUDA = "not on a CUDA device"
STAGED = "its weights are on the device for this stage only"

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


@dataclass
class _Graph:
    replay: Callable[[], None]  # the recorded CUDA graph's replay (its memory lives as long as it)
    ids: torch.Tensor  # the static inputs the graph reads
    mask: torch.Tensor
    out: torch.Tensor  # the static output it writes (overwritten at every replay: callers get a copy)
    weights: tuple[Hashable, ...]


class GraphedTextForward:
    """The instance ``forward`` of a :class:`Qwen3TextEncoder` with replay on (same signature as
    :meth:`Qwen3TextEncoder.forward`): CUDA-graph replay where it gives the eager result, else the
    eager forward (the class's, with compiled layers under ``compile``). ``captures`` / ``replays``
    count what it did."""

    def __init__(self, encoder: Qwen3TextEncoder, allowed_hooks: frozenset[int] = frozenset()) -> None:
        self.encoder = encoder
        self.allowed_hooks = allowed_hooks  # ids of hooks that only observe (the compile timer's)
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self.disabled: str | None = None
        self.captures = 0
        self.replays = 0
        self.moves = 0  # times the weights were found at new addresses (or were released)
        self._suspended = 0  # open suspended() blocks: every call runs eagerly
        # One graph's inputs and output are shared buffers: callers in two threads (a serve replica
        # running two batches) take turns from writing the inputs to copying the output out.
        self._lock = threading.RLock()  # reentrant: a failed capture resets inside it

    def klein_rebind(self, copy: nn.Module) -> GraphedTextForward:
        """A shallow copy of the encoder (``with_loras``) gets its own graphs, never this one's."""
        return GraphedTextForward(copy, self.allowed_hooks)  # type: ignore[arg-type]

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedTextForward:
        # A deep copy of the encoder gets its own forward, bound to that copy; graphs and the lock
        # cannot be copied (and must not be shared).
        return GraphedTextForward(copy.deepcopy(self.encoder, memo), self.allowed_hooks)

    def reset(self) -> None:
        """Drop every graph (their memory is freed with them)."""
        with self._lock:
            self.graphs.clear()

    def release(self) -> None:
        """The encoder's weights leave the device (a host offloads it): drop the graphs, whose
        memory would otherwise stay on the device unused, and count a move, as weights coming back
        at new addresses would (after :data:`MAX_MOVES` replay is given up, so an encoder offloaded
        for every run does not record every time)."""
        with self._lock:
            if self.graphs:
                self.graphs.clear()
                self._moved()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Calls inside run eagerly and record nothing, and graphs held are dropped: for an encoder
        copied onto the device for one stage (a memory plan that stages it), whose graph memory the
        plan does not count and whose weights leave again after the stage."""
        with self._lock:
            self._suspended += 1
            self.graphs.clear()
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def _moved(self) -> bool:
        """Count a move; True (and replay given up, said once) past :data:`MAX_MOVES`."""
        self.moves += 1
        if self.moves > MAX_MOVES and self.disabled is None:  # moved in and out: recording never pays
            self.disabled = "its weights move between calls"
            logger.info("text encoder: %s (staged on the device per run); no CUDA graph replay", self.disabled)
        return self.disabled is not None

    def _eager(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return type(self.encoder).forward(self.encoder, *args, **kwargs)

    def ineligible(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   activations: torch.dtype | None, left_padded: bool | None) -> str | None:
        """Why this call runs eagerly (None: it may replay, if the weights are on the input's device)."""
        return self._check(input_ids, attention_mask, activations, left_padded)[0]

    def _check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, activations: torch.dtype | None,
               left_padded: bool | None) -> tuple[str | None, tuple[Hashable, ...] | None]:
        """(why this call runs eagerly, the weights' key): one walk over the encoder's modules for
        their hooks and the address, dtype and shape of each parameter and buffer (the key is None
        if one is off the input's device). It runs before every encode, on the host while the GPU
        waits: one walk, not two (about 1.5 ms on a slow host for the 4B encoder)."""
        if self.disabled is not None:
            return self.disabled, None
        if self._suspended:
            return STAGED, None
        if torch.is_grad_enabled():
            return "autograd is on", None
        if activations is not None:
            return "an activations dtype casts the weights per layer", None
        if left_padded is None:
            return "the padding side is not known on the host", None
        for name in _GLOBAL_HOOKS:
            if getattr(torch.nn.modules.module, name, None):
                return "global module hooks are set", None
        device = input_ids.device
        key: list[Hashable] | None = []
        for module in self.encoder.modules():
            for name in _HOOK_DICTS:
                hooks = getattr(module, name, None)
                if hooks and any(k not in self.allowed_hooks for k in hooks):
                    return f"a hook on {type(module).__name__}", None
            if key is not None:
                for t in itertools.chain(module._parameters.values(), module._buffers.values()):
                    if t is None:
                        continue
                    if t.device != device:
                        key = None  # still walked on: a hook further down is the reason to give
                        break
                    key.append((t.data_ptr(), t.dtype, t.shape))
        weights = None if key is None else tuple(key)
        if torch.is_autocast_enabled(device.type):  # a graph replays the kernels chosen when it was recorded
            return "autocast is on", weights
        if device.type != "cuda" or attention_mask.device != device:
            return NOT_CUDA, weights
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return "inside another compilation or capture", weights
        return None, weights

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 activations: torch.dtype | None = None, *, left_padded: bool | None = None) -> torch.Tensor:
        why, weights = self._check(input_ids, attention_mask, activations, left_padded)
        if why is not None:
            if input_ids.device.type != "cuda":
                self.reset()  # the encoder left the GPU (offloaded): its graphs' memory would sit there unused
            return self._eager(input_ids, attention_mask, activations, left_padded=left_padded)
        if weights is None:  # some weights elsewhere (streamed, partly offloaded): same as above
            self.reset()
            return self._eager(input_ids, attention_mask, activations, left_padded=left_padded)
        with self._lock:
            return self._replay(input_ids, attention_mask, activations, left_padded, weights)

    def _replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, activations: torch.dtype | None,
                left_padded: bool | None, weights: tuple[Hashable, ...]) -> torch.Tensor:
        key = (tuple(input_ids.shape), input_ids.dtype, attention_mask.dtype, str(input_ids.device),
               bool(left_padded))
        entry = self.graphs.get(key)
        if entry is not None and entry.weights != weights:
            entry = None
        if entry is None:
            # graphs recorded on other weights (moved, replaced) are stale for good
            stale = [k for k, g in self.graphs.items() if g.weights != weights]
            for k in stale:
                del self.graphs[k]
            if stale and self._moved():
                return self._eager(input_ids, attention_mask, activations, left_padded=left_padded)
            entry = self._capture(input_ids, attention_mask, bool(left_padded), weights)
            if entry is None:
                return self._eager(input_ids, attention_mask, activations, left_padded=left_padded)
            self.graphs[key] = entry
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        # Under inference mode in place: inputs recorded under ComfyUI's inference mode are
        # inference tensors, which may not be written outside it (a later call under no_grad).
        with torch.inference_mode():
            entry.ids.copy_(input_ids)
            entry.mask.copy_(attention_mask)
        entry.replay()
        self.replays += 1
        return entry.out.clone()

    def _capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, left_padded: bool,
                 weights: tuple[Hashable, ...]) -> _Graph | None:
        ids, mask = input_ids.clone(), attention_mask.clone()
        try:
            replay, out = self._record(ids, mask, left_padded)
        except Exception as exc:  # noqa: BLE001 - any failure: eager from now on, said once
            self.disabled = f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            self.reset()
            logger.warning("CUDA graph of the text encoder: %s; it runs without replay from now on", self.disabled)
            return None
        self.captures += 1
        logger.info("text encoder: CUDA graph recorded for input %s on %s", list(input_ids.shape), input_ids.device)
        return _Graph(replay, ids, mask, out, weights)

    def _record(self, ids: torch.Tensor, mask: torch.Tensor, left_padded: bool
                ) -> tuple[Callable[[], None], torch.Tensor]:
        """The forward on the static inputs ``ids`` / ``mask`` recorded as a CUDA graph: its replay
        function, and the output tensor each replay writes."""
        device = ids.device
        # Warm-up on a side stream, as torch.cuda.graphs asks: compilation, autotuning and the
        # kernels' lazy set-up happen here, not inside the capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager(ids, mask, None, left_padded=left_padded)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._eager(ids, mask, None, left_padded=left_padded)
        return graph.replay, out


def graphed_forward(encoder: nn.Module) -> GraphedTextForward | None:
    """The encoder's :class:`GraphedTextForward`, if replay is set up on it."""
    forward = encoder.__dict__.get("forward")
    return forward if isinstance(forward, GraphedTextForward) else None


def release_text_graphs(model: nn.Module) -> None:
    """Drop the CUDA graphs of ``model``'s text encoder, if it replays any (see
    :meth:`GraphedTextForward.release`): for a host about to move ``model`` off the device. ``model``
    may be the encoder or hold it (any module around it); other models are left alone."""
    for module in model.modules():
        forward = graphed_forward(module)
        if forward is not None:
            forward.release()


__all__ = ["MAX_GRAPHS", "MAX_MOVES", "GraphedTextForward", "graphed_forward", "release_text_graphs"]
