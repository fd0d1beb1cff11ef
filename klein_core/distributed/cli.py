"""``python -m klein_core batch ...`` and ``python -m klein_core serve ...``: argparse glue over
:mod:`.batch` and :mod:`.serve`. Errors are reported as ``klein_core.cli`` reports them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from ..accel.speed import DEFAULT_SPEED, SPEEDS
from ..cli import (
    DTYPES,
    CLIError,
    log_to_stderr,
    refuse_unused_with_demo,
    resolve_files,
    vae_tile_arg,
    write_line,
)
from ..memory.planner import MODES
from ..pipeline.prompts import TRIM_MULTIPLE
from ..pipeline.request import guess_model_kind
from .models import ModelSpec
from .ray_support import RayMissing

logger = logging.getLogger(__name__)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("models, once per job (give --models-dir, the three files, or --demo)")
    src.add_argument("--transformer", type=Path, help="Klein transformer .safetensors (or diffusers folder)")
    src.add_argument("--text-encoder", type=Path, help="Qwen3 text encoder .safetensors (or HF folder)")
    src.add_argument("--vae", type=Path, help="FLUX.2 VAE .safetensors")
    src.add_argument("--models-dir", type=Path, help="a ComfyUI models/ folder")
    src.add_argument("--model", default=None, help="file name in diffusion_models/ (with --models-dir)")
    src.add_argument("--demo", action="store_true", help="tiny random models (checks the install; images are noise)")
    src.add_argument("--lora-dir", type=Path, default=None,
                     help="where row LoRA names are found (default: loras/ of --models-dir)")
    kind = src.add_mutually_exclusive_group()
    kind.add_argument("--base", action="store_true", help="base model: CFG with a negative prompt")
    kind.add_argument("--distilled", action="store_true", help="distilled model (default unless the name says base)")
    run = p.add_argument_group("how each worker runs")
    run.add_argument("--device", default=None, help="cuda or cpu (default: the worker's GPU if it has one)")
    run.add_argument("--dtype", choices=DTYPES, default=None, help="weights dtype (default: bf16 on GPU, fp32 on CPU)")
    run.add_argument("--quantize", choices=("fp8", "q8", "q4"), default=None, help="as klein-generate --quantize")
    run.add_argument("--speed", choices=SPEEDS, default=DEFAULT_SPEED,
                     help=f"as klein-generate --speed (default: {DEFAULT_SPEED}; the plain path on a CPU worker)")
    run.add_argument("--memory", choices=MODES, default="auto", help="memory mode, planned per worker for its device")
    run.add_argument("--vae-tile", type=vae_tile_arg, default="auto", metavar="{auto,none,64,32,16}",
                     help="as klein-generate --vae-tile")
    run.add_argument("--ref-mode", choices=("joint", "timestep_zero", "kv"), default=None)
    run.add_argument("--text-precision", choices=("model", "fp32"), default="model")
    run.add_argument("--max-tokens", choices=("512", "whole"), default="512",
                     help="512: a longer prompt is a bad row (not cut); whole: keep every token")
    run.add_argument("--trim-padding", action="store_true", help="as klein-generate --trim-padding (approximate)")
    ray = p.add_argument_group("Ray")
    ray.add_argument("--address", default=None,
                     help="Ray cluster address (default: RAY_ADDRESS if set, else a new local cluster)")
    ray.add_argument("--gpus-per-worker", type=float, default=None,
                     help="GPUs per model worker (default: 1 if the cluster has GPUs, else 0)")
    ray.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs per model worker")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The :class:`ModelSpec` the flags describe; files are resolved and checked here (CLIError)."""
    lora_dir = args.lora_dir or (args.models_dir / "loras" if args.models_dir else None)
    common = dict(device=args.device, dtype=args.dtype, quantize=args.quantize, speed=args.speed, memory=args.memory,
                  vae_tile=args.vae_tile,
                  max_tokens=None if args.max_tokens == "whole" else 512, text_precision=args.text_precision,
                  trim=TRIM_MULTIPLE if args.trim_padding else None,
                  ref_mode=args.ref_mode, lora_dir=lora_dir.resolve() if lora_dir else None)
    if args.demo:
        refuse_unused_with_demo(args)
        return ModelSpec(demo=True, kind="base" if args.base else "distilled", **common)
    tr, te, vae = resolve_files(args)
    guessed = guess_model_kind(tr)
    kind = "base" if args.base else "distilled" if args.distilled and guessed == "base" else guessed
    if common["ref_mode"] is None and guessed == "kv":
        common["ref_mode"] = "kv"
    return ModelSpec(tr.resolve(), te.resolve(), vae.resolve(), kind=kind,
                     names={"transformer": tr.name, "text_encoder": te.name, "vae": vae.name}, **common)


def _gpus(args: argparse.Namespace) -> float:
    if args.gpus_per_worker is not None:
        return args.gpus_per_worker
    if args.device == "cpu":
        return 0.0
    import ray

    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


# -- batch ------------------------------------------------------------------------------------------

def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``batch``."""
    parser.add_argument("input", type=Path, help="requests: .jsonl, .csv or .parquet, one row per image "
                                                 "(fields: docs/ray.md)")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder: images/<id>.png, manifest.jsonl, summary.json; a rerun resumes")
    parser.add_argument("--workers", type=int, default=None,
                        help="model actors (default: one per GPU in the cluster, else 1)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per map_batches call")
    _add_model_args(parser)


def run_batch(args: argparse.Namespace) -> int:
    """Run ``batch``; 0 when every row succeeded, 1 when some rows failed (see the manifest), 2 on a
    job-level error (message on stderr)."""
    log_to_stderr()
    try:
        from .batch import BatchConfig, run_batch_job
        from .ray_support import init_ray, require_ray

        require_ray("data")
        if args.batch_size < 1:
            raise CLIError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.workers is not None and args.workers < 1:
            raise CLIError(f"--workers must be at least 1, got {args.workers}")
        spec = spec_from_args(args)
        ray = init_ray(args.address)
        gpus = _gpus(args)
        workers = args.workers or (max(1, int(ray.cluster_resources().get("GPU", 0) // gpus)) if gpus else 1)
        config = BatchConfig(args.input, args.out, spec, actors=workers, cpus_per_actor=args.cpus_per_worker,
                             gpus_per_actor=gpus, batch_size=args.batch_size, address=args.address)

        def progress(done: int, total: int, failed: int, seconds: float) -> None:
            if not args.quiet:
                write_line(sys.stderr, f"\r{done}/{total} rows, {failed} failed, {done / max(seconds, 1e-9):.2f} rows/s   ")

        summary = run_batch_job(config, progress)
    except RayMissing as exc:  # the other bad inputs are reported by klein_core.cli.main
        write_line(sys.stderr, f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        write_line(sys.stderr, "\nstopped; rerun the same command to resume\n")
        return 130
    workers_line = ", ".join(f"{w} {n}" for w, n in summary.per_worker.items()) or "none"
    if not args.quiet:
        write_line(sys.stderr, "\n")  # ends the progress line where it is (stdout may be a file)
    write_line(sys.stdout, f"{summary.generated} image(s), {summary.failed} failed, {summary.skipped} already done, "
                       f"{summary.rows} row(s) in {summary.seconds:.1f} s ({summary.images_per_s:.2f} images/s); "
                       f"per worker: {workers_line} -> {args.out / 'manifest.jsonl'}\n")
    return 1 if summary.failed else 0


# -- serve ------------------------------------------------------------------------------------------

def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``serve``."""
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 to listen on every interface)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--min-replicas", type=int, default=1, help="autoscaling: fewest replicas")
    parser.add_argument("--max-replicas", type=int, default=1, help="autoscaling: most replicas (one GPU each)")
    parser.add_argument("--target-ongoing", type=float, default=2.0,
                        help="autoscaling: ongoing requests per replica it aims at")
    parser.add_argument("--max-ongoing", type=int, default=8, help="requests a replica takes at once (>= --max-batch)")
    parser.add_argument("--max-queued", type=int, default=32,
                        help="requests queued per proxy before answering 503 with Retry-After")
    parser.add_argument("--max-batch", type=int, default=4, help="@serve.batch: most requests in one batch")
    parser.add_argument("--batch-wait", type=float, default=0.05, help="@serve.batch: seconds to wait to fill a batch")
    _add_model_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    """Start the server and block until Ctrl-C; 2 on a start-up error (message on stderr)."""
    log_to_stderr()
    try:
        from .ray_support import init_ray, require_ray
        from .serve import ServeOptions, start

        require_ray("serve")
        spec = spec_from_args(args)
        # checked before Ray starts; the GPUs per replica may need the started cluster to tell
        options = ServeOptions(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                               target_ongoing=args.target_ongoing, max_ongoing=args.max_ongoing,
                               max_queued=args.max_queued, max_batch=args.max_batch, batch_wait_s=args.batch_wait,
                               cpus=args.cpus_per_worker, gpus=args.gpus_per_worker or 0.0)
        init_ray(args.address)
        options = dataclasses.replace(options, gpus=_gpus(args))
        start(spec, options, host=args.host, port=args.port)
        write_line(sys.stderr, f"serving on http://{args.host}:{args.port} (POST /generate, GET /health, GET /ready); "
                           "Ctrl-C stops\n")
        import time

        while True:
            time.sleep(3600)
    except RayMissing as exc:  # the other bad inputs are reported by klein_core.cli.main
        write_line(sys.stderr, f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        write_line(sys.stderr, "\nstopped\n")
        return 0


__all__ = ["add_batch_args", "add_serve_args", "run_batch", "run_serve"]
