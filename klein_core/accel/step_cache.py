"""Opt-in first-block step cache for base models (20-50 steps with CFG). Approximate; off by default.

:func:`enable_step_cache` attaches ``transformer.step_cache``, which ``sampling.denoise`` then uses;
``cache.last_run`` counts forwards computed and skipped; :func:`disable_step_cache` runs every block again.
Every forward runs double block 0 and accumulates ``acc += mean|r_i - r_{i-1}| / mean|r_{i-1}|``
(float32), ``r_i`` being block 0's image-stream residual over the noisy image tokens. While
``acc < threshold`` (outside ``warmup``, the last step and ``max_consecutive_skips``) the rest is
skipped: the output is ``final_layer(h0 + R)``, ``R`` the other blocks' residual stored at the last full
forward, which resets ``acc``. Each CFG pass keeps its own state; callers other than ``denoise`` must
call :meth:`StepCache.start_run` before a run (and may call :meth:`StepCache.finish_run` after it to
release the stored residuals at once; ``denoise`` does, and a pass releases its own after its last
step). The error depends on the threshold and the weights:
check it with :func:`relative_l2` against an uncached run. ``threshold=0`` never skips (bit-identical).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from ..models.transformer import BlockStack, Flux2Transformer

logger = logging.getLogger(__name__)

# Accumulated relative L1 change of block 0's residual below which the later blocks are skipped.
# 0.08 is ParaAttention's first-block-cache default for FLUX.1 (diffusers' ParaAttention guide;
# there the change is taken against the last full step, not accumulated). Not calibrated on
# trained Klein weights (none were available here): measure before relying on it.
DEFAULT_THRESHOLD = 0.08
# The first steps move the latents most (high noise); always computing them also gives the
# measure two full steps to start from.
DEFAULT_WARMUP = 2


@dataclass(frozen=True)
class StepCacheSettings:
    """What :func:`enable_step_cache` was asked for.

    ``threshold``: the accumulated relative change under which a forward skips (0 never skips);
    ``warmup``: how many first steps always run every block; ``max_consecutive_skips``: at most
    that many skipped forwards in a row per pass (None: no cap).
    """

    threshold: float = DEFAULT_THRESHOLD
    warmup: int = DEFAULT_WARMUP
    max_consecutive_skips: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(f"threshold must be a finite number >= 0, got {self.threshold!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        cap = self.max_consecutive_skips
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_consecutive_skips must be None or an int >= 1, got {cap!r}")


@dataclass(frozen=True)
class StepCacheStats:
    """Counters of the current (or last) run.

    ``steps``: the run's step count (None when the run was not begun by :meth:`StepCache.start_run`);
    ``computed`` / ``skipped``: forwards that ran every block / that reused the stored residual,
    summed over the passes; ``patterns``: one string per pass, one letter per forward in order
    (``C`` computed, ``S`` skipped), e.g. ``("CCSSCSSSC",)``; ``changes``: per pass, the relative
    change ``delta`` measured at each forward that could skip (after the warmup, before the last
    step), for calibrating ``threshold`` on real weights.
    """

    steps: int | None
    computed: int
    skipped: int
    patterns: tuple[str, ...]
    changes: tuple[tuple[float, ...], ...]

    @property
    def passes(self) -> int:
        """Forwards per step: 1 (no CFG, or batched CFG) or 2 (CFG over prompts of different lengths)."""
        return len(self.patterns)

    @property
    def forwards(self) -> int:
        return self.computed + self.skipped


@dataclass
class _Pass:
    """The state of one pass within a run."""

    prev_first: torch.Tensor | None = None  # block 0's residual at the previous step [B, n, D]
    prev_t: torch.Tensor | None = None  # that step's largest timestep (0-dim, on the device)
    residual: torch.Tensor | None = None  # later blocks' residual at the last full forward [B, N, D]
    accumulated: float = 0.0
    skips_in_row: int = 0
    pattern: list[str] = field(default_factory=list)
    changes: list[float] = field(default_factory=list)


class StepCache:
    """The step cache attached to one transformer as ``transformer.step_cache`` (see the module
    docstring for the rule). Built by :func:`enable_step_cache`."""

    def __init__(self, settings: StepCacheSettings) -> None:
        self.settings = settings
        self._steps: int | None = None
        self._noisy_tokens: int | None = None
        self._passes: dict[tuple[object, ...], _Pass] = {}
        self._logged = False

    def start_run(self, steps: int, noisy_tokens: int) -> None:
        """Forget every pass's state: a new run of ``steps`` steps begins whose first
        ``noisy_tokens`` image tokens are the noisy latents (the rest references)."""
        self._steps = steps
        self._noisy_tokens = noisy_tokens
        self._passes = {}
        self._logged = False

    def finish_run(self) -> None:
        """Release every pass's stored tensors (block 0's and the later blocks' residuals, on the
        device), keeping the counters in :attr:`last_run`. ``denoise`` calls it when a run ends, also
        when it is cancelled or fails."""
        for state in self._passes.values():
            _release(state)

    @property
    def last_run(self) -> StepCacheStats:
        """Counters of the current run, or the last one once it has finished."""
        patterns = tuple("".join(p.pattern) for p in self._passes.values())
        skipped = sum(p.count("S") for p in patterns)
        changes = tuple(tuple(p.changes) for p in self._passes.values())
        return StepCacheStats(self._steps, sum(map(len, patterns)) - skipped, skipped, patterns, changes)

    def run(
        self, blocks: BlockStack, x: torch.Tensor, c: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """Every block, or block 0 plus the stored residual: image tokens ``x [B, N, D]`` and text
        tokens ``c [B, L, D]`` in, the image tokens after the last block ``[B, N, D]`` out."""
        key = (tuple(x.shape), tuple(c.shape), str(x.device), x.dtype)
        state = self._passes.setdefault(key, _Pass())
        if self._steps is not None and len(state.pattern) >= self._steps:
            # A forward past its pass's last step: a new run begun without start_run(). Its length is
            # unknown, so the cache goes on as on a model that never had start_run (the last run's
            # step count would end the new run's passes early and keep them from skipping).
            logger.debug("step cache: a forward after the run's last step; a new run starts")
            self._steps = self._noisy_tokens = None
            self._passes, self._logged = {}, False
            state = self._passes.setdefault(key, _Pass())
        x0 = x
        x, c = blocks.double(0, x, c)
        n = min(self._noisy_tokens or x.shape[1], x.shape[1])
        first = x[:, :n] - x0[:, :n]  # [B, n, D]
        del x0  # the embeddings are not needed past block 0
        t = timesteps.detach().amax()
        skip = False
        if self._candidate(state):
            assert state.prev_first is not None and state.prev_t is not None
            # One sync per forward: the decision is Python control flow outside any compiled block.
            num, den, t_now, t_prev = torch.stack([
                (first - state.prev_first).abs().mean(dtype=torch.float32),
                state.prev_first.abs().mean(dtype=torch.float32),
                t.float(), state.prev_t.float(),
            ]).tolist()
            if t_now > t_prev:  # the timestep went up: a new run begun without start_run()
                logger.debug("step cache: timestep rose from %.4f to %.4f; the pass starts afresh",
                             t_prev, t_now)
                state = self._passes[key] = _Pass()
            else:
                delta = num / den if den > 0 else math.inf
                state.changes.append(delta)
                accumulated = state.accumulated + delta
                skip = accumulated < self.settings.threshold  # False for NaN
                if skip:
                    state.accumulated = accumulated
        elif (self._steps is None and self.settings.threshold > 0 and state.prev_t is not None
              and bool(t > state.prev_t)):
            # The same safety net for a forward that may not skip (its pass in its warmup, or at its
            # cap of skips in a row): else the next forward would count as the old run's. One sync,
            # only on such forwards of callers without start_run (a run begun with it cannot rise),
            # and never with threshold 0 (nothing skips then).
            logger.debug("step cache: timestep rose; the pass starts afresh")
            state = self._passes[key] = _Pass()
        state.prev_first, state.prev_t = first, t
        if skip:
            assert state.residual is not None
            out = x + state.residual
            state.skips_in_row += 1
        else:
            out = blocks.run(x, c, start=1)
            state.residual = out - x
            state.accumulated, state.skips_in_row = 0.0, 0
        state.pattern.append("S" if skip else "C")
        if self._steps is not None and len(state.pattern) >= self._steps:
            # The pass's last step: nothing reads its residuals again. Held on, they would keep
            # ~2 x [B, N, D] per pass on the device through decoding and between runs, memory the
            # planner does not count.
            _release(state)
        self._log_when_done()
        return out

    def _candidate(self, state: _Pass) -> bool:
        """Whether this forward of the pass may skip (before looking at the measure)."""
        s = self.settings
        step = len(state.pattern)
        if s.threshold <= 0 or state.residual is None or state.prev_first is None or step < s.warmup:
            return False
        if self._steps is not None and step >= self._steps - 1:  # the last step runs everything
            return False
        return s.max_consecutive_skips is None or state.skips_in_row < s.max_consecutive_skips

    def _log_when_done(self) -> None:
        if self._logged or self._steps is None:
            return
        if any(len(p.pattern) < self._steps for p in self._passes.values()):
            return
        self._logged = True
        st = self.last_run
        logger.info("step cache: %d of %d forwards skipped the blocks after the first (%d steps, %d pass%s, "
                    "threshold %g, warmup %d): %s", st.skipped, st.forwards, self._steps, st.passes,
                    "" if st.passes == 1 else "es", self.settings.threshold, self.settings.warmup,
                    " ".join(st.patterns))


def _release(state: _Pass) -> None:
    """Drop a pass's stored tensors; its pattern and measured changes stay for the counters."""
    state.prev_first = state.prev_t = state.residual = None


def enable_step_cache(
    transformer: Flux2Transformer,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    warmup: int = DEFAULT_WARMUP,
    max_consecutive_skips: int | None = None,
) -> StepCache:
    """Attach a first-block step cache to ``transformer`` (in place, replacing any earlier one); returns it.

    Args:
        threshold: skip the blocks after the first while block 0's residual has changed by less than
            this (accumulated relative L1); 0 never skips. The default is not calibrated on trained
            weights: check the error with :func:`relative_l2`.
        warmup: the first this many steps always run every block (so does the last).
        max_consecutive_skips: cap on skipped forwards in a row per pass (None: no cap).

    Composes with :func:`klein_core.accel.enable_fast_paths` (``compile=True`` too), in either order.
    """
    if not isinstance(transformer, Flux2Transformer):
        raise TypeError(f"enable_step_cache expects a Flux2Transformer, got {type(transformer).__name__}")
    if not len(transformer.double_blocks):
        raise ValueError("the step cache measures the first double block; this transformer has none")
    cache = StepCache(StepCacheSettings(threshold, warmup, max_consecutive_skips))
    transformer.step_cache = cache
    logger.info("step cache enabled (threshold %g, warmup %d, max consecutive skips %s): approximate",
                threshold, warmup, max_consecutive_skips)
    return cache


def disable_step_cache(transformer: Flux2Transformer) -> None:
    """Remove the step cache and its state: every block runs every forward again."""
    transformer.step_cache = None


def relative_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float64 (e.g. cached vs uncached latents, same shape)."""
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: {list(approx.shape)} vs {list(exact.shape)}")
    a, e = approx.detach().double().cpu(), exact.detach().double().cpu()
    return float((a - e).norm() / e.norm())


__all__ = [
    "DEFAULT_THRESHOLD", "DEFAULT_WARMUP", "StepCache", "StepCacheSettings", "StepCacheStats",
    "disable_step_cache", "enable_step_cache", "relative_l2",
]
