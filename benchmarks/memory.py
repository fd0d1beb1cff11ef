"""Peak GPU memory and time of a Klein generation per memory mode, against the planner's estimate.

Builds full-size random-weight components directly on the GPU (built on the meta device, then
``to_empty`` + in-place random init, so a 9B model appears in seconds without a checkpoint), then
for every case and memory mode runs one warm-up and one measured generation stage by stage (text
encoder -> reference encode -> denoise -> decode) through :class:`klein_core.engine.Engine` with the plan,
recording ``torch.cuda.max_memory_allocated`` and wall time per stage next to the estimate of
:mod:`klein_core.memory.planner`. ``--cap-gb`` limits the allocator with
``torch.cuda.set_per_process_memory_fraction`` to emulate a smaller card (``auto`` then plans for
that size). Prints a table and writes JSON to ``--out``.

Usage::

    python benchmarks/memory.py --out memory.json                       # 4B and 9B, bf16, all modes
    python benchmarks/memory.py --models 4b --precision fp8 --cap-gb 8 --modes auto --out m8.json
    python benchmarks/memory.py --tiny --device cpu --out /tmp/m.json   # smoke test (no GPU)

The targets it checks (issue 6): Klein 4B 1024x1024 edit with one reference within 8 GB in auto
mode, 9B within 12 GB; auto within 5% of the fastest resident plan on big cards; estimate within
15% of the measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from klein_core import testing as demo  # noqa: E402
from klein_core.engine import Engine  # noqa: E402
from klein_core.errors import KleinOutOfMemory  # noqa: E402
from klein_core.memory.placement import pin_memory_  # noqa: E402
from klein_core.memory.planner import (  # noqa: E402
    MODES,
    MemoryPlan,
    MemoryRequest,
    ModelSizes,
    choose_plan,
    estimate,
)
from klein_core.models import Flux2Transformer, Flux2VAE, Qwen3Config, Qwen3TextEncoder, TransformerConfig, VAEConfig  # noqa: E402
from klein_core.quant.fp8 import quantize_model_  # noqa: E402
from klein_core.request import Settings, indexed_device  # noqa: E402

GB = 1e9
QWEN_VOCAB = 151936


PROMPT = "a red fox sitting in fresh snow at golden hour"


def _qwen(hidden: int, inter: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=inter, vocab_size=QWEN_VOCAB, num_layers_in_file=36)


MODELS = {
    "4b": (TransformerConfig(hidden_size=3072, num_heads=24, depth=5, depth_single=20, context_dim=7680,
                             mlp_hidden=9216), _qwen(2560, 9728)),
    "9b": (TransformerConfig(hidden_size=4096, num_heads=32, depth=8, depth_single=24, context_dim=12288,
                             mlp_hidden=12288), _qwen(4096, 12288)),
}
CASES = {
    "t2i1024": MemoryRequest(1024, 1024),
    "edit1024": MemoryRequest(1024, 1024, references=((1024, 1024),)),
    "edit1024x2": MemoryRequest(1024, 1024, references=((1024, 1024), (1024, 1024))),
    "t2i2048": MemoryRequest(2048, 2048),
    "base-cfg1024": MemoryRequest(1024, 1024, cfg=True),
}
TINY_SIZE = 128  # pixels, --tiny cases keep their reference count but use this size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--models", default="4b,9b", help="comma list of 4b, 9b")
    ap.add_argument("--precision", default="bf16", help="comma list of bf16, fp8 (block Linears in fp8)")
    ap.add_argument("--cases", default="t2i1024,edit1024,t2i2048", help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cap-gb", type=float, default=None, help="emulate a card with this much memory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke test)")
    ap.add_argument("--free-gb", type=float, default=None,
                    help="free memory the planner assumes (default: measured, or --cap-gb)")
    args = ap.parse_args(argv)
    args.models = _split(args.models, MODELS, "model")
    args.precision = _split(args.precision, ("bf16", "fp8"), "precision")
    args.cases = _split(args.cases, CASES, "case")
    args.modes = _split(args.modes, MODES, "mode")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.tiny:
        args.models = ["tiny"]
    return args


def _split(value: str, allowed, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"unknown {what} {bad or value!r}; choose from {', '.join(allowed)}")
    return items


# ---------------------------------------------------------------------------------------------
# ModelSizes


def _random_init_(module: nn.Module) -> nn.Module:
    """Fill freshly ``to_empty``-ed weights in place: matrices ~N(0, 0.02), vectors 1 (norms)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return module.eval().requires_grad_(False)


def _on(factory, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        module = factory().to(dtype)  # free on meta; to_empty then allocates once, in dtype
    return _random_init_(module.to_empty(device=device))


def build_components(model: str, precision: str, device: torch.device, dtype: torch.dtype):
    """(transformer, text encoder, VAE) with random weights on ``device``."""
    if model == "tiny":
        tr, te, vae = demo.build_tiny_components()
        tr, te, vae = (m.to(device=device, dtype=dtype) for m in (tr, te, vae))
        vae.bn.float()
    else:
        tcfg, qcfg = MODELS[model]
        tr = _on(lambda: Flux2Transformer(tcfg), device, dtype)
        te = _on(lambda: Qwen3TextEncoder(qcfg), device, dtype)
        vae = _on(lambda: Flux2VAE(VAEConfig()), device, dtype)
        vae.bn.running_mean = torch.zeros_like(vae.bn.running_mean, dtype=torch.float32)
        vae.bn.running_var = torch.ones_like(vae.bn.running_var, dtype=torch.float32)
    if precision == "fp8":
        quantize_model_(tr)
        quantize_model_(te)
    return tr, te, vae


def _tiny_request(req: MemoryRequest) -> MemoryRequest:
    refs = tuple((TINY_SIZE, TINY_SIZE) for _ in req.references)
    return replace(req, width=TINY_SIZE, height=TINY_SIZE, references=refs, activation_bytes=4)


# ---------------------------------------------------------------------------------------------
# One generation, stage by stage


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _meter(name: str, device: torch.device, out: dict) -> Iterator[None]:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    yield
    _sync(device)
    out.setdefault("time_s", {})[name] = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out.setdefault("peak_bytes", {})[name] = peak


@torch.no_grad()
def run_generation(
    components: dict[str, nn.Module], req: MemoryRequest, plan: MemoryPlan, device: torch.device, steps: int,
    seed: int = 0,
) -> dict:
    """One generation following ``plan``, stage by stage through klein_core's Engine; returns
    per-stage times, peaks and a finiteness check."""
    engine = Engine(components["transformer"], components["text_encoder"], components["vae"],
                    kind="base" if req.cfg else "distilled", device=device, memory=plan, prompt_cache=None)
    out: dict = {}
    g = torch.Generator().manual_seed(seed)
    with _meter("text", device, out):
        cond = engine.encode_prompts([PROMPT] * req.batch, "" if req.cfg else None)
    with _meter("references", device, out):
        pixels = [torch.rand(1, 3, h, w, generator=g) * 2 - 1 for w, h in req.references]
        ref_lat = engine.encode_references(pixels)
    with _meter("denoise", device, out):
        settings = Settings(req.width, req.height, steps, 4.0 if req.cfg else 1.0, seed)
        latents, _ = engine.denoise(cond, ref_lat, settings)
    with _meter("decode", device, out):
        px = engine.decode(latents)
    out["finite"] = bool(torch.isfinite(px.float()).all())  # random weights: informational only
    out["total_s"] = sum(out["time_s"].values())
    peaks = [p for p in out["peak_bytes"].values() if p is not None]
    out["peak_total"] = max(peaks) if peaks else None
    return out


def _home(components: dict[str, nn.Module]) -> None:
    """Every component back to (pinned) CPU memory: each mode starts from the same state."""
    for m in components.values():
        pin_memory_(m)


# ---------------------------------------------------------------------------------------------
# Driver


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --tiny --device cpu for a smoke test")
    device = indexed_device(device)  # "cuda" -> "cuda:N": set_per_process_memory_fraction needs the index
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, total_gb=props.total_memory / GB,
                   capability=list(torch.cuda.get_device_capability(device)))
        env["cap_gb"] = args.cap_gb
    results = []
    for model in args.models:
        for precision in args.precision:
            _cap(device, None)  # the components are built on the GPU, then moved to pinned CPU memory
            tr, te, vae = build_components(model, precision, device, dtype)
            comps = {"text_encoder": te, "transformer": tr, "vae": vae}
            sizes = ModelSizes.from_modules(tr, te, vae)
            _home(comps)
            _cap(device, args.cap_gb)
            for case in args.cases:
                req = _tiny_request(CASES[case]) if model == "tiny" else CASES[case]
                est = estimate(req, sizes)
                free = _free_bytes(args, device)
                for mode in args.modes:
                    plan = choose_plan(est, free, mode=mode)
                    row = {"model": model, "precision": precision, "case": case, "mode": mode,
                           "request": asdict(req), "plan": plan.name, "placements": dict(plan.placements),
                           "vae_tile": plan.vae_tile, "fits": plan.fits, "reason": plan.reason,
                           "free_bytes": free, "estimated_peak": plan.peak_bytes,
                           "estimated_stages": est.stage_peaks(plan)}
                    try:
                        run_generation(comps, req, plan, device, args.steps)  # warm-up (first moves, kernels)
                        row.update(run_generation(comps, req, plan, device, args.steps))
                    except (torch.OutOfMemoryError, KleinOutOfMemory) as exc:  # refused up front, or ran out
                        row.update(oom=str(exc).splitlines()[0])
                    finally:
                        _home(comps)
                    if row.get("peak_total"):
                        row["estimate_over_measured"] = plan.peak_bytes / row["peak_total"]
                    results.append(row)
                    _print_row(row)
            del tr, te, vae, comps
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {"env": env, "results": results, "summary": summarize(results)}
    for line in report["summary"]["lines"]:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


def summarize(results: list[dict]) -> dict:
    """Per (model, precision, case): auto's time over resident's, and the worst estimate error."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["precision"], r["case"]), {})[r["mode"]] = r
    out, lines = [], []
    for (model, precision, case), rows in groups.items():
        entry: dict = {"model": model, "precision": precision, "case": case}
        auto, resident = rows.get("auto"), rows.get("resident")
        if auto and resident and "total_s" in auto and "total_s" in resident:
            entry["auto_over_resident_time"] = auto["total_s"] / resident["total_s"]
        if auto and auto.get("peak_total"):
            entry["auto_peak_gb"] = auto["peak_total"] / GB
        ratios = [r["estimate_over_measured"] for r in rows.values() if r.get("estimate_over_measured")]
        if ratios:
            entry["estimate_error_worst"] = max(abs(x - 1) for x in ratios)
        out.append(entry)
        lines.append(f"{model} {precision} {case}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in entry.items() if isinstance(v, float)))
    return {"groups": out, "lines": lines}


def _cap(device: torch.device, cap_gb: float | None) -> None:
    """Limit this process's CUDA allocator to ``cap_gb`` (None: the whole card)."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if cap_gb is None else min(1.0, cap_gb * GB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


def _free_bytes(args: argparse.Namespace, device: torch.device) -> int:
    if args.free_gb is not None:
        return int(args.free_gb * GB)
    if args.cap_gb is not None:
        return int(args.cap_gb * GB)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(64 * GB)  # CPU smoke test: pretend a big card


def _gb(v: int | None) -> str:
    return "-" if v is None else f"{v / GB:6.2f}"


def _print_row(r: dict) -> None:
    tile = f"t{r['vae_tile']}" if r["vae_tile"] else "  -"
    measured = "OOM" if "oom" in r else _gb(r.get("peak_total"))
    ratio = f"{r['estimate_over_measured']:.2f}" if r.get("estimate_over_measured") else "  -"
    secs = f"{r['total_s']:.2f}s" if "total_s" in r else "-"
    print(f"{r['model']:>4} {r['precision']:>4} {r['case']:>12} {r['mode']:>8} | {r['plan']:<34} {tile:>4} | "
          f"est {_gb(r['estimated_peak'])} GB  measured {measured} GB  est/meas {ratio} | {secs}", flush=True)


if __name__ == "__main__":
    main()
