"""``python -m klein_core train``: flags (or a TOML file of the same names) -> a trained LoRA.

Encodes the dataset once through the caches (VAE and text encoder are then dropped), trains the
LoRA on the frozen base transformer, writes checkpoints and the final ``.safetensors``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

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
    p.add_argument("--format", choices=FORMATS, default=None, help="key names of the saved LoRA")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--cache-dir", default=None, help="latent/prompt cache (default <output>.cache)")
    p.add_argument("--device", default=None)
    p.add_argument("--quantize", choices=("fp8",), default=None, help="train on an fp8 base (block linears)")
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


def _options(args: argparse.Namespace) -> dict:
    opts: dict = {}
    if args.config:
        import tomllib
        with open(args.config, "rb") as f:
            opts.update({k.replace("-", "_"): v for k, v in tomllib.load(f).items()})
    for k, v in vars(args).items():
        if k != "config" and v is not None and v is not False:
            opts[k] = v
    return opts


def _progress(report: StepReport) -> None:
    eta = time.strftime("%H:%M:%S", time.gmtime(report.eta_s)) if report.eta_s < 8.64e6 else "?"
    sys.stderr.write(f"\rstep {report.step}/{report.total}  loss {report.loss:.4f}  {report.it_per_s:.2f} it/s  "
                     f"ETA {eta}   ")
    if report.step == report.total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_train(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit code (0 done, 2 bad input)."""
    o = _options(args)
    missing = [k for k in ("dataset", "transformer", "vae", "text_encoder", "output") if not o.get(k)]
    if missing:
        sys.stderr.write(f"error: train needs {', '.join('--' + m.replace('_', '-') for m in missing)}\n")
        return 2
    cfg = TrainConfig(
        steps=int(o.get("steps", 1000)), learning_rate=float(o.get("lr", 1e-4)),
        batch_size=int(o.get("batch_size", 1)), seed=int(o.get("seed", 0)),
        checkpoint_every=int(o.get("checkpoint_every", 0)), keep_checkpoints=int(o.get("keep_checkpoints", 0)),
        gradient_checkpointing=not o.get("no_gradient_checkpointing", False),
        optimizer=o.get("optimizer", "adamw"), reference_dropout=float(o.get("reference_dropout", 0.0)),
        text_encoder_lr=float(o["text_encoder_lr"]) if o.get("text_encoder_lr") is not None else None,
        sample_prompts=tuple(o.get("sample_prompts") or ()), sample_every=int(o.get("sample_every", 0)),
        sample_steps=int(o.get("sample_steps", 20)), sample_seed=int(o.get("sample_seed", 0)),
        sample_size=tuple(o.get("sample_size", (512, 512))),
        objective=ObjectiveConfig(weighting_scheme=o.get("weighting_scheme", "none"), shift=float(o.get("shift", 1.0))),
    )
    job = TrainJob(
        dataset=o["dataset"], transformer=o["transformer"], vae=o["vae"], text_encoder=o["text_encoder"],
        output=o["output"], preset=o.get("preset", "style"), rank=o.get("rank"), alpha=o.get("alpha"),
        targets=tuple(o.get("targets") or ()), resolution=int(o.get("resolution", 1024)), config=cfg,
        fmt=o.get("format", "diffusers"), cache_dir=o.get("cache_dir"), resume=o.get("resume"),
        device=o.get("device"), quantize=o.get("quantize"), memory=o.get("memory", "resident"),
        text_encoder_rank=o.get("text_encoder_rank"), text_encoder_alpha=o.get("text_encoder_alpha"))
    try:
        result = run_job(job, on_step=_progress)
    except (DatasetError, ValueError, FileNotFoundError) as exc:  # bad input: the message says what to fix
        sys.stderr.write(f"error: {exc}\n")
        return 2
    for name, reason in result.skipped.items():
        sys.stderr.write(f"skipped {name}: {reason}\n")
    sys.stderr.write(f"wrote {result.path}\n")
    return 0
