"""Peak GPU memory and time of a Klein generation per memory mode, against the planner's estimate.

Builds full-size random-weight components directly on the GPU (built on the meta device, then
``to_empty`` + in-place random init, so a 9B model appears in seconds without a checkpoint), then
for every case and memory mode runs one warm-up and one measured generation stage by stage (text
encoder -> reference encode -> denoise -> decode) through :class:`klein_core.pipeline.engine.Engine` with the plan,
recording ``torch.cuda.max_memory_allocated`` and wall time per stage next to the estimate of
:mod:`klein_core.memory.planner`. The components a plan keeps ``resident`` are on the GPU for its
runs, as a user who loaded them there has them (``on_device`` in each row); the others live in
pinned CPU memory and are copied in or streamed by the engine. ``--cap-gb`` limits the allocator with
``torch.cuda.set_per_process_memory_fraction`` to emulate a smaller card (``auto`` then plans for
that size). ``--uncapped-resident`` first runs each case in ``resident`` mode with no cap at all
(the allocator's fraction at 1.0, the planner given the card's measured free memory) and then every
``--modes`` mode under the cap, so every mode's time is also reported as a ratio to the uncapped
resident run (``time_over_uncapped_resident``, per row and in the summary). Without ``--cap-gb``
the ``resident`` row of ``--modes`` is that baseline. The components run at ``--speed`` (default
``fast``: what the nodes and the CLI run, :mod:`klein_core.accel.speed`). Prints a table and
writes JSON to ``--out``; a mode that fails is recorded with its error while the others still run
(exit code 1), and an interrupt (the GPU session's timeout sends SIGINT) writes the rows so far.

Usage::

    python benchmarks/memory.py --out memory.json                       # 4B and 9B, bf16, all modes
    python benchmarks/memory.py --models 4b --precision fp8 --cap-gb 8 --modes auto --out m8.json
    python benchmarks/memory.py --models 9b --cases edit1024 --cap-gb 12 --uncapped-resident --out m9.json
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
import traceback
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from klein_core import testing as demo  # noqa: E402
from klein_core.accel.speed import DEFAULT_SPEED, SPEEDS, apply_speed, describe_speed  # noqa: E402
from klein_core.accel.text_graph import release_text_graphs  # noqa: E402
from klein_core.errors import KleinOutOfMemory  # noqa: E402
from klein_core.memory.placement import module_bytes, on_device, pin_memory_  # noqa: E402
from klein_core.memory.planner import (  # noqa: E402
    MODES,
    MemoryPlan,
    MemoryRequest,
    ModelSizes,
    choose_plan,
    estimate,
)
from klein_core.models import (  # noqa: E402
    Flux2Transformer,
    Flux2VAE,
    Qwen3Config,
    Qwen3TextEncoder,
    TransformerConfig,
    VAEConfig,
)
from klein_core.pipeline.engine import Engine  # noqa: E402
from klein_core.pipeline.request import Settings, indexed_device  # noqa: E402
from klein_core.quant.fp8 import quantize_model_  # noqa: E402

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
    ap.add_argument("--speed", choices=SPEEDS, default=DEFAULT_SPEED,
                    help=f"klein_core.accel.speed of the transformer and VAE (default {DEFAULT_SPEED}: "
                         "what the nodes and the CLI run)")
    ap.add_argument("--uncapped-resident", action="store_true",
                    help="per case, first run resident with no allocator cap (planner given the measured "
                         "free memory), then the modes under --cap-gb; times are reported as ratios to it")
    ap.add_argument("--uncapped-modes", default="",
                    help="comma list of modes also run with no cap after the uncapped resident run (implies "
                         "--uncapped-resident), e.g. swap,blocks,minimum: each mode's time over resident, "
                         "for modes the cap refuses")
    args = ap.parse_args(argv)
    args.uncapped_modes = _split(args.uncapped_modes, MODES, "mode") if args.uncapped_modes else []
    if args.uncapped_modes:
        args.uncapped_resident = True
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


@contextlib.contextmanager
def placed(components: dict[str, nn.Module], plan: MemoryPlan, device: torch.device) -> Iterator[list[str]]:
    """The components the plan keeps ``resident`` on ``device`` for the block, as a user who loaded
    them there has them; yields their names. Between modes every component lives in pinned CPU
    memory (:func:`_home`), and the engine copies a resident component that lives elsewhere in for
    each stage and drops it after (``StagePlacer``): without this, a ``resident`` row measured that
    staged run, neither the resident peak (every weight on the device at once) nor its time (no
    copies). The pinned homes are kept, so nothing is pinned again."""
    # A plan that does not fit is refused by the engine before anything runs: copy nothing for it.
    names = [c for c, where in plan.placements.items() if where == "resident" and c in components] \
        if plan.fits else []
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(on_device(components[name], device))
        try:
            yield names
        finally:
            for name in names:  # their graphs point at the copies about to be dropped: free them too
                release_text_graphs(components[name])


def _locked_bytes() -> int | None:
    """Page-locked CPU memory torch's allocator holds in this process (None where torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        return stats().get("allocated_bytes.current") if stats is not None and torch.cuda.is_available() else None
    except RuntimeError:
        return None


def _home(components: dict[str, nn.Module]) -> None:
    """Every component back to (pinned) CPU memory: each mode starts from the same state."""
    for m in components.values():
        release_text_graphs(m)  # a graph's memory pool would count in the next mode's peak
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
    env["speed"] = args.speed
    env["speed_resolved"] = {}
    results: list[dict] = []
    interrupted = False
    try:
        _measure(args, device, dtype, env, results)
    except KeyboardInterrupt:  # the GPU session's timeout (SIGINT): keep the rows measured so far
        interrupted = True
        print("interrupted: writing the rows measured so far", flush=True)
    report = {"env": env, "results": results, "summary": summarize(results)}
    if interrupted:
        report["interrupted"] = True
    for line in report["summary"]["lines"]:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if interrupted:
        raise SystemExit(130)
    return report


def _measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, env: dict,
             results: list[dict]) -> None:
    """Every model, precision, case and mode of ``args``: one row each appended to ``results`` as it is
    measured (``--uncapped-resident`` first per case)."""
    for model in args.models:
        for precision in args.precision:
            _cap(device, None)  # the components are built on the GPU, then moved to pinned CPU memory
            tr, te, vae = build_components(model, precision, device, dtype)
            apply_speed(tr, vae, args.speed, te)  # what the nodes and the CLI do after loading (in place)
            comps = {"text_encoder": te, "transformer": tr, "vae": vae}
            sizes = ModelSizes.from_modules(tr, te, vae)
            _home(comps)
            # the components' CPU homes, page-locked (packed into chunks since the twenty-first session)
            env.setdefault("pinned_homes", {})[f"{model} {precision}"] = {
                "weights_bytes": sum(module_bytes(m) for m in comps.values()), "locked_bytes": _locked_bytes()}
            for case in args.cases:
                req = _tiny_request(CASES[case]) if model == "tiny" else CASES[case]
                est = estimate(req, sizes)
                runs: list[tuple[str, float | None, bool]] = [(mode, args.cap_gb, False) for mode in args.modes]
                if args.uncapped_resident:  # first: the reference of every time below, then other uncapped modes
                    uncapped = ["resident", *(m for m in args.uncapped_modes if m != "resident")]
                    runs = [(m, None, True) for m in uncapped] + runs
                case_rows: list[dict] = []
                for mode, cap_gb, extra in runs:
                    _cap(device, cap_gb)
                    free = _free_bytes(args, device) if cap_gb is not None else _measured_free(device)
                    plan = choose_plan(est, free, mode=mode)
                    row = {"model": model, "precision": precision, "case": case, "mode": mode,
                           "cap_gb": cap_gb, "uncapped_run": extra,
                           "speed": args.speed, "request": asdict(req), "plan": plan.name,
                           "placements": dict(plan.placements), "vae_tile": plan.vae_tile, "fits": plan.fits,
                           "reason": plan.reason, "free_bytes": free, "estimated_peak": plan.peak_bytes,
                           "estimated_stages": est.stage_peaks(plan)}
                    try:
                        with placed(comps, plan, device) as row["on_device"]:
                            run_generation(comps, req, plan, device, args.steps)  # warm-up (first moves, kernels)
                            row.update(run_generation(comps, req, plan, device, args.steps))
                    except (torch.OutOfMemoryError, KleinOutOfMemory) as exc:  # refused up front, or ran out
                        row.update(oom=str(exc).splitlines()[0])
                    except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the other rows
                        traceback.print_exc()
                        row.update(error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
                    finally:
                        _home(comps)
                    if row.get("peak_total"):
                        row["estimate_over_measured"] = plan.peak_bytes / row["peak_total"]
                    row["host_locked_bytes"] = _locked_bytes()  # streamed blocks' homes included
                    case_rows.append(row)
                    results.append(row)
                    _time_ratios(case_rows)  # known as soon as the reference ran: printed with the row
                    _print_row(row)
            env["speed_resolved"][f"{model} {precision}"] = describe_speed(tr)
            del tr, te, vae, comps
            if device.type == "cuda":
                torch.cuda.empty_cache()


def summarize(results: list[dict]) -> dict:
    """Per (model, precision, case): auto's time over resident's (both under the same cap), the
    worst estimate error and, where an uncapped resident run exists, every mode's time over it."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        key = f"{r['mode']}{UNCAPPED}" if r.get("uncapped_run") else r["mode"]
        groups.setdefault((r["model"], r["precision"], r["case"]), {})[key] = r
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
        timed = {k: r["time_over_uncapped_resident"] for k, r in rows.items()
                 if "time_over_uncapped_resident" in r}
        reference = next((k for k, r in rows.items() if r.get("time_reference")), None)
        if reference is not None:
            entry["uncapped_resident_s"] = rows[reference]["total_s"]
            entry["time_over_uncapped_resident"] = timed
        out.append(entry)
        text = [f"{k} {v:.3f}" for k, v in entry.items() if isinstance(v, float)]
        text += [f"{k}/uncapped-resident {v:.2f}x" for k, v in timed.items() if k != reference]
        text += [f"{k} not run ({(r.get('oom') or r['error'])[:60]})" for k, r in rows.items()
                 if "oom" in r or "error" in r]
        lines.append(f"{model} {precision} {case}: " + ", ".join(text))
    return {"groups": out, "lines": lines}


UNCAPPED = "(uncapped)"  # suffix of the uncapped runs' names in the summary (beside the capped modes)


def _time_ratios(rows: list[dict]) -> None:
    """Every timed row of one case gets its total and denoise time over the uncapped resident run's:
    --uncapped-resident's first run, else (no --cap-gb) the resident mode's row. In place."""
    base = next((r for r in rows if r["mode"] == "resident" and r.get("cap_gb") is None and "total_s" in r),
                None)
    if base is None:
        return
    base["time_reference"] = True
    for r in rows:
        if "total_s" in r:
            r["time_over_uncapped_resident"] = r["total_s"] / base["total_s"]
            r["denoise_over_uncapped_resident"] = r["time_s"]["denoise"] / base["time_s"]["denoise"]


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
    return _measured_free(device)


def _measured_free(device: torch.device) -> int:
    """What the card really has free (ignores --cap-gb and --free-gb): the uncapped run plans with it."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(64 * GB)  # CPU smoke test: pretend a big card


def _gb(v: int | None) -> str:
    return "-" if v is None else f"{v / GB:6.2f}"


def _print_row(r: dict) -> None:
    tile = f"t{r['vae_tile']}" if r["vae_tile"] else "  -"
    measured = "OOM" if "oom" in r else "ERROR" if "error" in r else _gb(r.get("peak_total"))
    ratio = f"{r['estimate_over_measured']:.2f}" if r.get("estimate_over_measured") else "  -"
    secs = f"{r['total_s']:.2f}s" if "total_s" in r else "-"
    cap = "no cap" if r.get("cap_gb") is None else f"cap {r['cap_gb']:g}G"
    vs = r.get("time_over_uncapped_resident")
    vs = f" ({vs:.2f}x uncapped resident)" if vs is not None else ""
    print(f"{r['model']:>4} {r['precision']:>4} {r['case']:>12} {r['mode']:>8} {cap:>9} | {r['plan']:<34} "
          f"{tile:>4} | est {_gb(r['estimated_peak'])} GB  measured {measured} GB  est/meas {ratio} | "
          f"{secs}{vs}", flush=True)


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["results"]) else 0)  # the rows are written either way
