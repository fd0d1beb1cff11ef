"""The LoRA training loop: batches by shape, the objective, AdamW (8-bit when asked and
bitsandbytes is there), gradient checkpointing, checkpoints every N steps, exact resume, and
data-parallel gradient averaging when ``torch.distributed`` is initialised.

Every random draw of step ``s`` (batch order, noise, sigmas, reference dropout) comes from
generators seeded by ``(seed, s, sample position)``, never from global RNG state. So a checkpoint
(LoRA weights, optimizer state, step) resumes bit-exactly, and ``W`` processes that each take
``batch_size`` samples of one global batch see exactly the samples, noise and sigmas of one process
with ``W * batch_size``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..memory.placement import BlockOffloader
from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..pipeline.sampling import MAX_SEED
from .adapters import LoRASet, gradient_checkpointing
from .objective import ObjectiveConfig, sample_density, sigmas_for
from .state_file import load_state, save_state
from .step import StepNoise, TrainBatch, compute_loss, encode_text

logger = logging.getLogger(__name__)

OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit")
CHECKPOINT_FILE = "trainer_state.safetensors"
OLD_CHECKPOINT_FILE = "trainer_state.pt"  # what versions before the safetensors state wrote (a pickle)


@dataclass(frozen=True)
class TrainSample:
    """One cached sample: ``latents [1, C, h, w]``, ``text [1, L, D]`` prompt embeddings,
    ``references`` each ``[1, C, h_i, w_i]``; with a text-encoder LoRA, ``tokens`` (ids and mask,
    ``[1, L]`` each) instead of ``text``, encoded at every step."""

    latents: torch.Tensor
    text: torch.Tensor | None
    references: tuple[torch.Tensor, ...] = ()
    tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.text is None and self.tokens is None:
            raise ValueError("a training sample needs its prompt embeddings (text) or its tokens")

    @property
    def shape_key(self) -> tuple:
        text = self.text.shape if self.text is not None else self.tokens[0].shape  # type: ignore[index]
        return (tuple(self.latents.shape), tuple(text), tuple(tuple(r.shape) for r in self.references))


@dataclass(frozen=True)
class TrainConfig:
    """Loop settings. ``batch_size`` is per process; ``checkpoint_every`` 0 = no checkpoints;
    ``keep_checkpoints`` N > 0 deletes all but the newest N training states (each holds the LoRA and
    the optimizer's state, three times the LoRA's size)."""

    steps: int = 1000
    learning_rate: float = 1e-4
    batch_size: int = 1
    seed: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 0  # training states kept: the newest N (0 = all); sample images always stay
    gradient_checkpointing: bool = True
    optimizer: str = "adamw"
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    text_encoder_lr: float | None = None  # the text-encoder LoRA's learning rate; None: learning_rate
    reference_dropout: float = 0.0
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Sample images (the trainer's ``sampler``): every ``sample_every`` steps (0 = at each checkpoint)
    # and after the last step.
    sample_prompts: tuple[str, ...] = ()
    sample_every: int = 0
    sample_steps: int = 20
    sample_seed: int = 0
    sample_guidance: float | None = None  # None: the base model's default (CFG 4)
    sample_size: tuple[int, int] = (512, 512)  # (width, height) in pixels

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be positive, got {self.steps} and {self.batch_size}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not 0.0 <= self.reference_dropout <= 1.0:
            raise ValueError(f"reference_dropout must be in [0, 1], got {self.reference_dropout}")
        for name in ("learning_rate", "text_encoder_lr"):
            lr = getattr(self, name)
            if (name == "learning_rate" or lr is not None) and not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"{name} must be a positive number, got {lr}")
        for name in ("seed", "sample_seed"):  # checked here, not after the models load or the steps ran
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SEED:
                raise ValueError(f"{name} must be an integer from 0 to 2^64-1, got {v!r}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.sample_every < 0 or self.sample_steps < 1:
            raise ValueError(f"sample_every must be >= 0 and sample_steps >= 1, got {self.sample_every} "
                             f"and {self.sample_steps}")
        object.__setattr__(self, "sample_prompts", tuple(self.sample_prompts))
        object.__setattr__(self, "sample_size", tuple(self.sample_size))


#: Sample positions from here on draw from ``_seed(seed, step, position + _HIGH_POSITIONS)``: positions
#: 11 and 13 (0xB, 0xD) were the tags of the epoch order and the reference-dropout coin, which shared a
#: generator with them. Lower positions keep their seeds, so runs of global batches up to 11 resume
#: bit-exactly from checkpoints written before.
_FIRST_TAGGED_POSITION = 0xB
_HIGH_POSITIONS = 1 << 32


def _position_seed(seed: int, step: int, position: int) -> int:
    """The generator seed of sample ``position``'s noise and sigma at ``step``: distinct from every
    other stream of the run (the other positions, the dropout coin, every epoch's order)."""
    if position >= _FIRST_TAGGED_POSITION:
        position += _HIGH_POSITIONS
    return _seed(seed, step, position)


def _seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:  # FNV-1a over the parts: distinct, stable seeds per (seed, step, position)
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def batch_order(samples: Sequence[TrainSample], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's batches (sample indices), each of one shape (an aspect bucket): each bucket
    shuffled and cut into batches (a short tail batch is kept), then the batches shuffled."""
    g = torch.Generator().manual_seed(_seed(seed, epoch, 0xB))
    buckets: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        buckets.setdefault(s.shape_key, []).append(i)
    batches = []
    for key in sorted(buckets, key=repr):
        idx = buckets[key]
        perm = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
        batches += [perm[k:k + batch] for k in range(0, len(perm), batch)]
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def _make_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter],
                    text_params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    groups: list[dict] = [{"params": params}]
    if text_params:
        groups.append({"params": text_params, "lr": cfg.text_encoder_lr or cfg.learning_rate})
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]
        except ImportError:
            raise RuntimeError("optimizer 'adamw8bit' needs bitsandbytes (pip install bitsandbytes); "
                               "use optimizer 'adamw' without it") from None
        return bnb.optim.AdamW8bit(groups, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class StepReport:
    """What the progress callback gets after each step."""

    step: int
    total: int
    loss: float
    it_per_s: float
    eta_s: float


class Trainer:
    """Trains ``lora`` (attached to the frozen ``model`` for the trainer's lifetime; call
    :meth:`close` to detach) on ``samples``. ``output_dir`` receives ``checkpoint-<step>/``.

    ``on_step(report)`` runs after every step; returning False stops the run (cancel).

    ``sampler(folder, step)`` (e.g. :class:`klein_core.train.samples.CheckpointSampler`) writes sample
    images of ``config.sample_prompts`` into ``folder`` with the current LoRA; it runs on process 0
    at each checkpoint (or every ``config.sample_every`` steps) and after the last step, with the
    LoRA layers in eval mode, under ``torch.no_grad()`` and with the global RNG state restored
    afterwards, so the training run continues exactly as without it (every draw of a step comes
    from its own generators anyway).

    ``streamer``: a :class:`~klein_core.memory.placement.BlockOffloader` over ``model``'s blocks,
    attached with ``hooks=False`` (the frozen blocks stay in CPU memory and each is copied to the
    device only while it runs, forward and backward; the LoRA layers stay on the device). The
    caller detaches it. Streaming always uses gradient checkpointing. A sampler places the model
    itself (an :class:`~klein_core.pipeline.engine.Engine` with ``memory="blocks"`` streams it).

    ``text_encoder`` and ``text_lora``: a text-encoder LoRA trained alongside (the samples carry
    ``tokens``; each step encodes them through it, with gradients); ``text_streamer`` streams the
    text encoder's layers as ``streamer`` does the transformer's blocks.

    ``run_identity``: what else the run learns from (e.g. the dataset's hash, the base model), stored
    in each checkpoint with every setting that changes the result (learning rates, batch, optimizer,
    objective, LoRA targets, ranks and alphas); :meth:`resume` refuses a checkpoint whose values
    differ, naming them, instead of continuing a different run with this one's settings.
    """

    def __init__(self, model: Flux2Transformer, lora: LoRASet, samples: Sequence[TrainSample], config: TrainConfig,
                 *, output_dir: str | Path | None = None,
                 on_step: Callable[[StepReport], bool | None] | None = None,
                 sampler: Callable[[Path, int], Sequence[Path]] | None = None,
                 streamer: BlockOffloader | None = None, text_encoder: Qwen3TextEncoder | None = None,
                 text_lora: LoRASet | None = None, text_streamer: BlockOffloader | None = None,
                 run_identity: Mapping[str, object] | None = None) -> None:
        if not samples:
            raise ValueError("no training samples")
        if (text_encoder is None) != (text_lora is None):
            raise ValueError("a text-encoder LoRA needs its text encoder, and the text encoder its LoRA")
        if text_lora is not None and any(s.tokens is None for s in samples):
            raise ValueError("training a text-encoder LoRA needs the samples' tokens (TrainSample.tokens)")
        if text_lora is None and any(s.text is None for s in samples):
            raise ValueError("samples without prompt embeddings (text) need a text-encoder LoRA to encode them")
        self.model, self.lora, self.samples, self.config = model, lora, list(samples), config
        self.text_encoder, self.text_lora, self.text_streamer = text_encoder, text_lora, text_streamer
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.on_step = on_step
        self.sampler = sampler
        self.streamer = streamer
        self.sample_paths: list[Path] = []
        self.step = 0
        self.losses: list[float] = []
        self._per_epoch: int | None = None
        self._order: tuple[int, list[list[int]]] = (-1, [])
        model.requires_grad_(False)
        text_params = []
        if text_encoder is not None and text_lora is not None:
            text_encoder.requires_grad_(False)
            text_params = list(text_lora.parameters())
        self.params = [*lora.parameters(), *text_params]  # the transformer's first, then the text encoder's
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = _make_optimizer(config, list(lora.parameters()), text_params)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.run_identity = self._identity(run_identity or {})
        lora.attach(model)
        if text_lora is not None:
            text_lora.attach(text_encoder)  # type: ignore[arg-type]

    def _identity(self, extra: Mapping[str, object]) -> dict:
        """The settings a checkpoint must share with a run resuming it, as plain JSON values (``steps``
        and the sample, checkpoint and memory settings are left out: a resumed run may change them)."""
        cfg = self.config
        ident = {"learning_rate": cfg.learning_rate,
                 "text_encoder_lr": (cfg.text_encoder_lr or cfg.learning_rate) if self.text_lora else None,
                 "global_batch_size": cfg.batch_size * self.world, "optimizer": cfg.optimizer,
                 "weight_decay": cfg.weight_decay, "betas": cfg.betas, "eps": cfg.eps,
                 "max_grad_norm": cfg.max_grad_norm, "reference_dropout": cfg.reference_dropout,
                 "objective": asdict(cfg.objective), "lora_targets": self.lora.config.description,
                 "text_encoder_lora_targets": self.text_lora.config.description if self.text_lora else None,
                 "samples": len(self.samples), **extra}
        return json.loads(json.dumps(ident, default=str))  # tuples as lists: as a checkpoint reads back

    def close(self) -> None:
        self.lora.detach()
        if self.text_lora is not None:
            self.text_lora.detach()

    def _lora_sets(self) -> list[LoRASet]:
        return [self.lora] + ([self.text_lora] if self.text_lora is not None else [])

    # -- data ---------------------------------------------------------------------------------

    def _global_batch(self, step: int) -> list[int]:
        """Sample indices of step ``step``'s global batch (``world * batch_size`` of one shape)."""
        want = self.config.batch_size * self.world
        if self._per_epoch is None:  # batches per epoch depend on the bucket sizes only
            self._per_epoch = len(batch_order(self.samples, want, self.config.seed, 0))
        epoch, k = divmod(step, self._per_epoch)
        if self._order[0] != epoch:
            self._order = (epoch, batch_order(self.samples, want, self.config.seed, epoch))
        return self._order[1][k]

    def _batch(self, step: int) -> tuple[TrainBatch, StepNoise] | None:
        cfg = self.config
        idx = self._global_batch(step)
        lo = self.rank * cfg.batch_size
        mine = list(range(len(idx)))[lo:lo + cfg.batch_size]
        if not mine:
            return None
        drop = cfg.reference_dropout > 0 and bool(
            torch.rand(1, generator=torch.Generator().manual_seed(_seed(cfg.seed, step, 0xD)), dtype=torch.float32)
            < cfg.reference_dropout)
        noise, u = [], []
        for j in mine:
            g = torch.Generator().manual_seed(_position_seed(cfg.seed, step, j))
            noise.append(torch.randn(self.samples[idx[j]].latents.shape, generator=g, dtype=torch.float32))
            u.append(sample_density(cfg.objective, 1, g))
        pick = [self.samples[idx[j]] for j in mine]
        refs = () if drop else tuple(torch.cat([s.references[r] for s in pick]) for r in range(len(pick[0].references)))
        if self.text_encoder is not None:  # encoded now, through the text-encoder LoRA (with gradients)
            ids = torch.cat([s.tokens[0] for s in pick])  # type: ignore[index]
            mask = torch.cat([s.tokens[1] for s in pick])  # type: ignore[index]
            with gradient_checkpointing(self.text_encoder, self.config.gradient_checkpointing,
                                        streamer=self.text_streamer):
                text = encode_text(self.text_encoder, ids, mask)
        else:
            text = torch.cat([s.text for s in pick])  # type: ignore[misc]
        batch = TrainBatch(torch.cat([s.latents for s in pick]), text, refs)
        sigmas, timesteps = sigmas_for(cfg.objective, torch.cat(u))
        return batch, StepNoise(torch.cat(noise), sigmas, timesteps)

    # -- steps --------------------------------------------------------------------------------

    def _share(self, step: int) -> float:
        """This process's share of the global batch (its samples / all samples of the step)."""
        n = len(self._global_batch(step))
        lo = self.rank * self.config.batch_size
        return max(0, min(self.config.batch_size, n - lo)) / n

    def train_step(self) -> float:
        """One optimizer step; returns the global batch's mean loss."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        got = self._batch(self.step)
        share = self._share(self.step)
        loss_value = torch.zeros((), dtype=torch.float64)
        if got is not None:
            batch, rnd = got
            with gradient_checkpointing(self.model, cfg.gradient_checkpointing, streamer=self.streamer):
                loss, _ = compute_loss(self.model, batch, rnd, cfg.objective)
                (loss * share).backward()  # the global mean = sum over processes of share * local mean
            loss_value = loss.detach().double().cpu() * share
        if self.world > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            dist.all_reduce(loss_value)
        # Checked before the optimizer step: a NaN/inf loss or gradient must not reach the LoRA weights
        # (a later checkpoint would store them), so the weights stay those of the last good step.
        value = float(loss_value)
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss became {value} at step {self.step + 1}; the LoRA keeps the weights "
                                     f"of step {self.step}. Lower the learning rate, or check the data")
        if cfg.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            if not math.isfinite(norm):
                raise FloatingPointError(f"the gradients became {norm} at step {self.step + 1}; the LoRA keeps the "
                                         f"weights of step {self.step}. Lower the learning rate")
        self.optimizer.step()
        self.step += 1
        self.losses.append(value)
        return value

    def train(self, until: int | None = None) -> list[float]:
        """Run to step ``until`` (default: ``config.steps``), checkpointing every
        ``checkpoint_every`` steps. Returns the losses of the steps run now."""
        end = self.config.steps if until is None else min(until, self.config.steps)
        start, t0 = self.step, time.perf_counter()
        out: list[float] = []
        if start == self.config.steps and until is None:
            # Resumed at its last step (queued again, e.g. with other sample prompts): nothing to train.
            # The final LoRA's sample images are made for the prompts given now, and the step is
            # reported, so a progress bar shows N of N rather than nothing.
            if self._sample_due(False):
                self.sample_images()
            if self.on_step is not None and self.losses:
                self.on_step(StepReport(self.step, self.config.steps, self.losses[-1], 0.0, 0.0))
            return out
        while self.step < end:
            out.append(self.train_step())
            every = self.config.checkpoint_every
            checkpoint_now = bool(every and self.step % every == 0 and self.output_dir is not None)
            if checkpoint_now:
                self.save_checkpoint()
            if self._sample_due(checkpoint_now):
                self.sample_images()
            rate = (self.step - start) / max(time.perf_counter() - t0, 1e-9)
            report = StepReport(self.step, self.config.steps, out[-1], rate, (self.config.steps - self.step) / rate)
            logger.debug("step %d/%d loss %.5f %.2f it/s", report.step, report.total, report.loss, rate)
            if self.on_step is not None and self.on_step(report) is False:
                logger.info("training stopped at step %d", self.step)
                break
        return out

    # -- sample images ------------------------------------------------------------------------

    def _sample_due(self, checkpoint_now: bool) -> bool:
        cfg = self.config
        if self.sampler is None or not cfg.sample_prompts or self.output_dir is None:
            return False
        if self.step == cfg.steps:  # the final LoRA is always shown
            return True
        return self.step % cfg.sample_every == 0 if cfg.sample_every else checkpoint_now

    def sample_images(self, folder: str | Path | None = None) -> list[Path]:
        """Run the sampler now (process 0 only) into ``folder`` (default ``output_dir/checkpoint-<step>``,
        beside the checkpoint's state). Returns the files written."""
        if self.sampler is None or self.rank != 0:
            return []
        folder = Path(folder) if folder is not None else (self.output_dir or Path(".")) / f"checkpoint-{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        sets = self._lora_sets()
        was_training = [s.training for s in sets]
        device = self.model.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        for s in sets:
            s.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                paths = [Path(p) for p in self.sampler(folder, self.step)]
        finally:
            for s, mode in zip(sets, was_training):
                s.train(mode)
        self.sample_paths += paths
        logger.info("sample images at step %d: %s", self.step, ", ".join(p.name for p in paths))
        return paths

    # -- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        state = {"step": self.step, "lora": {k: v.detach().clone() for k, v in self.lora.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "losses": list(self.losses),
                 "seed": self.config.seed, "torch_rng": torch.get_rng_state(),
                 "run_identity": json.dumps(self.run_identity)}
        if self.text_lora is not None:
            state["text_lora"] = {k: v.detach().clone() for k, v in self.text_lora.state_dict().items()}
        return state

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write ``checkpoint-<step>/trainer_state.safetensors`` (LoRA, optimizer, step, losses, RNG) under
        ``output_dir`` (or to ``path``); only process 0 writes. Returns the folder."""
        folder = Path(path) if path is not None else (self.output_dir or Path(".")) / f"checkpoint-{self.step}"
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            save_state(self.state(), folder / CHECKPOINT_FILE)
            logger.info("checkpoint at step %d: %s", self.step, folder)
            if path is None and self.config.keep_checkpoints and self.output_dir is not None:
                self._prune_checkpoints(folder)
        return folder

    def _prune_checkpoints(self, newest: Path) -> None:
        """Delete the training states of all but ``keep_checkpoints`` checkpoints of ``output_dir``:
        ``newest`` (just written) and the latest others. Their folders, and any sample images in them,
        stay."""
        found = [(n, folder / CHECKPOINT_FILE) for n, folder in checkpoints(self.output_dir or ".") if folder != newest]
        keep_others = self.config.keep_checkpoints - 1
        for _, state in found[:max(0, len(found) - keep_others)]:  # (a negative end cut from the front)
            state.unlink(missing_ok=True)
            logger.info("removed the older training state %s (keep_checkpoints=%d)", state,
                        self.config.keep_checkpoints)

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint folder (or its ``trainer_state.safetensors``): weights, optimizer, step."""
        path = Path(path)
        file = path / CHECKPOINT_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no training checkpoint at {path} (expected {CHECKPOINT_FILE})")
        state = load_state(file)
        if state["seed"] != self.config.seed:
            raise ValueError(f"{file}: this checkpoint was trained with seed {state['seed']}, not "
                             f"{self.config.seed}; resume with the same seed")
        if ("text_lora" in state) != (self.text_lora is not None):
            what = ("has a text-encoder LoRA and this run does not train one" if "text_lora" in state
                    else "has no text-encoder LoRA and this run trains one")
            raise ValueError(f"{file}: this checkpoint {what}; resume with the same text-encoder LoRA settings")
        fit = _lora_mismatch(state, self.lora, self.text_lora)
        if fit is not None:  # before the settings: a rank or target change is said in these words
            raise ValueError(f"{file}: this checkpoint's LoRA does not fit this run ({fit}); resume with the "
                             "preset, rank, targets and text-encoder rank it was trained with")
        if "run_identity" in state:
            saved = json.loads(state["run_identity"])
            changed = [f"{k} {saved[k]!r} -> {self.run_identity[k]!r}" for k in saved
                       if k in self.run_identity and saved[k] != self.run_identity[k]]
        else:  # written before it was recorded: what its optimizer recorded, which loading it would impose
            changed = _optimizer_changes(state.get("optimizer"), self.optimizer)
        if changed:
            raise ValueError(f"{file}: this checkpoint was trained with other settings than this run ("
                             f"{'; '.join(changed)}); resuming would mix two runs. Resume with the settings it "
                             "was trained with, or start a new run (another output, or without resuming)")
        if int(state["step"]) > self.config.steps:
            raise ValueError(f"{file}: this checkpoint is at step {int(state['step'])}, past this run's "
                             f"{self.config.steps} steps; resume with steps {int(state['step'])} or more, or from "
                             "an earlier checkpoint")
        try:
            self.lora.load_state_dict(state["lora"])
            if self.text_lora is not None:
                self.text_lora.load_state_dict(state["text_lora"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:  # other modules or shapes than this run's LoRA
            first = str(exc).strip().splitlines()[0]
            raise ValueError(f"{file}: this checkpoint's LoRA does not fit this run ({first}); resume with the "
                             "preset, rank, targets and text-encoder rank it was trained with") from None
        self.step, self.losses = int(state["step"]), list(state["losses"])
        torch.set_rng_state(state["torch_rng"])
        logger.info("resumed from %s at step %d", file, self.step)


_GROUP_SETTINGS = {"lr": "learning_rate", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}


def _optimizer_changes(saved: object, optimizer: torch.optim.Optimizer) -> list[str]:
    """The settings (learning rate, betas, eps, weight decay) in which a checkpoint's optimizer state
    differs from ``optimizer``'s, as ``"name old -> new"``; loading the state would replace this run's."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return []
    changed = []
    for i, (old, new) in enumerate(zip(groups, optimizer.param_groups)):
        for key, name in _GROUP_SETTINGS.items():
            if i == 1 and key == "lr":
                name = "text_encoder_lr"
            a, b = json.loads(json.dumps(old.get(key))), json.loads(json.dumps(new.get(key)))
            if key in old and a != b:
                changed.append(f"{name} {a!r} -> {b!r}")
    return changed


def _lora_mismatch(state: dict, lora: LoRASet, text_lora: LoRASet | None) -> str | None:
    """The first difference between a checkpoint's LoRA tensors and this run's (names, shapes), or None."""
    for key, target in (("lora", lora), ("text_lora", text_lora)):
        if target is None or not isinstance(state.get(key), dict):
            continue
        mine = {k: tuple(v.shape) for k, v in target.state_dict().items()}
        saved = {k: tuple(v.shape) for k, v in state[key].items() if isinstance(v, torch.Tensor)}
        for k in sorted(mine.keys() | saved.keys()):
            if k not in saved:
                return f"{key} {k} is missing from the checkpoint"
            if k not in mine:
                return f"{key} {k} is not in this run's LoRA"
            if mine[k] != saved[k]:
                return f"{key} {k}: {list(saved[k])} in the checkpoint, {list(mine[k])} in this run"
    return None


def checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """``(n, folder)`` of every ``checkpoint-<n>`` in ``folder`` that holds a training state, by ``n``
    (none when ``folder`` cannot be read)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    return sorted((int(m.group(1)), e) for e in entries
                  if (m := re.fullmatch(r"checkpoint-(\d+)", e.name)) and (e / CHECKPOINT_FILE).is_file())


def latest_checkpoint(folder: str | Path, steps: int | None = None) -> Path | None:
    """The ``checkpoint-<n>`` folder of ``folder`` with the highest ``n`` (at most ``steps``) that holds
    a training state, or None."""
    found = [path for n, path in checkpoints(folder) if steps is None or n <= steps]
    if not found and (old := _old_checkpoints(folder)):
        # Said, not passed over: a run starting at step 0 here would write its checkpoints beside them.
        raise ValueError(f"{old[-1]} holds a training state written by an earlier version ({OLD_CHECKPOINT_FILE}), "
                         "which this version cannot resume; finish that run with the version that started it, "
                         f"or move {Path(folder)} away to start afresh")
    return found[-1] if found else None


def _old_checkpoints(folder: str | Path) -> list[Path]:
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), e / OLD_CHECKPOINT_FILE) for e in entries
             if (m := re.fullmatch(r"checkpoint-(\d+)", e.name))
             and (e / OLD_CHECKPOINT_FILE).is_file() and not (e / CHECKPOINT_FILE).is_file()]
    return [path for _, path in sorted(found)]


def config_dict(cfg: TrainConfig) -> dict:
    """The config as plain JSON-able data (for metadata)."""
    return asdict(cfg)
