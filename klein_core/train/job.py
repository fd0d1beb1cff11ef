"""One training job from files: scan the dataset, encode it through the caches (the VAE and text
encoder are then dropped), train a LoRA on the frozen base transformer, write the ``.safetensors``.

Shared by the CLI (``python -m klein_core train``) and the ComfyUI node. The LoRA file is written
only when every step ran: a cancelled or failed run leaves no file at the output path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..accel.speed import DEFAULT_SPEED, apply_speed, check_speed
from ..files.atomic import unwritable
from ..files.loaders import load_text_encoder, load_transformer, load_vae, quantize_for
from ..memory.placement import BlockOffloader
from ..pipeline.prompts import encoder_identity
from ..pipeline.tokenizer import tokenize_prompts
from .adapters import LoRASet, preset, text_encoder_preset
from .data import Encoders, build_samples, dataset_hash, require_base_model, scan_dataset
from .save import FORMATS, check_format_names, save_lora
from .trainer import StepReport, TrainConfig, Trainer, latest_checkpoint

logger = logging.getLogger(__name__)

TRAIN_MEMORY: tuple[str, ...] = ("resident", "blocks")


@dataclass(frozen=True)
class TrainJob:
    """What to train: files, adapter preset (``rank``/``alpha`` None = the preset's), bucket
    ``resolution`` (area = resolution²), loop ``config``. ``cache_dir`` None = ``<output>.cache``;
    ``checkpoint_dir`` None = ``<output stem>-checkpoints`` beside the output; ``resume``: a checkpoint
    folder, or ``"auto"`` for the latest one there (none: from step 0). ``quantize="fp8"``:
    the base transformer's block linears are quantised to fp8 as it loads (frozen; the LoRA stays
    in the compute dtype on top). ``memory="blocks"``: the frozen blocks stay in CPU memory and each
    is copied to the device only while it runs (forward and the backward pass's recomputation), for
    GPUs that cannot hold the whole base model; slower, same result. ``text_encoder_rank``: also
    train a LoRA on the text encoder (off by default; alpha ``text_encoder_alpha``, learning rate
    ``config.text_encoder_lr``): the captions are then encoded at every step and the text encoder
    stays loaded (streamed too with ``memory="blocks"``). ``config.sample_prompts``: sample images
    at checkpoints (the prompts are encoded before the text encoder is dropped, or at every sample
    when it trains; the VAE stays loaded to decode them). ``speed``: the transformer's path while it
    trains (:func:`klein_core.accel.apply_speed`): ``fast`` (the default; on CUDA the attention
    backend and comfy-kitchen's QK-norm + RoPE forward, with klein_core's backward for it; on the CPU
    the plain path), ``compile`` (``torch.compile`` of the blocks, forward and backward) or ``plain``;
    the same LoRA either way, to rounding (docs/training.md)."""

    dataset: str | os.PathLike
    transformer: str | os.PathLike
    vae: str | os.PathLike
    text_encoder: str | os.PathLike
    output: str | os.PathLike
    preset: str = "style"
    rank: int | None = None
    alpha: float | None = None
    targets: tuple[str, ...] = ()
    resolution: int = 1024
    config: TrainConfig = field(default_factory=TrainConfig)
    fmt: str = "diffusers"
    cache_dir: str | os.PathLike | None = None
    checkpoint_dir: str | os.PathLike | None = None
    resume: str | os.PathLike | None = None
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None
    quantize: str | None = None
    memory: str = "resident"
    text_encoder_rank: int | None = None
    text_encoder_alpha: float | None = None
    speed: str = DEFAULT_SPEED


class TrainingStopped(RuntimeError):
    """``on_step`` stopped the run before its last step; no LoRA was written."""


@dataclass(frozen=True)
class TrainResult:
    """The written LoRA, the loss of every step (resumed steps included), the skipped files and the
    sample images written at checkpoints (in the order written: by step, then by prompt)."""

    path: Path
    losses: list[float]
    steps: int
    skipped: dict[str, str]
    sample_images: tuple[Path, ...] = ()


def run_job(job: TrainJob, *, on_step: Callable[[StepReport], bool | None] | None = None,
            check_cancel: Callable[[], None] | None = None,
            on_encode: Callable[[int, int], None] | None = None) -> TrainResult:
    """Run ``job``. ``check_cancel()`` runs before each encoding and (with ``on_step``) after each
    step; it cancels by raising. ``on_encode(done, total)``: progress while the dataset is encoded
    (before the first step; cached items count too). Bad input raises :class:`~klein_core.train.data.DatasetError`
    before any model is loaded (a distilled base, an empty folder, images without captions).
    Runs with autograd on even when called under ``torch.inference_mode()`` (as ComfyUI runs nodes).
    In a process group (data-parallel, e.g. the CLI under torchrun) every process runs it with its
    own ``device``; process 0 writes the LoRA and the others return once it is written."""
    with torch.inference_mode(False), torch.enable_grad():
        return _run(job, on_step, check_cancel, on_encode)


def _run(job: TrainJob, on_step: Callable[[StepReport], bool | None] | None,
         check_cancel: Callable[[], None] | None, on_encode: Callable[[int, int], None] | None) -> TrainResult:
    require_base_model(job.transformer)
    if job.fmt not in FORMATS:  # before training, not when the LoRA is saved at the end
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {job.fmt!r}")
    if (why := unwritable(job.output)) is not None:  # now, not when the trained LoRA is saved at the end
        raise ValueError(f"output {job.output}: {why}")
    if Path(job.output).is_file():  # said now, while stopping costs nothing, not found out after the run
        logger.warning("output %s exists; this run replaces it when it ends", job.output)
    if int(job.resolution) < 16:  # the bucket area is resolution²: 0 or a negative side is not a size
        raise ValueError(f"resolution must be 16 or more (pixels; the bucket area is resolution²), got {job.resolution}")
    # The LoRA's targets are checked before anything is encoded (a bad rank or pattern fails now).
    adapter_config = preset(job.preset, job.rank, job.alpha, job.targets)
    scan = scan_dataset(job.dataset)
    device = torch.device(job.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = job.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = Path(job.output)
    cancel = check_cancel or (lambda: None)
    # Found (or refused: a checkpoint of an earlier version) before anything is encoded or loaded.
    checkpoints = Path(job.checkpoint_dir) if job.checkpoint_dir is not None else \
        out.parent / (out.stem + "-checkpoints")
    resume = job.resume
    if resume is not None and str(resume) == "auto":  # the latest checkpoint of this output, if any
        resume = latest_checkpoint(checkpoints, job.config.steps)
        logger.info("resume auto: %s", resume or f"no checkpoint in {checkpoints}; starting at step 0")

    from ..pipeline.engine import Engine

    if job.quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be None or 'fp8', got {job.quantize!r}")
    if job.memory not in TRAIN_MEMORY:
        raise ValueError(f"memory must be one of {TRAIN_MEMORY}, got {job.memory!r}")
    check_speed(job.speed)
    if job.text_encoder_rank is not None and job.text_encoder_rank < 0:
        raise ValueError(f"text_encoder_rank must be positive (0 or None: no text-encoder LoRA), got "
                         f"{job.text_encoder_rank}")
    train_text = bool(job.text_encoder_rank)
    text_config = text_encoder_preset(int(job.text_encoder_rank or 0), job.text_encoder_alpha) if train_text else None
    streamed = job.memory == "blocks"
    # A trained text encoder stays for the whole run (streamed: from CPU memory); otherwise it only
    # encodes the captions (and sample prompts) first and is then dropped.
    # Loaded into CPU memory to stream: a device without float8 (Apple's MPS) gets fp8 layers dequantised
    te_quantize = quantize_for(job.text_encoder, "text_encoder", device, dtype=dtype) if train_text and streamed else None
    te = load_text_encoder(job.text_encoder, device="cpu" if train_text and streamed else device, dtype=dtype,
                           quantize=te_quantize)
    vae = load_vae(job.vae, device=device, dtype=dtype)
    engine = Engine(None, te, vae, kind="base", device=device, memory="resident", prompt_cache=None,
                    check_cancel=check_cancel)  # cancels sample images between their steps

    def image(px: torch.Tensor) -> torch.Tensor:
        cancel()
        return engine.encode_pixels(px.to(device)).float().cpu()

    def text(caption: str) -> torch.Tensor:
        cancel()
        return engine.encode_prompts([caption]).positive.float().cpu()

    def tokens(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize_prompts([caption], max_length=engine.text.length([caption]), truncate=engine.text.truncate)

    vae_identity = encoder_identity(job.vae, dtype, device, component="vae")
    encoders = Encoders(image, None if train_text else text, f"vae:{vae_identity}",
                        f"te:{encoder_identity(job.text_encoder, dtype, device)}", tokens if train_text else None)
    cache = job.cache_dir if job.cache_dir is not None else str(out) + ".cache"
    shard, gather = (0, 1), None
    if dist.is_initialized() and dist.get_world_size() > 1:  # each process encodes its share of the items
        shard, gather = (dist.get_rank(), dist.get_world_size()), _all_gather
    samples = build_samples(scan, encoders, cache, area=int(job.resolution) ** 2, shard=shard, gather=gather,
                            on_encode=on_encode)
    sampler = None
    if job.config.sample_prompts:
        from .samples import CheckpointSampler
        cancel()
        # a trained text encoder changes the prompts' embeddings: encoded again at every sample
        sampler = CheckpointSampler.from_config(engine, job.config, reencode=train_text)
    if not train_text:
        engine.text_encoder = None  # not needed while training: let it be freed (and the VAE unless sampling)
    if sampler is None:
        engine.vae = None
    del vae
    cancel()

    streamer = text_streamer = text_lora = None
    if streamed:  # the blocks live in CPU memory; the rest (and the LoRA) on the device
        model = load_transformer(job.transformer, device="cpu", dtype=dtype,
                                 quantize=quantize_for(job.transformer, "transformer", device, job.quantize, dtype=dtype))
        streamer = BlockOffloader(model, device, prefetch=1).attach(hooks=False)
        engine.memory = "blocks"  # sample images stream the blocks too (from where the streamer keeps them)
    else:
        model = load_transformer(job.transformer, device=device, dtype=dtype, quantize=job.quantize)
    apply_speed(transformer=model, speed=job.speed)
    engine.transformer = model
    lora = LoRASet(model, adapter_config, seed=job.config.seed)
    check_format_names(lora, job.fmt)  # a module the format cannot name: refused before training, not at the end
    if train_text:
        if streamed:
            text_streamer = BlockOffloader(te, device, prefetch=1).attach(hooks=False)
        text_lora = LoRASet(te, text_config, seed=(job.config.seed + 1) % 2**64, device=device)  # type: ignore[arg-type]
    else:
        del te

    def step_done(report: StepReport) -> bool | None:
        cancel()
        return on_step(report) if on_step is not None else None

    data_hash = dataset_hash(scan.items)
    # What a checkpoint must share with a run resuming it, besides the trainer's own settings
    # (Trainer.resume refuses a checkpoint of other data, models or resolution, naming the change).
    identity = {"dataset_hash": data_hash, "base_model": f"{Path(job.transformer).name} ({model.config.variant})",
                "vae": Path(job.vae).name, "text_encoder": Path(job.text_encoder).name,
                "resolution": int(job.resolution), "quantize": job.quantize}
    trainer = Trainer(model, lora, samples, job.config, output_dir=checkpoints, on_step=step_done, sampler=sampler,
                      streamer=streamer, text_encoder=te if train_text else None, text_lora=text_lora,
                      text_streamer=text_streamer, run_identity=identity)
    try:
        if resume:
            trainer.resume(resume)
        trainer.train()
    finally:
        trainer.close()
        for s in (streamer, text_streamer):
            if s is not None:
                s.detach()
    if trainer.step < job.config.steps:
        raise TrainingStopped(f"training stopped at step {trainer.step} of {job.config.steps}; no LoRA was written")
    cfg = job.config
    if trainer.rank == 0:  # data-parallel: every process holds the same LoRA; one writes it
        save_lora(out, lora, fmt=job.fmt, text_lora=text_lora, metadata={
            "base_model": f"{Path(job.transformer).name} ({model.config.variant})", "steps": trainer.step,
            "dataset_hash": data_hash, "seed": cfg.seed, "learning_rate": cfg.learning_rate})
    if trainer.world > 1:
        dist.barrier()  # the file exists when any process returns its path
    return TrainResult(out, list(trainer.losses), trainer.step, dict(scan.skipped), tuple(trainer.sample_paths))


def _all_gather(message: str | None) -> list[str | None]:
    """Every process's ``message`` (their errors while encoding), in rank order; waits for all."""
    out: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out
