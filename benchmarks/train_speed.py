"""LoRA training speed and peak memory of klein_core's trainer against diffusers + peft (issue 30).

Builds full-size random-weight FLUX.2 Klein transformers directly on the GPU (meta device,
``to_empty``, :func:`klein_core.testing.fill.random_fill_` on the device; nothing goes through the
CPU), attaches a LoRA (:func:`klein_core.train.preset`, ``--preset style --rank 32`` by default) and
times :meth:`klein_core.train.Trainer.train_step` (AdamW, gradient clipping 1.0, gradient
checkpointing on: the :class:`~klein_core.train.TrainConfig` defaults) on one cached random sample:
latents ``[1, 128, 64, 64]`` (1024x1024), prompt embeddings ``[1, 512, 7680]`` (4B) or
``[1, 512, 12288]`` (9B), and for an edit one more ``[1, 128, 64, 64]`` reference. The sample stays
on the CPU in float32, as the trainer's latent cache keeps it; each step moves it to the device.

Cases (``--cases``, comma list or ``all``):

* ``4b``: Klein 4B, text only, bf16 base. Target: peak <= 16 GB.
* ``9b``: Klein 9B, text only, bf16 base (no target; the like-for-like row against diffusers).
* ``9b_edit``: Klein 9B, one 1024x1024 reference, bf16 base (like-for-like against diffusers).
* ``9b_blocks``: ``9b`` with the blocks streamed from pinned CPU memory through the device
  (``BlockOffloader.run`` inside the gradient checkpoint, as ``TrainJob(memory="blocks")``); the
  blocks go back to the device afterwards. No target: its peak and its cost against ``9b``.
* ``9b_fp8``: Klein 9B, text only, the block linears in fp8 (:func:`klein_core.quant.fp8.quantize_model_`,
  as ``TrainJob(quantize="fp8")`` loads them). Target: peak <= 24 GB.
* ``9b_edit_fp8``: ``9b_fp8`` with one reference. Targets: peak <= 24 GB and time per step <= 2.2x
  ``9b_fp8``'s.

``--speed fast`` / ``compile`` / ``plain`` puts our transformer on that path first, as ``TrainJob(speed=...)``
does (default ``fast``, the trainer's default since 2026-11-27); diffusers runs as it always does.

Per case: ``--warmup`` untimed steps, then ``--steps`` timed ones (the benchmarks' one timing loop,
``benchmarks.timing.call_times``: CUDA events on a GPU); it reports the median seconds per step, it/s (1 / median), the peak
``torch.cuda.max_memory_allocated`` since ``reset_peak_memory_stats`` at the start of the case
(weights, LoRA, optimizer state and activations: the whole training process), in GB (1e9 bytes:
the targets' unit, the stricter reading) and GiB, and the verdict against the case's targets.
Nothing is estimated: a row has the numbers it measured, or its error.

fp8: the trainer's ``FP8Linear`` layers take ``torch._scaled_mm`` on GPUs with fp8 matmuls
(``--fp8-matmul auto``, the default, as training runs them; their backward multiplies by the upcast
weight, since ``_scaled_mm`` has no derivative). Should that still fail, the error is recorded in the
row (``fp8_auto_error``) and the case is measured again with the layers upcasting their weights
(``fp8_matmul: "upcast"``); ``--no-fp8-retry`` keeps the error instead. ``--fp8-matmul upcast`` /
``scaled_mm`` force a path (``scaled_mm`` works on the CPU too).

Peer: diffusers' ``Flux2Transformer2DModel`` in bf16 with a peft LoRA (``add_adapter(LoraConfig)``, as
diffusers' Klein LoRA script) on exactly the linears our preset adapts (a fused ``qkv`` is diffusers'
``to_q``/``to_k``/``to_v``, so both train the same number of parameters, checked per case), LoRA
parameters cast to float32 (diffusers' ``cast_training_params``; ours are float32 too),
``enable_gradient_checkpointing()``, AdamW with the same settings, the same objective (sigmas drawn
as ours), the same shapes, timed the same way. diffusers has no fp8 base: its row for an fp8 case is
the bf16 model on the same shapes (said in the table). One diffusers run per (model, references)
serves every case with those shapes. ``--no-diffusers`` skips it; when diffusers or peft cannot be
imported the report says so and our rows are still measured.

Each model is built once (the 9B fp8 cases quantise the 9B bf16 model in place after its bf16 cases)
and freed before the next one; diffusers' model after ours.

Usage (GPU, from the repository root)::

    python benchmarks/train_speed.py --out train.json                       # every case, with diffusers
    python benchmarks/train_speed.py --cases 9b_fp8,9b_edit_fp8 --no-diffusers --out t9.json
    python benchmarks/train_speed.py --tiny --device cpu --out /tmp/train_tiny.json  # CPU self-test

``--tiny`` uses the tiny test transformers (:mod:`klein_core.testing.tiny`: ``TINY_4B`` for 4B,
``TINY_9B`` for 9B), 8x8 latents and 16 text tokens, float32 on the CPU: it checks the script, its
numbers mean nothing. On the CPU peak memory is null.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.peers import diffusers_flux2_transformer
from benchmarks.timing import call_times
from klein_core.accel.speed import DEFAULT_SPEED, SPEEDS, apply_speed
from klein_core.memory.placement import BlockOffloader
from klein_core.models import Flux2Transformer, TransformerConfig
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.pipeline.request import indexed_device
from klein_core.quant.fp8 import FP8Linear, quantize_model_, scaled_mm_available
from klein_core.testing.fill import full_size_configs, random_fill_
from klein_core.testing.tiny import TINY_4B, TINY_9B, tiny_transformer
from klein_core.train import PRESETS, LoRASet, TrainConfig, Trainer, TrainSample, preset
from klein_core.train.objective import sample_density, sigmas_for
from klein_core.train.save import diffusers_names

GB = 1e9
GiB = 1024**3
SEED = 1234
TEXT_TOKENS = 512
FP8_MATMULS = ("auto", "upcast", "scaled_mm")


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "4b" / "9b"
    precision: str  # "bf16" / "fp8" (the base's block linears)
    refs: int
    peak_target_gb: float | None = None
    ratio_of: str | None = None  # time per step compared with this case's ...
    ratio_target: float | None = None  # ... at most this many times
    streamed: bool = False  # the blocks stream from CPU memory (TrainJob(memory="blocks"))


CASES: dict[str, Case] = {c.name: c for c in (
    Case("4b", "4b", "bf16", 0, peak_target_gb=16.0),
    Case("9b", "9b", "bf16", 0),
    Case("9b_edit", "9b", "bf16", 1),
    Case("9b_blocks", "9b", "bf16", 0, streamed=True),
    Case("9b_fp8", "9b", "fp8", 0, peak_target_gb=24.0),
    Case("9b_edit_fp8", "9b", "fp8", 1, peak_target_gb=24.0, ratio_of="9b_fp8", ratio_target=2.2),
)}
DEFAULT_CASES = ",".join(CASES)


def transformer_config(model: str, tiny: bool) -> TransformerConfig:
    if tiny:
        return tiny_transformer(TINY_4B if model == "4b" else TINY_9B).config
    return full_size_configs(KLEIN_4B if model == "4b" else KLEIN_9B)[0]


def sample_shape(tiny: bool) -> tuple[int, int]:
    """(latent side, text tokens): 1024x1024 is 64x64 latents; --tiny 8x8 and 16 tokens."""
    return (8, 16) if tiny else (64, TEXT_TOKENS)


def make_sample(cfg: TransformerConfig, refs: int, tiny: bool) -> TrainSample:
    side, tokens = sample_shape(tiny)
    g = torch.Generator().manual_seed(SEED)
    lat = torch.randn(1, cfg.in_channels, side, side, generator=g)
    text = torch.randn(1, tokens, cfg.context_dim, generator=g)
    references = tuple(torch.randn(1, cfg.in_channels, side, side, generator=g) for _ in range(refs))
    return TrainSample(lat, text, references)


# ---------------------------------------------------------------------------------------------
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step: Callable[[], float], device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Run ``warmup`` then ``steps`` training steps (timed by :func:`benchmarks.timing.call_times`);
    median seconds per step, peak memory of them all (from the memory allocated at the start:
    weights, LoRA), losses."""
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if cuda else None
    losses: list[float] = []
    t0 = time.perf_counter()
    for _ in range(warmup):  # the optimizer's state, cuDNN/cuBLAS choices, the allocator's pool
        losses.append(step())
    _sync(device)
    warm_s = (time.perf_counter() - t0) / warmup if warmup else None
    times = [ms / 1000.0 for ms in call_times(lambda: losses.append(step()), device, steps)]
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {
        "s_per_step": med, "it_per_s": 1.0 / med, "step_s": times, "warmup_s_per_step": warm_s,
        "peak_bytes": peak, "peak_gb": peak / GB if peak is not None else None,
        "peak_gib": peak / GiB if peak is not None else None,
        "start_gib": start / GiB if start is not None else None,
        "losses": losses, "finite": all(math.isfinite(v) for v in losses),
    }


# ---------------------------------------------------------------------------------------------
# klein_core


def build_ours(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype) -> Flux2Transformer:
    """A random-weight transformer built on the device (meta -> to_empty -> random fill there)."""
    with torch.device("meta"):
        model = Flux2Transformer(cfg)
    model.to(dtype)  # on meta: only the recorded dtype changes
    model.to_empty(device=device)
    return random_fill_(model, torch.Generator(device=device).manual_seed(SEED))


def _set_fp8_matmul(model: torch.nn.Module, mode: str) -> int:
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.matmul = mode  # instance attribute: this model only
    return len(layers)


def run_ours(model: Flux2Transformer, case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One case through klein_core's Trainer: a fresh LoRA and optimizer, ``warmup + steps`` steps."""
    sample = make_sample(model.config, case.refs, args.tiny)
    streamer = BlockOffloader(model, device, prefetch=1).attach(hooks=False) if case.streamed else None
    _free(device)  # the blocks' device memory, now in CPU memory, back to the allocator's pool
    lora = LoRASet(model, preset(args.preset, args.rank), seed=0, device=device)
    config = TrainConfig(steps=args.warmup + args.steps, seed=0)
    trainer = Trainer(model, lora, [sample], config, streamer=streamer)
    try:
        row = time_steps(trainer.train_step, device, args.warmup, args.steps)
    finally:
        trainer.close()
        if streamer is not None:
            streamer.detach(to=device)  # the next cases train resident again
            row_stats = streamer.stats
    if streamer is not None:
        row["streamed_loads"] = row_stats.loads
        row["streamed_gb_copied"] = row_stats.bytes_copied / GB
    row["lora_params"] = sum(p.numel() for p in lora.parameters())
    row["lora_dtype"] = str(next(lora.parameters()).dtype)
    row["lora_linears"] = len(lora.names())
    del trainer, lora
    return row


def run_ours_case(model: Flux2Transformer, case: Case, args: argparse.Namespace,
                  device: torch.device) -> dict[str, Any]:
    """``run_ours`` with the fp8 matmul path chosen, and the upcast retry when the fp8 matmul fails."""
    extra: dict[str, Any] = {}
    if case.precision == "fp8":
        extra["fp8_layers"] = _set_fp8_matmul(model, args.fp8_matmul)
        extra["fp8_matmul"] = args.fp8_matmul
        try:
            return {**extra, **run_ours(model, case, args, device)}
        except RuntimeError as exc:
            if "_scaled_mm" not in str(exc) or args.fp8_matmul == "upcast" or args.no_fp8_retry:
                raise
            extra["fp8_auto_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        print(f"  {case.name}: fp8 matmul {args.fp8_matmul!r} failed ({extra['fp8_auto_error']}); "
              "measuring again with the fp8 layers upcasting", flush=True)
        _free(device)
        _set_fp8_matmul(model, "upcast")
        extra["fp8_matmul"] = "upcast"
    return {**extra, **run_ours(model, case, args, device)}


# ---------------------------------------------------------------------------------------------
# diffusers + peft

def peer_targets(cfg: TransformerConfig, args: argparse.Namespace) -> dict[str, tuple[int, float]]:
    """diffusers module name -> (rank, alpha) of the LoRA our preset puts there (read from a LoRASet
    on a meta-device model of the same shape, so the two can never disagree)."""
    with torch.device("meta"):
        probe = Flux2Transformer(cfg)
    lora = LoRASet(probe, preset(args.preset, args.rank), seed=0)
    out = {}
    for core, layer in lora.items():
        for name in diffusers_names(core, layer.parts):
            out[name] = (layer.rank, layer.scale * layer.rank)
    return out


def import_peer() -> tuple[Any, Any, str | None]:
    """(diffusers, peft, None) or (None, None, why not)."""
    try:
        import diffusers
    except Exception as exc:  # noqa: BLE001 - any import failure means: no peer row, say why
        return None, None, f"diffusers: not installed ({type(exc).__name__}: {exc})"
    try:
        import peft
    except Exception as exc:  # noqa: BLE001
        return None, None, f"peft: not installed ({type(exc).__name__}: {exc})"
    diffusers.utils.logging.set_verbosity_error()  # its "cast with to()" notice, once per build
    return diffusers, peft, None


def build_diffusers(diffusers: Any, peft: Any, cfg: TransformerConfig, targets: dict[str, tuple[int, float]],
                    device: torch.device, dtype: torch.dtype) -> Any:
    """diffusers' Flux2 transformer, random weights on the device, with a peft LoRA on ``targets``
    (float32 factors, gradient checkpointing on)."""
    dm = diffusers_flux2_transformer(diffusers, cfg)
    dm.to(dtype)
    dm.to_empty(device=device)
    random_fill_(dm, torch.Generator(device=device).manual_seed(SEED))
    ranks = {r for r, _ in targets.values()}
    alphas = {a for _, a in targets.values()}
    rank, alpha = max(ranks), max(alphas)
    lora_cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=sorted(targets),
        rank_pattern={re.escape(n): r for n, (r, _) in targets.items() if r != rank},
        alpha_pattern={re.escape(n): a for n, (_, a) in targets.items() if a != alpha},
    )
    dm.add_adapter(lora_cfg)
    for n, p in dm.named_parameters():
        p.requires_grad_("lora_" in n)
    for p in dm.parameters():  # diffusers' cast_training_params(transformer, torch.float32)
        if p.requires_grad:
            p.data = p.to(torch.float32)
    dm.enable_gradient_checkpointing()
    dm.train()
    return dm


def run_diffusers(diffusers: Any, dm: Any, cfg: TransformerConfig, refs: int, args: argparse.Namespace,
                  device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The same training step in diffusers: noisy latents and reference tokens through the model,
    velocity MSE on the noisy tokens, backward, clip 1.0, AdamW (our TrainConfig's settings)."""
    pipe = diffusers.Flux2KleinPipeline
    train_cfg = TrainConfig(seed=0)
    sample = make_sample(cfg, refs, args.tiny)
    params = [p for p in dm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train_cfg.learning_rate, betas=train_cfg.betas, eps=train_cfg.eps,
                            weight_decay=train_cfg.weight_decay)
    # position ids: the pipeline's own helpers (constant for a shape; built once, as the pipeline does)
    img_ids = [pipe._prepare_latent_ids(sample.latents)]
    if sample.references:
        img_ids.append(pipe._prepare_image_ids([r for r in sample.references]))
    img_ids_d = torch.cat(img_ids, 1).to(device)
    txt_ids_d = pipe._prepare_text_ids(sample.text).to(device)
    counter = iter(range(10**9))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(SEED + next(counter))
        noise = torch.randn(sample.latents.shape, generator=g)
        sigmas, timesteps = sigmas_for(train_cfg.objective, sample_density(train_cfg.objective, 1, g))
        x0 = sample.latents.to(device=device, dtype=dtype)
        n = noise.to(device=device, dtype=dtype)
        s = sigmas.to(device=device, dtype=dtype).reshape(-1, 1, 1, 1)
        noisy = (1.0 - s) * x0 + s * n
        tokens = torch.cat([pipe._pack_latents(noisy)]
                           + [pipe._pack_latents(r.to(device=device, dtype=dtype)) for r in sample.references], 1)
        txt = sample.text.to(device=device, dtype=dtype)
        pred = dm(hidden_states=tokens, timestep=timesteps.to(device), guidance=None, encoder_hidden_states=txt,
                  txt_ids=txt_ids_d, img_ids=img_ids_d, return_dict=False)[0]
        target = pipe._pack_latents(n - x0)
        loss = torch.mean((pred[:, : target.shape[1]].float() - target.float()) ** 2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train_cfg.max_grad_norm)
        opt.step()
        return float(loss.detach())

    row = time_steps(step, device, args.warmup, args.steps)
    row["lora_params"] = sum(p.numel() for p in params)
    row["lora_dtype"] = str(params[0].dtype)
    row["lora_linears"] = sum(1 for n, _ in dm.named_modules() if n.endswith(".lora_A"))
    row["precision"] = _short(dtype)
    return row


# ---------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list of {', '.join(CASES)}, or all (default all)")
    ap.add_argument("--preset", choices=PRESETS, default="style", help="LoRA preset (default style)")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank of every group (default 32)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported, default 5)")
    ap.add_argument("--fp8-matmul", choices=FP8_MATMULS, default="auto",
                    help="FP8Linear path of the fp8 cases (default auto: what training runs)")
    ap.add_argument("--no-fp8-retry", action="store_true",
                    help="when the fp8 matmul fails, record the error instead of measuring again with upcasting")
    ap.add_argument("--speed", choices=SPEEDS, default=DEFAULT_SPEED,
                    help=f"our transformer's path while training (apply_speed; default {DEFAULT_SPEED}, as TrainJob)")
    ap.add_argument("--no-diffusers", action="store_true", help="skip the diffusers + peft peer")
    ap.add_argument("--tiny", action="store_true", help="tiny test transformers and latents (CPU self-test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="compute dtype of the base (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--out", type=Path, default=Path("out/train_speed.json"), help="JSON results file")
    args = ap.parse_args(argv)
    names = list(CASES) if args.cases.strip() == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        ap.error(f"unknown case {bad or args.cases!r}; choose from {', '.join(CASES)} or all")
    args.cases = [c for c in CASES if c in names]  # the documented order: builds each model once
    if args.steps < 1 or args.warmup < 0 or args.rank < 1:
        ap.error("--steps and --rank must be >= 1, --warmup >= 0")
    return args


def _env(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
        "dtype": str(dtype), "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, total_gib=props.total_memory / GiB,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    env["fp8_scaled_mm_available"] = scaled_mm_available(device)
    for mod in ("diffusers", "peft"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception as exc:  # noqa: BLE001
            env[mod] = f"not installed ({type(exc).__name__})"
    return env


def _case_row(case: Case, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    cfg = transformer_config(case.model, args.tiny)
    side, tokens = sample_shape(args.tiny)
    compute = _short(dtype)
    base = f"fp8 (compute {compute})" if case.precision == "fp8" else compute
    return {"case": case.name, "model": case.model, "precision": case.precision, "base": base,
            "references": case.refs,
            "preset": args.preset, "rank": args.rank, "latents": [1, cfg.in_channels, side, side],
            "text": [1, tokens, cfg.context_dim], "image_tokens": side * side * (1 + case.refs),
            "peak_target_gb": case.peak_target_gb}


def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rows: dict[str, dict],
            peers: dict[str, dict], peer_note: str | None) -> None:
    """Every case of ``args`` (one model build per model), then diffusers per (model, references)."""
    diffusers = peft = None
    if peer_note is None:
        diffusers, peft, peer_note = import_peer()
    cases = [CASES[c] for c in args.cases]
    for model_name in dict.fromkeys(c.model for c in cases):
        mine = [c for c in cases if c.model == model_name]
        cfg = transformer_config(model_name, args.tiny)
        t0 = time.perf_counter()
        try:
            model = build_ours(cfg, device, dtype)
            apply_speed(transformer=model, speed=args.speed)  # as TrainJob(speed=...) sets it
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # the diffusers row may still fit
            for case in mine:
                rows[case.name]["ours"] = {"error": f"build: {type(exc).__name__}: {str(exc).splitlines()[0]}"}
            model = None
        _sync(device)
        print(f"{model_name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            for precision in ("bf16", "fp8"):
                group = [c for c in mine if c.precision == precision]
                if not group or model is None:
                    continue
                if precision == "fp8":
                    quantize_model_(model)  # in place, one layer at a time (the bf16 copy of each is freed)
                    _free(device)
                for case in group:
                    row = rows[case.name]
                    try:
                        row["ours"] = run_ours_case(model, case, args, device)
                        print(f"  {case.name}: {row['ours']['s_per_step']:.3f} s/step, peak "
                              f"{_gb(row['ours']['peak_gb'])} GB", flush=True)
                    except (RuntimeError, torch.OutOfMemoryError) as exc:
                        row["ours"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                        if precision == "fp8":
                            row["ours"]["fp8_matmul"] = args.fp8_matmul
                        print(f"  {case.name}: {row['ours']['error']}", flush=True)
                    _free(device)
        finally:
            del model
            _free(device)
        if diffusers is None:
            continue
        targets = peer_targets(cfg, args)
        t0 = time.perf_counter()
        try:
            dm = build_diffusers(diffusers, peft, cfg, targets, device, dtype)
        except (RuntimeError, torch.OutOfMemoryError, ValueError) as exc:
            for refs in dict.fromkeys(c.refs for c in mine):
                peers[f"{model_name}/refs{refs}"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            _free(device)
            continue
        _sync(device)
        print(f"{model_name} (diffusers): built in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            for refs in dict.fromkeys(c.refs for c in mine):
                key = f"{model_name}/refs{refs}"
                try:
                    peers[key] = run_diffusers(diffusers, dm, cfg, refs, args, device, dtype)
                    print(f"  diffusers {key}: {peers[key]['s_per_step']:.3f} s/step", flush=True)
                except (RuntimeError, torch.OutOfMemoryError) as exc:
                    peers[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                    print(f"  diffusers {key}: {peers[key]['error']}", flush=True)
                _free(device)
        finally:
            del dm
            _free(device)
    if peer_note is not None:
        for row in rows.values():
            row["diffusers_note"] = peer_note


def verdicts(rows: dict[str, dict], peers: dict[str, dict]) -> list[str]:
    """Fill each row's diffusers numbers and verdicts; returns the summary lines."""
    lines = []
    for name, row in rows.items():
        case = CASES[name]
        ours = row.get("ours", {})
        peer = peers.get(f"{case.model}/refs{case.refs}")
        if peer is not None:
            row["diffusers"] = peer
            if "s_per_step" in peer and "s_per_step" in ours:
                row["diffusers_over_ours"] = peer["s_per_step"] / ours["s_per_step"]
            if "lora_params" in peer and "lora_params" in ours:
                row["lora_params_match"] = peer["lora_params"] == ours["lora_params"]
        checks = {}
        if case.peak_target_gb is not None:
            peak = ours.get("peak_gb")
            checks["peak"] = None if peak is None else peak <= case.peak_target_gb
        if case.ratio_of is not None:
            other = rows.get(case.ratio_of, {}).get("ours", {})
            if "s_per_step" in ours and "s_per_step" in other:
                ratio = ours["s_per_step"] / other["s_per_step"]
                row["time_over_" + case.ratio_of] = ratio
                checks["ratio"] = ratio <= case.ratio_target
                lines.append(f"{name} / {case.ratio_of} time per step: {ratio:.2f}x (target <= "
                             f"{case.ratio_target}x): {'pass' if checks['ratio'] else 'FAIL'}")
            else:
                checks["ratio"] = None
                lines.append(f"{name} / {case.ratio_of}: not measured (run both cases)")
        row["checks"] = checks
        if "error" in ours:
            row["verdict"] = "error"
        elif not checks:
            row["verdict"] = "no target"
        elif any(v is False for v in checks.values()):
            row["verdict"] = "FAIL"
        elif any(v is None for v in checks.values()):
            row["verdict"] = "not measured"
        else:
            row["verdict"] = "pass"
    for other in ("9b_edit", "9b_blocks"):
        ours9 = [rows.get(c, {}).get("ours", {}) for c in ("9b", other)]
        if all("s_per_step" in r for r in ours9):
            lines.append(f"{other} / 9b ({rows['9b']['base']}) time per step: "
                         f"{ours9[1]['s_per_step'] / ours9[0]['s_per_step']:.2f}x")
    d = {k: v for k, v in peers.items() if "s_per_step" in v}
    for model in ("4b", "9b"):
        if f"{model}/refs0" in d and f"{model}/refs1" in d:
            ratio = d[f"{model}/refs1"]["s_per_step"] / d[f"{model}/refs0"]["s_per_step"]
            lines.append(f"diffusers {model} ({d[f'{model}/refs0']['precision']}) edit / text time per step: "
                         f"{ratio:.2f}x")
    return lines


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype).replace("torch.", ""))


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _s(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(report: dict[str, Any], out: Any = sys.stdout) -> None:
    env = report["env"]
    print(f"\nLoRA training, {env['device_name']} ({env['device']}, {env['dtype']}), torch {env['torch']}, "
          f"diffusers {env['diffusers']}, peft {env['peft']}; ours at speed {report['args'].get('speed', 'plain')}; "
          f"preset {report['args']['preset']} rank "
          f"{report['args']['rank']}, {report['args']['steps']} timed steps after {report['args']['warmup']} warm-up "
          "(median)", file=out)
    print("\n| case | base | refs | ours s/step | ours it/s | ours peak GB (GiB) | target | verdict "
          "| diffusers s/step | diffusers peak GB | diffusers / ours | LoRA params ours / diffusers |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for name, row in report["rows"].items():
        ours = row.get("ours", {})
        peer = row.get("diffusers", {})
        base = row["base"] + (f", {ours['fp8_matmul']}" if "fp8_matmul" in ours else "")
        target = "-" if row["peak_target_gb"] is None else f"<= {row['peak_target_gb']:g} GB"
        if "time_over_" + str(CASES[name].ratio_of) in row:
            target += f", <= {CASES[name].ratio_target}x {CASES[name].ratio_of}"
        if "error" in ours:
            mine = f"error: {ours['error'][:60]} | - | - "
        else:
            peak = "-" if ours.get("peak_gb") is None else f"{ours['peak_gb']:.2f} ({ours['peak_gib']:.2f})"
            mine = f"{_s(ours.get('s_per_step'))} | {_s(ours.get('it_per_s'), '.2f')} | {peak} "
        if "error" in peer:
            theirs = f"error: {peer['error'][:60]} | - | -"
        elif peer:
            bf16 = f" ({peer['precision']})" if row["precision"] == "fp8" else ""
            theirs = (f"{_s(peer.get('s_per_step'))}{bf16} | {_gb(peer.get('peak_gb'))} | "
                      f"{_s(row.get('diffusers_over_ours'), '.2f')}x")
        else:
            theirs = "- | - | -"
        params = f"{ours.get('lora_params', '-'):,} / {peer.get('lora_params', '-'):,}" \
            if isinstance(peer.get("lora_params"), int) and isinstance(ours.get("lora_params"), int) \
            else f"{ours.get('lora_params', '-')} / {peer.get('lora_params', '-')}"
        print(f"| {name} | {base} | {row['references']} | {mine}| {target} | {row['verdict']} | {theirs} | "
              f"{params} |", file=out)
    for line in report["summary"]:
        print(line, file=out)
    notes = {row["diffusers_note"] for row in report["rows"].values() if "diffusers_note" in row}
    for note in sorted(notes):
        print(note, file=out)
    if any(row["precision"] == "fp8" for row in report["rows"].values()) and not notes:
        compute = report["env"]["dtype"].replace("torch.bfloat16", "bf16").replace("torch.float32", "fp32")
        print(f"fp8 is klein_core's only: the diffusers column of an fp8 row is diffusers' {compute} model on the "
              "same shapes.", file=out)
    for name, row in report["rows"].items():
        if "fp8_auto_error" in row.get("ours", {}):
            print(f"{name}: the fp8 matmul path failed in training ({row['ours']['fp8_auto_error']}); the row "
                  "is measured with the fp8 layers upcasting their weights.", file=out)
    if report.get("interrupted"):
        print("interrupted: the rows above are those measured before the interrupt", file=out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --tiny --device cpu for a self-test")
    device = indexed_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    env = _env(device, dtype)
    rows = {c: _case_row(CASES[c], args, dtype) for c in args.cases}
    peers: dict[str, dict] = {}
    interrupted = False
    try:
        measure(args, device, dtype, rows, peers, "diffusers: skipped (--no-diffusers)" if args.no_diffusers else None)
    except KeyboardInterrupt:  # the GPU session's timeout (SIGINT): keep the rows measured so far
        interrupted = True
        print("interrupted: writing the rows measured so far", flush=True)
    report: dict[str, Any] = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items()},
                              "rows": rows, "diffusers": peers}
    report["summary"] = verdicts(rows, peers)
    if interrupted:
        report["interrupted"] = True
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"\nfull results: {args.out}")
    if interrupted:
        raise SystemExit(130)
    return report


if __name__ == "__main__":
    report = main()
    failed = any("error" in r.get("ours", {}) or "error" in r.get("diffusers", {}) for r in report["rows"].values())
    sys.exit(1 if failed else 0)
