"""Command line: ``python -m klein_core generate ...`` or ``klein-generate ...``."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import logging
import math
import os
import shutil
import stat
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from . import __version__
from .accel.speed import DEFAULT_SPEED, SPEEDS, describe_speed
from .accel.step_cache import DEFAULT_THRESHOLD, DEFAULT_WARMUP, StepCache, enable_step_cache
from .errors import GenerationCancelled, WeightFormatError
from .files.atomic import atomic_path, is_folder, unwritable
from .files.gguf import gguf_header, is_gguf
from .files.identify import matching_text_encoders, probe
from .files.loaders import as_dtype
from .files.safetensors import open_safetensors
from .memory.tiling import TILE_SIDES
from .models.variants import check_text_width
from .pipeline.engine import Engine, GenerationResult, generate
from .pipeline.images import oriented_size, reference_size, refuse_bomb
from .pipeline.inpaint import (
    DEFAULT_STRENGTH_IMAGE_TO_IMAGE,
    DEFAULT_STRENGTH_INPAINT,
    outpaint,
    steps_to_run,
)
from .pipeline.prompts import (
    TRIM_MULTIPLE,
    DiskPromptCache,
    PromptCache,
    TextOptions,
    default_prompt_cache,
    encoder_identity,
)
from .pipeline.request import MAX_STEPS, as_device, guess_model_kind, reference_mode, resolve_size
from .pipeline.sampling import MAX_SEED
from .provenance import run_environment, strength_text

logger = logging.getLogger("klein_core.cli")

DTYPES = ("bf16", "fp16", "fp32")  # --dtype choices; loading.as_dtype reads them


class CLIError(Exception):
    """A one-line, user-facing error."""


_bar_open = False  # a progress bar ("\r...") left stderr mid-line: what is written next starts a line


def write_line(stream, text: str) -> None:
    """Write ``text`` to ``stream`` now. On stderr, text after an unfinished progress bar starts on a
    line of its own (an error or warning was glued to the bar), and a bar (text starting with "\r")
    leaves the line open."""
    global _bar_open
    if stream is sys.stderr:
        if _bar_open and not text.startswith(("\r", "\n")):
            stream.write("\n")
        _bar_open = text.startswith("\r") and not text.endswith("\n")
    stream.write(text)
    stream.flush()


def bar_text(prefix: str, step: int, total: int, suffix: str) -> str:
    """``\r<prefix> [###---] <step>/<total>  <suffix>`` fitted to the terminal's width: the bar has
    at most one cell per step and shrinks (to 10 cells at least) so the line never wraps, which would
    print a new row per redraw."""
    try:  # the bar is drawn on stderr: its terminal, also when stdout goes to a file
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = shutil.get_terminal_size((80, 24)).columns
    fixed = len(f"{prefix} [] {step}/{total}  {suffix}   ")
    cells = max(1, min(total, max(10, columns - 1 - fixed)))
    done = cells * step // total if total else cells
    return f"\r{prefix} [{'#' * done}{'-' * (cells - done)}] {step}/{total}  {suffix}   "


class _Formatter(argparse.HelpFormatter):
    """Shows "(default: ...)" for options whose default is a value (not None, empty or off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if not (d is None or d is False or d == "" or d == [] or d == argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="klein-generate", formatter_class=_Formatter,
        description="FLUX.2 Klein text-to-image and editing. 'generate' is the default command and may be "
                    "left out: 'klein-generate --prompt ...' is 'klein-generate generate --prompt ...'. "
                    f"Other commands: {', '.join(COMMANDS)} (each has its own --help).",
        epilog="examples: klein-generate --demo --out out/demo.png | klein-generate --models-dir ComfyUI/models "
               "--model flux-2-klein-4b.safetensors --prompt 'a red fox' --out fox.png")
    _add_generate_args(p)
    return p


# Commands besides generate: name -> (module, add-arguments function, run function, description). Their
# modules are imported only when the command runs (Ray, training code).
COMMANDS = {
    "batch": ("klein_core.distributed.cli", "add_batch_args", "run_batch",
              "generate a file of requests on a Ray cluster (pip install 'klein-nodes[ray]')"),
    "serve": ("klein_core.distributed.cli", "add_serve_args", "run_serve",
              "serve generation over HTTP with Ray Serve (pip install 'klein-nodes[ray]')"),
    "train": ("klein_core.train.cli", "add_train_args", "run_train", "train a LoRA on a Klein base model"),
}


def _command(name: str, argv: list[str]) -> tuple[argparse.Namespace, Any]:
    """The parsed arguments of command ``name`` and its run function."""
    import importlib

    module_name, add_name, run_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"klein-generate {name}", description=description,
                                     formatter_class=_Formatter)
    getattr(module, add_name)(parser)
    return parser.parse_args(argv), getattr(module, run_name)


def _add_generate_args(g: argparse.ArgumentParser) -> None:
    src = g.add_argument_group("models (give --models-dir, the three files, or --demo)")
    src.add_argument("--transformer", type=Path, help="Klein transformer .safetensors (or diffusers folder)")
    src.add_argument("--text-encoder", type=Path, help="Qwen3 text encoder .safetensors (or HF folder)")
    src.add_argument("--vae", type=Path, help="FLUX.2 VAE .safetensors")
    src.add_argument("--models-dir", type=Path,
                     help="a ComfyUI models/ folder with diffusion_models/, text_encoders/, vae/")
    src.add_argument("--model", default=None,
                     help="file name in diffusion_models/ (with --models-dir; default: the first "
                          "transformer there, in name order)")
    src.add_argument("--demo", action="store_true",
                     help="tiny random models built in memory: checks the install, the image is noise "
                          "(256x256 unless --width/--height say otherwise)")
    g.add_argument("--prompt", default="", help="the prompt")
    g.add_argument("--negative-prompt", default="", help="negative prompt (base models with guidance > 1)")
    g.add_argument("--ref", action="append", default=[], type=Path, help="reference image (repeatable)")
    g.add_argument("--lora", action="append", default=[], type=lora_arg, metavar="FILE[:STRENGTH]",
                   help="LoRA .safetensors with optional strength (default 1), merged after loading (repeatable)")
    g.add_argument("--width", type=int, default=None,
                   help="output width in pixels, a multiple of 16 (default: the first reference's, else 1024)")
    g.add_argument("--height", type=int, default=None, help="output height (same default as --width)")
    g.add_argument("--steps", type=int, default=None, help="steps (default: 4 distilled, 50 base)")
    g.add_argument("--guidance", type=float, default=None, help="CFG scale (default: 1 distilled, 4 base)")
    g.add_argument("--seed", type=int, default=0, help="seed, 0..2^64-1")
    g.add_argument("--batch", type=int, default=1, help="images per prompt")
    kind = g.add_mutually_exclusive_group()
    kind.add_argument("--base", action="store_true", help="base model: CFG with a negative prompt")
    kind.add_argument("--distilled", action="store_true", help="distilled model (default unless the name says base)")
    g.add_argument("--out", default="klein.png",
                   help="output PNG; with --batch, _00, _01... are added before the suffix")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu, mps (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights dtype (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--speed", choices=SPEEDS, default=DEFAULT_SPEED,
                   help="fast: best attention and fused kernels on CUDA (the plain path on the CPU); compile: "
                        "also torch.compile (the first run at a size compiles, tens of seconds); plain: the "
                        "reference path")
    g.add_argument("--step-cache", type=step_cache_threshold, nargs="?", const=DEFAULT_THRESHOLD, default=None,
                   metavar="THRESHOLD",
                   help="base models, opt-in and approximate: skip the blocks after the first while the first "
                        f"block's output has changed by less than THRESHOLD since the last full step (alone: "
                        f"{DEFAULT_THRESHOLD}; 0 never skips); says how many forwards skipped")
    g.add_argument("--quantize", choices=("fp8", "q8", "q4"), default=None,
                   help="store the transformer's block weights as fp8, or as GGUF Q8_0 / Q4_0 blocks (Klein 4B: "
                        "about 4.0 / 2.3 GB); fp8 and GGUF files keep their own format")
    edit = g.add_argument_group("image to image, inpainting, outpainting")
    edit.add_argument("--image", type=Path, default=None,
                      help="start from this picture (image to image); the output takes its size")
    edit.add_argument("--mask", type=Path, default=None,
                      help="with --image: white = repaint, black = keep (inpainting)")
    edit.add_argument("--strength", type=float, default=None,
                      help="with --image: share of the schedule that runs, 0..1 (default 1 with a mask, 0.8 without)")
    edit.add_argument("--outpaint", default=None, metavar="L,T,R,B",
                      help="with --image: grow the canvas by these pixels on the left, top, right, bottom and paint "
                           "the new area")
    edit.add_argument("--crop-padding", type=int, default=None, metavar="PX",
                      help="paint only a crop around the mask, grown by PX (small masks on large pictures)")
    edit.add_argument("--feather", type=int, default=0, metavar="PX",
                      help="soften the seam over PX pixels inside the mask (and, with --outpaint, into the picture)")
    edit.add_argument("--no-composite", action="store_true",
                      help="return the generated picture as is (by default only masked pixels change)")
    g.add_argument("--ref-mode", choices=("joint", "timestep_zero", "kv"), default=None,
                   help="how references take part (default: kv for Klein 9B-KV, a file named '...-kv...' or "
                        "a diffusers FLUX.2-klein-9b-kv folder; else joint)")
    g.add_argument("--text-precision", choices=("model", "fp32"), default="model",
                   help="text encoder activations: model = its weights' dtype (BFL, diffusers); fp32 = "
                        "fp32 activations on the same weights (ComfyUI's native nodes)")
    g.add_argument("--max-tokens", choices=("512", "whole"), default="512",
                   help="512 cuts longer prompts (BFL, diffusers); whole keeps every token (ComfyUI)")
    g.add_argument("--trim-padding", action="store_true",
                   help=f"pad prompts to a multiple of {TRIM_MULTIPLE} tokens instead of 512: fewer tokens in every "
                        "step (faster, most at small sizes); approximate, since Klein was trained with 512")
    g.add_argument("--vae-tile", type=vae_tile_arg, default="auto", metavar="{auto,none,64,32,16}",
                   help=VAE_TILE_HELP)
    g.add_argument("--prompt-cache", type=Path, default=None, metavar="DIR",
                   help="keep prompt embeddings in DIR across runs: a prompt seen before does not load the "
                        "text encoder at all")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no notes (what ran, the summary); warnings and errors are still shown")


VAE_TILE_HELP = ("auto: the VAE encodes and decodes in tiles only where GPU memory is short; none: never in tiles "
                 "(weights move first, or the run is refused); 64, 32 or 16: always in tiles of that many latent "
                 "positions (1024, 512, 256 px). Tiles are not exact, so pin them to get the same pixels on any "
                 "GPU; the PNG parameters record the tiles that ran")


def vae_tile_arg(text: str) -> int | str | None:
    """``--vae-tile``'s value: "auto", "none" (None) or a tile side of :data:`TILE_SIDES`."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    if text.isdigit() and int(text) in TILE_SIDES:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a VAE tile: give auto, none or one of "
                                     f"{', '.join(map(str, TILE_SIDES))}")


def vae_tile_text(vae_tile: int | str | None) -> int | str:
    """A ``vae_tile`` as the PNG parameters keep it: the flag's own spelling ("auto", "none" or the side)."""
    return "none" if vae_tile is None else vae_tile


def step_cache_threshold(text: str) -> float:
    """``--step-cache``'s value: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a threshold: give a number >= 0, such as "
                                         f"{DEFAULT_THRESHOLD} (0 never skips)")
    return value


def lora_arg(text: str) -> tuple[Path, float]:
    """``FILE[:STRENGTH]``; a tail that is not a number is part of the path (``C:\\x.safetensors``)."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            return Path(path), float(tail)
        except ValueError:
            pass
    return Path(text), 1.0


def _model_files(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.safetensors"), *folder.glob("*.gguf")])


def _pick(folder: Path, what: str, name: str | None = None) -> Path:
    if not folder.is_dir():
        raise CLIError(f"{folder} does not exist (expected the {what} folder of a ComfyUI models/ dir)")
    files = _model_files(folder)
    if name:
        p = folder / name
        if not p.is_file():
            there = ", ".join(f.name for f in files) if files else "no .safetensors files at all"
            raise CLIError(f"{p} not found; {folder} has {there}")
        return p
    if not files:
        noun = {"diffusion_models": "Klein transformer (e.g. flux-2-klein-4b.safetensors)",
                "vae": "FLUX.2 VAE (flux2-vae.safetensors)"}.get(what, what)
        raise CLIError(f"no .safetensors files in {folder}; put the {noun} there (README: Model files)")
    if what == "diffusion_models":
        # ComfyUI's diffusion_models/ holds other models too (a VAE, a LoRA, another family): the first
        # file by name is not necessarily a transformer, and picking it blindly failed with a message
        # about that file. The first file whose header is a transformer's is the default.
        transformers = [f for f in files if probe(f).kind == "transformer"]
        if not transformers:
            if any(is_gguf(f) for f in files) and importlib.util.find_spec("gguf") is None:
                # a GGUF file probe could not read because the gguf package is missing: say so
                _refuse_non_weights(next(f for f in files if is_gguf(f)), "transformer")
            raise CLIError(f"no transformer in {folder} (it has {', '.join(f.name for f in files)}); put the Klein "
                           "transformer (e.g. flux-2-klein-4b.safetensors) there, or name it with --model")
        return transformers[0]
    return files[0]


def _refuse_non_weights(path: Path, component: str) -> None:
    """Before anything loads: raise what ``path`` is when it is a file that holds no weights (an image,
    a web page, a truncated download), or a GGUF file that cannot be read (its loader's words: the
    gguf package to install, a damaged file). Reads the header only."""
    if path.is_file():
        if is_gguf(path):
            gguf_header(path)
        else:
            open_safetensors(path, component)


def resolve_files(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """Transformer, text encoder and VAE paths from explicit flags and/or ``--models-dir``."""
    tr, te, vae = args.transformer, args.text_encoder, args.vae
    # --model names a file in --models-dir's diffusion_models/; anywhere else it used to be ignored
    # without a word, and another transformer than the one asked for ran.
    if args.model is not None and not args.models_dir:
        raise CLIError(f"--model {args.model}: needs --models-dir (or give the file with --transformer)")
    if args.model is not None and tr is not None:
        raise CLIError(f"--model {args.model} and --transformer {tr}: give one of them")
    if args.models_dir:
        md = args.models_dir
        tr = tr or _pick(md / "diffusion_models", "diffusion_models", args.model)
        vae = vae or (md / "vae" / "flux2-vae.safetensors" if (md / "vae" / "flux2-vae.safetensors").is_file()
                      else _pick(md / "vae", "vae"))
        if te is None:
            info = probe(tr)
            if info.kind == "unknown":
                _refuse_non_weights(tr, "transformer")
            cands = _model_files(md / "text_encoders")
            fits = matching_text_encoders(info.text_width, cands) if info.text_width else []
            if not fits:
                raise CLIError(f"no text encoder in {md / 'text_encoders'} fits {tr.name} ({info.description}); "
                               f"it needs one with text width {info.text_width}")
            te = fits[0]
    missing = [n for n, v in (("--transformer", tr), ("--text-encoder", te), ("--vae", vae)) if v is None]
    if missing:
        raise CLIError(f"missing {', '.join(missing)} (or pass --models-dir, or --demo)")
    for p in (tr, te, vae):
        if not p.exists():
            raise CLIError(f"file not found: {p}")
    tinfo, einfo, vinfo = probe(tr), probe(te), probe(vae)
    for path, info, component in ((tr, tinfo, "transformer"), (te, einfo, "text encoder"), (vae, vinfo, "VAE")):
        if info.kind == "unknown":
            _refuse_non_weights(path, component)
    if tinfo.kind == "transformer" and einfo.kind == "text_encoder":
        fits = matching_text_encoders(tinfo.text_width, _model_files(te.parent))
        try:
            check_text_width(einfo.text_width, tinfo.text_width, encoded_by=f"{te.name} ({einfo.description})",
                             model=f"{tr.name} ({tinfo.description})",
                             fix=f"use {fits[0].name}" if fits else None)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    return tr, te, vae


class _Progress:
    """A one-line bar; the per-step time averages the intervals between steps, so the first step
    (which follows text and reference encoding) does not inflate it."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    def __call__(self, step: int, total: int, latents: torch.Tensor) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            rate = f"{now - self.t0:.2f} s so far"
        else:
            rate = f"{(now - self.t_first) / (step - 1):.2f} s/step"
        write_line(sys.stderr, bar_text("denoising", step, total, rate))
        if step == total:
            write_line(sys.stderr, "\n")


def check_out(out: str | Path) -> Path:
    """``--out`` checked before anything loads (a generation must not be lost at the end): a file name
    whose extension PIL can write an RGB picture in (none: ``.png`` is added), not a folder (also one
    written with a trailing separator, which ``Path`` would drop), in a folder that exists or can be
    made. Returns the path images are written to."""
    if isinstance(out, str) and out.endswith(("/", os.sep)):
        raise CLIError(f"--out {out}: is a folder; give a file name such as {Path(out) / 'klein.png'}")
    out = Path(out).expanduser()  # "~/renders/x.png" quoted (no shell expanded it): the home folder, not "./~"
    if out.name in ("", ".", "..") or is_folder(out):
        raise CLIError(f"--out {out}: is a folder; give a file name such as {out / 'klein.png'}")
    if not out.suffix:
        out = out.with_name(out.name + ".png")  # as batches have always done: PNG, which keeps the parameters
    formats = Image.registered_extensions()
    fmt = formats.get(out.suffix.lower())
    if fmt is None or fmt not in Image.SAVE or not _writes_rgb(fmt):
        raise CLIError(f"--out {out}: PIL cannot write {out.suffix!r} files of RGB pictures; use .png (keeps the "
                       "parameters), .jpg or .webp")
    if (why := unwritable(out)) is not None:  # the nearest folder that exists must be one; a name it takes
        raise CLIError(f"--out {out}: {why}")
    return out


@functools.cache
def _writes_rgb(fmt: str) -> bool:
    """Whether PIL writes an RGB picture in format ``fmt``: some have a save handler that refuses RGB
    (XBM writes 1-bit pictures) or is a stub (GRIB, BUFR), found only at the end otherwise."""
    try:
        Image.new("RGB", (1, 1)).save(io.BytesIO(), format=fmt)
    except Exception:  # noqa: BLE001 - PIL's writers raise OSError, ValueError, KeyError...
        return False
    return True


def output_paths(out: Path, n: int) -> list[Path]:
    """The files ``n`` images go to: ``out`` itself for one, else ``<stem>_00<suffix>``, ``_01``..."""
    if n == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i:02d}{out.suffix or '.png'}") for i in range(n)]


def check_out_names(out: Path, n: int) -> None:
    """Before anything loads: each of the ``n`` files the images go to can be written (a name the file
    system takes, not a folder), so a generation is not lost at the end."""
    for p in output_paths(out, n):
        if (why := unwritable(p)) is not None:
            raise CLIError(f"--out {out}: the image{'' if n == 1 else 's'} would go to {p}: {why}")


def warn_replaced(out: Path, n: int) -> None:
    """Said at the start (once the request is checked), as a training run does: a second run with the
    default ``--out`` would otherwise replace the first run's picture without a word."""
    if replaced := [str(p) for p in output_paths(out, n) if p.exists()]:
        logger.warning("--out: %s exist%s; this run replaces %s when it ends", ", ".join(replaced),
                       "s" if len(replaced) == 1 else "", "it" if len(replaced) == 1 else "them")


def _save_images(result: GenerationResult, out: Path, params: dict) -> list[Path]:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--out {out}: cannot make the folder {out.parent} ({exc.strerror or exc})") from None
    paths = []
    images = result.images or []
    for i, (img, p) in enumerate(zip(images, output_paths(out, len(images)), strict=True)):
        meta = PngInfo()
        meta.add_text("parameters", json.dumps({**params, "batch_index": i}))
        meta.add_text("Software", f"klein_core {__version__}")
        try:
            # whole or not at all: a full disk or Ctrl+C midway keeps the picture that was there
            with atomic_path(p) as tmp:
                img.save(tmp, format=Image.registered_extensions()[p.suffix.lower()], pnginfo=meta)
        except OSError as exc:  # a folder or a read-only place met at the end: one line, naming the file
            raise CLIError(f"--out {p}: cannot write it ({exc.strerror or exc})"
                           + (f"; images written before it: {', '.join(map(str, paths))}" if paths else "")) from None
        paths.append(p)
    return paths


def refuse_unused_with_demo(args: argparse.Namespace) -> None:
    """``--demo``'s tiny models are built in memory: a model file or a quantisation asked for beside it
    would not run (nor be recorded truly in the PNG's parameters). Shared by generate, batch and serve."""
    if not args.demo:
        return
    ignored = [flag for flag, value in (("--model", args.model), ("--models-dir", args.models_dir),
                                        ("--transformer", args.transformer), ("--text-encoder", args.text_encoder),
                                        ("--vae", args.vae), ("--quantize", args.quantize)) if value]
    if ignored:
        raise CLIError(f"--demo runs tiny random models built in memory; {', '.join(ignored)} would not be used. "
                       "Leave --demo out to run model files.")


def _check_request(args: argparse.Namespace, refs: list[Image.Image]) -> None:
    """Every number checked before anything loads (a wrong size must not wait for 16 GB of weights)."""
    args.out = check_out(args.out)
    refuse_unused_with_demo(args)
    if args.demo and not refs and args.image is None:  # the tiny models are quick at 256 px; a side given is kept
        args.width = 256 if args.width is None else args.width
        args.height = 256 if args.height is None else args.height
    first = reference_size(*oriented_size(refs[0])) if refs else None
    source = "reference 1 ({}x{} px)".format(*oriented_size(refs[0])) if refs else None
    # warns once of a side not a multiple of 16; a side taken from a too small reference names it
    width, height = resolve_size(args.width, args.height, first, size_from=source)
    # The given sides go on rounded, so the engine (which resolves the size again) has nothing to warn about.
    args.width = None if args.width is None else width
    args.height = None if args.height is None else height
    if args.steps is not None and not 1 <= args.steps <= MAX_STEPS:
        raise CLIError(f"--steps must be from 1 to {MAX_STEPS}, got {args.steps}")
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 0):
        raise CLIError(f"--guidance must be a finite number >= 0, got {args.guidance}")
    if args.batch < 1:
        raise CLIError(f"--batch must be at least 1, got {args.batch}")
    check_out_names(args.out, args.batch)
    if not 0 <= args.seed <= MAX_SEED:
        raise CLIError(f"--seed must be from 0 to 2^64-1, got {args.seed}")
    if args.image is None:
        for flag, value in (("--mask", args.mask), ("--strength", args.strength), ("--outpaint", args.outpaint),
                            ("--crop-padding", args.crop_padding), ("--feather", args.feather or None),
                            ("--no-composite", args.no_composite or None)):
            if value is not None:
                raise CLIError(f"{flag} needs --image (the picture to start from)")
    elif args.width is not None or args.height is not None:
        raise CLIError("--width/--height: with --image the output takes the picture's size")
    if args.strength is not None and not 0 < args.strength <= 1:
        raise CLIError(f"--strength must be in (0, 1], got {args.strength}")
    if args.mask is not None and args.outpaint is not None:
        raise CLIError("--outpaint makes its own mask; give --mask or --outpaint, not both")
    # The engine's own words, before anything loads (it would refuse them only after the models).
    if args.feather is not None and args.feather < 0:
        raise CLIError(f"--feather: feather must be a whole number of pixels >= 0, got {args.feather}")
    if args.crop_padding is not None:
        if args.crop_padding < 0:
            raise CLIError(f"--crop-padding: crop_padding must be a whole number of pixels >= 0, got "
                           f"{args.crop_padding}")
        if args.mask is None and args.outpaint is None:
            raise CLIError("--crop-padding: crop_padding needs a mask (--mask or --outpaint): it crops the "
                           "region around the mask")


def open_image(flag: str, path: Path) -> Image.Image:
    """The picture at ``path``, fully read (pixels decoded now); else one CLIError naming ``flag`` and
    ``path``: missing, not a regular file, unreadable, not an image, truncated or damaged, or over
    PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CLIError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise CLIError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # a path the OS cannot take (an embedded NUL byte)
        raise CLIError(f"{flag} {str(path)!r}: not a usable file path ({exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise CLIError(f"{flag} {path}: is a folder, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise CLIError(f"{flag} {path}: not a regular file")
    img = None
    try:
        img = Image.open(path)
        refuse_bomb(img)  # PIL only warns up to twice the limit
        img.load()
        return img
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        msg = f"{flag} {path}: too large to read safely ({exc})"
    except Image.UnidentifiedImageError:
        msg = f"{flag} {path}: not an image file (or a format PIL cannot read)"
    except OSError as exc:
        msg = f"{flag} {path}: cannot read it ({exc.strerror or exc})" if exc.errno is not None else \
            f"{flag} {path}: the image is damaged or truncated ({exc})"
    except Exception as exc:  # noqa: BLE001 (PIL's decoders raise many kinds for a damaged file)
        msg = f"{flag} {path}: the image is damaged ({type(exc).__name__}: {exc})"
    if img is not None:
        img.close()
    raise CLIError(msg)


def _init_image(args: argparse.Namespace) -> tuple[Image.Image, Image.Image | None] | None:
    """--image / --mask / --outpaint as (picture, mask), read before any model loads."""
    if args.image is None:
        return None
    image = open_image("--image", args.image)
    mask = None if args.mask is None else open_image("--mask", args.mask)
    if args.outpaint is not None:
        try:
            left, top, right, bottom = (int(v) for v in args.outpaint.split(","))
            image, mask = outpaint(image, left, top, right, bottom, feather=args.feather)
        except ValueError as exc:
            raise CLIError(f"--outpaint {args.outpaint}: {exc} (give four pixel counts: left,top,right,bottom)") \
                from None
    return image, mask


def run_generate(args: argparse.Namespace) -> int:
    device = as_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = as_dtype(args.dtype, "--dtype") or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    refs = []
    for r in args.ref:
        refs.append(open_image("--ref", r))
    init = _init_image(args)
    _check_request(args, refs)
    warn_replaced(args.out, args.batch)
    text = TextOptions(max_tokens=None if args.max_tokens == "whole" else 512,
                       activations=torch.float32 if args.text_precision == "fp32" else None,
                       trim=TRIM_MULTIPLE if args.trim_padding else None)
    cache = default_prompt_cache
    if args.prompt_cache is not None:
        try:
            cache = PromptCache(disk=DiskPromptCache(args.prompt_cache.expanduser()))
        except OSError as exc:
            raise CLIError(f"--prompt-cache {args.prompt_cache}: {exc.strerror or exc}") from None
    cond, text_encoder = None, None
    t_load = time.perf_counter()
    if args.demo:
        from .testing.tiny import build_tiny_components

        transformer, text_encoder, vae = build_tiny_components()
        transformer, text_encoder, vae = (m.to(device=device, dtype=dtype) for m in (transformer, text_encoder, vae))
        names = {"transformer": "demo", "text_encoder": "demo", "vae": "demo"}
        kind = "base" if args.base else "distilled"
        write_line(sys.stderr, "--demo: tiny random models built in memory (no download) check the install; "
                           "the image will be noise.\n")
    else:
        from .files.loaders import load_text_encoder, load_transformer, load_vae

        tr_path, te_path, vae_path = resolve_files(args)
        guessed = guess_model_kind(tr_path)  # the name, or a diffusers repo's model_index.json and folder name
        kind = "base" if args.base else "distilled" if args.distilled and guessed == "base" else guessed
        if args.ref_mode is None and guessed == "kv":  # a 9B-KV file runs its references in KV mode, --base or not
            args.ref_mode = "kv"
        transformer = load_transformer(tr_path, device=device, dtype=dtype, quantize=args.quantize)
        if args.prompt_cache is not None and not args.lora:  # LoRAs may change the encoder: encode anew
            cfg = kind == "base" and (args.guidance is None or args.guidance > 1)
            cond = Engine(prompt_cache=cache, text=text).cached_prompts(
                [args.prompt], args.negative_prompt if cfg else None,
                identity=encoder_identity(te_path, dtype, device))
        if cond is None:
            text_encoder = load_text_encoder(te_path, device=device, dtype=dtype)
        elif not args.quiet:
            write_line(sys.stderr, f"prompt embeddings from {args.prompt_cache}; {te_path.name} not loaded\n")
        vae = load_vae(vae_path, device=device, dtype=dtype)
        names = {"transformer": tr_path.name, "text_encoder": te_path.name, "vae": vae_path.name}
    if args.lora:
        from .lora import apply_loras, load_lora
        from .lora.apply import exact_mode

        # Packed blocks (GGUF, NVFP4) in either model take branches. The text encoder is None when
        # the prompt came from the cache.
        apply_loras((transformer, text_encoder), [(load_lora(p), s) for p, s in args.lora],
                    mode=exact_mode(transformer, text_encoder))
    step_cache = _step_cache(args, transformer, kind)
    t_load = time.perf_counter() - t_load
    t0 = time.perf_counter()
    result = generate(
        transformer, text_encoder, vae, prompt=args.prompt, negative_prompt=args.negative_prompt,
        references=refs, width=args.width, height=args.height, steps=args.steps, guidance=args.guidance,
        seed=args.seed, batch_size=args.batch, kind=kind, callback=_Progress(args.quiet),
        cache=cache, text=text, prompt_embeds=cond.positive if cond is not None else None,
        image=init[0] if init else None, mask=init[1] if init else None, strength=args.strength,
        mask_crop_padding=args.crop_padding, composite=not args.no_composite, feather=args.feather,
        ref_mode=args.ref_mode,
        negative_embeds=cond.negative if cond is not None else None, speed=args.speed, vae_tile=args.vae_tile,
    )
    total = time.perf_counter() - t0
    # Everything that changed the pixels, resolved, so the parameters can reproduce the image: the
    # weights' dtype and quantisation, the batch size, exact LoRA strengths and every inpaint option.
    params = {
        # the negative prompt only where CFG ran (guidance as run > 1 on a base model): else it changed nothing
        "prompt": args.prompt, "negative_prompt": args.negative_prompt if kind == "base" and result.guidance > 1 else "",
        "width": result.width,
        "height": result.height, "steps": result.steps, "guidance": result.guidance, "seed": args.seed,
        "batch": args.batch, "model_kind": kind, "references": [str(r) for r in args.ref],
        "reference_sizes": [list(s) for s in result.reference_sizes],
        "demo": bool(args.demo), **names, "loras": [f"{p.name}:{strength_text(s)}" for p, s in args.lora],
        "dtype": str(dtype).removeprefix("torch."), "quantize": args.quantize,
        "text_precision": args.text_precision, "max_tokens": args.max_tokens,
        "trim_padding": TRIM_MULTIPLE if args.trim_padding else None,
        "ref_mode": reference_mode(kind, args.ref_mode),
        "speed": args.speed,
        "vae_tile": vae_tile_text(args.vae_tile),
        "decode_tiles": result.decode_tiles,
        "step_cache": None if step_cache is None else _step_cache_record(step_cache),
        "environment": run_environment(transformer),
        **({"image": str(args.image), "mask": str(args.mask) if args.mask else None,
            "strength": _resolved_strength(args), "outpaint": args.outpaint, "crop_padding": args.crop_padding,
            "feather": args.feather, "composite": not args.no_composite} if args.image else {}),
    }
    paths = _save_images(result, args.out, params)
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    write_line(sys.stdout, f"{len(paths)} image(s) {result.width}x{result.height} in {total:.2f} s "
                       f"(load {t_load:.2f} s; {stages}) -> {', '.join(str(p) for p in paths)}\n")
    if not args.quiet:
        write_line(sys.stderr, f"speed {describe_speed(transformer)}\n")
        if step_cache is not None:
            rec = _step_cache_record(step_cache)
            write_line(sys.stderr, f"step cache (threshold {rec['threshold']:g}): {rec['skipped']} of "
                                   f"{rec['forwards']} forwards skipped the blocks after the first; approximate: "
                                   "compare with a run without --step-cache\n")
    return 0


def _step_cache(args: argparse.Namespace, transformer: Any, kind: str) -> StepCache | None:
    """``--step-cache``: the cache attached to ``transformer``, or None when not asked for."""
    if args.step_cache is None:
        return None
    steps = args.steps or (50 if kind == "base" else 4)
    if args.image is not None:  # image to image runs the last steps of the schedule only
        steps = steps_to_run(steps, _resolved_strength(args))
    can_skip = max(0, steps - DEFAULT_WARMUP - 1)  # the first steps and the last always run
    if kind != "base" and not args.quiet:
        write_line(sys.stderr, f"--step-cache is meant for base models (20-50 steps): of these {steps} steps "
                               f"at most {can_skip} can skip\n")
    return enable_step_cache(transformer, threshold=args.step_cache)


def _step_cache_record(cache: StepCache) -> dict[str, Any]:
    """What the step cache did in the last run, for the image's parameters and the summary line."""
    st = cache.last_run
    return {"threshold": cache.settings.threshold, "warmup": cache.settings.warmup, "forwards": st.forwards,
            "skipped": st.skipped, "patterns": list(st.patterns)}


def _resolved_strength(args: argparse.Namespace) -> float:
    """The strength that ran: the given one, else the engine's default (the mask from --outpaint counts)."""
    if args.strength is not None:
        return float(args.strength)
    masked = args.mask is not None or args.outpaint is not None
    return DEFAULT_STRENGTH_INPAINT if masked else DEFAULT_STRENGTH_IMAGE_TO_IMAGE


class _StderrHandler(logging.StreamHandler):
    """A warning during a progress bar starts on a line of its own (see :func:`write_line`). Writes to
    the ``sys.stderr`` of the moment (as :data:`logging.lastResort` does), not the one of the first
    run: a later ``main()`` with stderr redirected gets its own warnings."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the current stderr is always used
        pass

    def emit(self, record: logging.LogRecord) -> None:
        global _bar_open
        if _bar_open:
            self.stream.write("\n")
            _bar_open = False
        super().emit(record)


def log_to_stderr() -> None:
    """Show klein_core's warnings on stderr in the CLI process (library users configure their own).
    PIL's DecompressionBombWarning is silenced there: :func:`~klein_core.pipeline.images.refuse_bomb`
    refuses such a picture with a message of its own."""
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    root = logging.getLogger("klein_core")
    if not any(getattr(h, "_klein_cli", False) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        handler.setLevel(logging.WARNING)  # the handler filters; the logger's own level is left alone
        handler._klein_cli = True  # type: ignore[attr-defined]
        root.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:  # the default command, so naming it is optional
        argv = argv[1:]
    if argv[:1] and argv[0] in COMMANDS:
        args, run = _command(argv[0], argv[1:])
    else:
        args, run = build_parser().parse_args(argv), run_generate
    log_to_stderr()
    try:
        return run(args)
    except (CLIError, ValueError, TypeError, FileNotFoundError, WeightFormatError) as exc:
        write_line(sys.stderr, f"error: {exc}\n")
        return 2
    except (FloatingPointError, torch.OutOfMemoryError) as exc:  # a run that failed: its message says why
        write_line(sys.stderr, f"error: {exc}\n")
        return 1
    except GenerationCancelled as exc:
        write_line(sys.stderr, f"cancelled: {exc}\n")
        return 130
    except KeyboardInterrupt:
        write_line(sys.stderr, "\ncancelled\n")
        return 130
    except BaseException:  # a traceback starts on a line of its own too
        if _bar_open:
            write_line(sys.stderr, "\n")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
