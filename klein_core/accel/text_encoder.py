"""The text encoder under ``speed="compile"``: its decoder layers compiled, one graph for all 27.

Why: the eager Qwen3 forward is bound by the host, not the GPU. A 512-token prompt runs about
2,400 PyTorch operations through the 27 layers (about 90 per layer: every RMSNorm is six, the
rotary embedding of q and k fourteen; counted with a dispatch counter on the CPU, the count does
not depend on the device), while its matmuls are about 2.8 TFLOP, a few milliseconds of an H100.
The text stage measured 22-24 ms there on every eager speed, plain and fast alike
(``benchmarks/results/2026-11-26_h100_gpupass``), and twice that under the profiler, which slows
the host and not the GPU. Compiled, each layer's norms, rotary embedding and SwiGLU fuse into a few
kernels. On an H100 (2026-11-27) the compiled stage took 25.8 ms: no gain, still host-bound.

Only each layer's ``forward`` is compiled: the encoder's own forward (token embedding, RoPE tables,
the attention mask) stays eager, and so do hooks on the layers themselves (block streaming, the
per-layer casts of ``activations=float32``). LoRA branches on the layers' Linears are traced with
them, their hooks guarded (a LoRA copy compiles its own graph). A compiler failure re-runs the call
eagerly and turns compilation off for the encoder with one warning.

So on CUDA the whole forward is also replayed as a CUDA graph per prompt shape (:mod:`.text_graph`).
The ``fast`` speed replays the plain forward that way, uncompiled (``compile=False, graphs=True``):
on an H100 the text stage took 14.0 ms against 40.1 ms eager, with the same bits
(``benchmarks/results/2026-11-27_h100_textgraph``).
"""

from __future__ import annotations

import logging

from ..models.qwen3 import Qwen3TextEncoder
from .fast import CUSTOM_SPEED, SPEED_ATTR, _compile_group, _CompileTimer, _remove_hooks, _uncompile
from .text_graph import GraphedTextForward, graphed_forward

logger = logging.getLogger(__name__)

_HOOKS = "_klein_text_compile_hooks"


def enable_fast_text_encoder(
    encoder: Qwen3TextEncoder,
    *,
    compile: bool = True,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
    graphs: bool | None = None,
) -> None:
    """Compile the decoder layers of ``encoder`` in place (``compile=False``: the plain path).

    The first encode at each ``[batch, length]`` (and ``activations`` dtype) compiles, logged with
    its duration; torch's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) keeps the result for later
    processes. ``compile_mode`` / ``compile_backend``: ``torch.compile``'s ``mode`` and ``backend``.
    ``graphs``: on CUDA, replay each prompt shape's forward as a CUDA graph
    (:mod:`klein_core.accel.text_graph`: recorded at the first encode of the shape, eager wherever
    replay could differ); None (the default) is ``compile``. ``compile=False, graphs=True`` replays
    the plain forward (what ``speed="fast"`` sets).
    """
    if not isinstance(encoder, Qwen3TextEncoder):
        raise TypeError(f"enable_fast_text_encoder expects a Qwen3TextEncoder, got {type(encoder).__name__}")
    disable_fast_text_encoder(encoder)
    graphs = compile if graphs is None else graphs
    if not compile:
        if graphs:
            encoder.forward = GraphedTextForward(encoder)  # type: ignore[method-assign]
            encoder.__dict__[SPEED_ATTR] = CUSTOM_SPEED  # apply_speed names its own speed after this
            # debug: nothing is replayed yet (nor ever on the CPU); text_graph logs each graph it records
            logger.debug("text encoder: CUDA graph replay of the plain forward set up")
        return
    _compile_group(list(encoder.layers), "text encoder layers", mode=compile_mode, backend=compile_backend)
    # Timed from the first layer's call to the last one's return (``encode`` calls ``forward``
    # directly, so hooks on the encoder itself would never run).
    timer = _CompileTimer()
    hooks = [(0, encoder.layers[0].register_forward_pre_hook(timer.pre, with_kwargs=True)),
             (-1, encoder.layers[-1].register_forward_hook(timer.post, with_kwargs=True))]
    encoder.__dict__[_HOOKS] = hooks
    if graphs:
        encoder.forward = GraphedTextForward(encoder, frozenset(h.id for _, h in hooks))  # type: ignore[method-assign]
    logger.info("torch.compile (%s) enabled for the %d text encoder layers (mode=%s); compiled on first use",
                compile_backend, len(encoder.layers), compile_mode or "default")
    encoder.__dict__[SPEED_ATTR] = CUSTOM_SPEED


def disable_fast_text_encoder(encoder: Qwen3TextEncoder) -> None:
    """Back to the plain path: no compiled layers, no timing hooks."""
    encoder.__dict__.pop(SPEED_ATTR, None)
    if graphed_forward(encoder) is not None:
        del encoder.__dict__["forward"]
    for layer in encoder.layers:
        _uncompile(layer)
    for index, handle in encoder.__dict__.pop(_HOOKS, ()):
        _remove_hooks(encoder.layers[index], [handle])  # this encoder's layer, also in a LoRA copy


__all__ = ["disable_fast_text_encoder", "enable_fast_text_encoder"]
