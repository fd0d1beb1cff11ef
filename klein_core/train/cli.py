"""``python -m klein_core train``: flags (or a TOML file of the same names) -> a trained LoRA.

Encodes the dataset once through the caches (VAE and text encoder are then dropped), trains the
LoRA on the frozen base transformer, writes checkpoints and the final ``.safetensors``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..accel.speed import DEFAULT_SPEED, SPEEDS
from ..cli import bar_text, write_line
from .adapters import PRESETS
from .data import DatasetError
from .job import TRAIN_MEMORY, TrainJob, run_job
from .objective import WEIGHTING_SCHEMES, ObjectiveConfig
from .save import FORMATS
from .trainer import OPTIMIZERS, StepReport, TrainConfig

logger = logging.getLogger(__name__)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags to ``parser``."""
    p = parser
    p.add_argument("config", nargs="?", help="TOML file with any of these options (flags override it)")
    p.add_argument("--dataset", help="folder of images with .txt captions, or a .jsonl file")
    p.add_argument("--transformer", help="the Klein *base* transformer file")
    p.add_argument("--vae", help="FLUX.2 VAE file")
    p.add_argument("--text-encoder", help="Qwen3 text encoder file")
    p.add_argument("--output", help="LoRA file to write (.safetensors)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="block groups (default style)")
    p.add_argument("--targets", action="append", default=None, help="custom regex over core module names")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--alpha", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=None, help="bucket area = resolution^2 (default 1024)")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--keep-checkpoints", type=int, default=None,
                   help="keep the training states of the newest N checkpoints only (default: all)")
    p.add_argument("--resume", default=None, help=(
        "checkpoint folder to continue from, or auto: the latest checkpoint of this --output, if any"))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None)
    p.add_argument("--weighting-scheme", choices=WEIGHTING_SCHEMES, default=None)
    p.add_argument("--shift", type=float, default=None)
    p.add_argument("--reference-dropout", type=float, default=None)
    p.add_argument("--format", choices=FORMATS, default=None, help=(
        "key names of the saved LoRA: diffusers (default), kohya, or comfyui (BFL names: read whole by "
        "ComfyUI's own LoRA loaders, which apply only part of a diffusers-named file, and by diffusers)"))
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--cache-dir", default=None, help="latent/prompt cache (default <output>.cache)")
    p.add_argument("--device", default=None)
    p.add_argument("--quantize", choices=("fp8",), default=None, help="train on an fp8 base (block linears)")
    p.add_argument("--speed", choices=SPEEDS, default=None, help=(
        "the transformer's path while training: fast (default; fused kernels on CUDA), compile or plain"))
    p.add_argument("--memory", choices=TRAIN_MEMORY, default=None, help=(
        "resident (default): the base model on the device; blocks: its blocks stay in CPU memory and "
        "stream through the device one at a time (less GPU memory, slower)"))
    p.add_argument("--text-encoder-rank", type=int, default=None,
                   help="also train a LoRA on the text encoder, of this rank (default: none)")
    p.add_argument("--text-encoder-alpha", type=float, default=None)
    p.add_argument("--text-encoder-lr", type=float, default=None, help="its learning rate (default: --lr)")
    p.add_argument("--sample-prompt", dest="sample_prompts", action="append", default=None,
                   help="prompt for sample images at checkpoints (repeatable)")
    p.add_argument("--sample-every", type=int, default=None,
                   help="sample every N steps (default: at checkpoints); always after the last step")
    p.add_argument("--sample-steps", type=int, default=None, help="denoising steps of a sample (default 20)")
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--sample-size", type=int, nargs=2, default=None, metavar=("W", "H"))


class OptionError(ValueError):
    """A flag or TOML option cannot be used as given; the message names it and the fix."""


_LISTS = ("targets", "sample_prompts")  # repeatable flags: a TOML string is one item, not its characters


def _toml_reader(config: str) -> Any:
    """The TOML reader: the standard library's ``tomllib`` (Python 3.11+), else the ``tomli``
    package it came from (a dependency on Python 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise OptionError(f"{config}: reading a TOML config on Python 3.10 needs the tomli package "
                              "(pip install tomli), or pass the options as flags") from None
    return tomllib


def _options(args: argparse.Namespace) -> dict:
    opts: dict = {}
    if args.config:
        tomllib = _toml_reader(args.config)
        try:
            with open(args.config, "rb") as f:
                table = tomllib.load(f)
        except OSError as exc:
            raise OptionError(f"{args.config}: cannot read the config file ({exc.strerror or exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise OptionError(f"{args.config}: not valid TOML ({exc})") from None
        known = set(vars(args)) - {"config"}
        toml = {k.replace("-", "_"): v for k, v in table.items()}
        # A misspelt option (learning_rate for lr) would otherwise be silently ignored.
        unknown = [k for k in toml if k not in known]
        if unknown:
            hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, 1)) else k
                     for k in unknown]
            raise OptionError(f"{args.config}: unknown option(s) {', '.join(hints)}; the options are the flags' "
                              f"names: {', '.join(sorted(known))}")
        for k in _LISTS:
            if isinstance(toml.get(k), str):
                toml[k] = [toml[k]]
        opts.update(toml)
    for k, v in vars(args).items():
        if k != "config" and v is not None and v is not False:
            opts[k] = v
    return opts


def _number(o: dict, key: str, kind: type, default: object) -> object:
    """Option ``key`` as ``kind`` (int or float), or ``default``; a wrong value names the option."""
    value = o.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or \
            (kind is int and isinstance(value, float) and not value.is_integer()):
        raise OptionError(f"option {key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise OptionError(f"option {key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") \
            from None


_TEXTS = ("dataset", "transformer", "vae", "text_encoder", "output", "preset", "format", "cache_dir", "resume",
          "device", "quantize", "memory", "optimizer", "weighting_scheme", "speed")


def _check_types(o: dict) -> None:
    """A TOML value of the wrong type names its option (argparse types the flags): text options are
    strings, the repeatable ones lists of strings, switches booleans ("no" was read as true)."""
    for key in _TEXTS:
        if key in o and not isinstance(o[key], str):
            raise OptionError(f"option {key}: expected a string, got {o[key]!r}")
    for key in _LISTS:
        value = o.get(key)
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)):
            raise OptionError(f"option {key}: expected a string or a list of strings, got {value!r}")
    if not isinstance(o.get("no_gradient_checkpointing", False), bool):
        raise OptionError(f"option no_gradient_checkpointing: expected true or false, got "
                          f"{o['no_gradient_checkpointing']!r}")
    if o.get("format", FORMATS[0]) not in FORMATS:  # checked before training, not when the LoRA is saved
        raise OptionError(f"option format: expected one of {', '.join(FORMATS)}, got {o['format']!r}")


def _progress(report: StepReport) -> None:
    eta = time.strftime("%H:%M:%S", time.gmtime(report.eta_s)) if report.eta_s < 8.64e6 else "?"
    # through the CLI's writer: an error or warning after this line starts a line of its own
    write_line(sys.stderr, f"\rstep {report.step}/{report.total}  loss {report.loss:.4f}  {report.it_per_s:.2f} it/s  "
                           f"ETA {eta}   ")
    if report.step == report.total:
        write_line(sys.stderr, "\n")


def _encode_progress(done: int, total: int) -> None:
    write_line(sys.stderr, bar_text("encoding dataset", done, total, ""))
    if done == total:
        write_line(sys.stderr, "\n")


def torchrun_device(device: str | None) -> tuple[str | None, bool]:
    """Under torchrun (``WORLD_SIZE`` above 1 in the environment, no process group yet): start the
    process group from torchrun's variables (NCCL on CUDA, gloo on the CPU) and give each process its
    own GPU, ``cuda:LOCAL_RANK``. Returns the device to train on and whether the group was started
    here. Elsewhere ``(device, False)``: one process, as always."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or dist.is_initialized():
        return device, False
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device)
    if kind.type == "cuda":
        if kind.index is not None:
            raise OptionError(f"--device {device}: under torchrun each of the {world} processes trains on its own "
                              f"GPU (cuda:LOCAL_RANK); give --device cuda, or no --device")
        if local >= torch.cuda.device_count():
            raise OptionError(f"torchrun process {local} has no GPU of its own (this machine has "
                              f"{torch.cuda.device_count()}); start at most that many processes per node")
        device = f"cuda:{local}"
        torch.cuda.set_device(torch.device(device))
    elif kind.type != "cpu":
        raise OptionError(f"--device {device}: data-parallel training runs on CUDA GPUs (NCCL) or the CPU (gloo)")
    dist.init_process_group("nccl" if kind.type == "cuda" else "gloo")
    logger.info("data-parallel training: process %d of %d on %s", dist.get_rank(), world, device)
    return device, True


def run_train(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit code (0 done, 1 the loss or gradients diverged, 2 bad input).
    Under torchrun every process runs it: data-parallel, one writes the LoRA (:func:`torchrun_device`)."""
    try:
        job = _job(_options(args))
        if job is None:
            return 2
        device, started = torchrun_device(None if job.device is None else str(job.device))
    except OptionError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    job = dataclasses.replace(job, device=device)
    first = not dist.is_initialized() or dist.get_rank() == 0  # says progress and results, once
    try:
        result = run_job(job, on_step=_progress if first else None, on_encode=_encode_progress if first else None)
    except (DatasetError, ValueError, OSError) as exc:  # bad input or a file that cannot be read or written
        write_line(sys.stderr, f"error: {exc}\n")  # (on a line of its own after a step line)
        return 2
    except FloatingPointError as exc:  # the run diverged: said in one line, no traceback
        write_line(sys.stderr, f"error: {exc}\n")
        return 1
    finally:
        if started:
            dist.destroy_process_group()
    if first:
        for name, reason in result.skipped.items():
            sys.stderr.write(f"skipped {name}: {reason}\n")
        sys.stderr.write(f"wrote {result.path}\n")
        if job.fmt == "diffusers":  # the default: ComfyUI's own LoRA loaders apply only part of it
            sys.stderr.write("(diffusers names; for ComfyUI's own LoRA loaders train with --format comfyui, "
                             "which this pack and diffusers read too)\n")
    return 0


def _job(o: dict) -> TrainJob | None:
    """The job of the options ``o``; None (the missing flags said on stderr) when a required one is
    missing. Raises :class:`OptionError` naming a wrong value."""
    missing = [k for k in ("dataset", "transformer", "vae", "text_encoder", "output") if not o.get(k)]
    if missing:
        sys.stderr.write(f"error: train needs {', '.join('--' + m.replace('_', '-') for m in missing)}\n")
        return None
    _check_types(o)
    size = o.get("sample_size", (512, 512))
    if not isinstance(size, (list, tuple)) or len(size) != 2:
        raise OptionError(f"option sample_size: expected [width, height], got {size!r}")
    n = {k: _number(o, k, int, d) for k, d in (
        ("steps", 1000), ("batch_size", 1), ("seed", 0), ("checkpoint_every", 0), ("keep_checkpoints", 0),
        ("sample_every", 0), ("sample_steps", 20), ("sample_seed", 0), ("resolution", 1024), ("rank", None),
        ("text_encoder_rank", None))}
    f = {k: _number(o, k, float, d) for k, d in (
        ("lr", 1e-4), ("reference_dropout", 0.0), ("text_encoder_lr", None), ("shift", 1.0), ("alpha", None),
        ("text_encoder_alpha", None))}
    if n["checkpoint_every"] < 0:  # type: ignore[operator]
        raise OptionError(f"option checkpoint_every: expected 0 (no checkpoints) or more, got {n['checkpoint_every']}")
    try:
        cfg = TrainConfig(
            steps=n["steps"], learning_rate=f["lr"], batch_size=n["batch_size"], seed=n["seed"],  # type: ignore[arg-type]
            checkpoint_every=n["checkpoint_every"], keep_checkpoints=n["keep_checkpoints"],  # type: ignore[arg-type]
            gradient_checkpointing=not o.get("no_gradient_checkpointing", False),
            optimizer=o.get("optimizer", "adamw"), reference_dropout=f["reference_dropout"],  # type: ignore[arg-type]
            text_encoder_lr=f["text_encoder_lr"],  # type: ignore[arg-type]
            sample_prompts=tuple(o.get("sample_prompts") or ()), sample_every=n["sample_every"],  # type: ignore[arg-type]
            sample_steps=n["sample_steps"], sample_seed=n["sample_seed"],  # type: ignore[arg-type]
            sample_size=(_number({"sample_size": size[0]}, "sample_size", int, 512),
                         _number({"sample_size": size[1]}, "sample_size", int, 512)),  # type: ignore[arg-type]
            objective=ObjectiveConfig(weighting_scheme=o.get("weighting_scheme", "none"), shift=f["shift"]),  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    return TrainJob(
        dataset=o["dataset"], transformer=o["transformer"], vae=o["vae"], text_encoder=o["text_encoder"],
        output=o["output"], preset=o.get("preset", "style"), rank=n["rank"], alpha=f["alpha"],  # type: ignore[arg-type]
        targets=tuple(o.get("targets") or ()), resolution=n["resolution"], config=cfg,  # type: ignore[arg-type]
        fmt=o.get("format", "diffusers"), cache_dir=o.get("cache_dir"), resume=o.get("resume"),
        device=o.get("device"), quantize=o.get("quantize"), memory=o.get("memory", "resident"),
        text_encoder_rank=n["text_encoder_rank"], text_encoder_alpha=f["text_encoder_alpha"],  # type: ignore[arg-type]
        speed=o.get("speed", DEFAULT_SPEED))
