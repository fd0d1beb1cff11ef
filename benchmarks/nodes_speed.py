"""What a ComfyUI user runs, timed: the pack's nodes in a chain against ``klein_core.generate``.

``speed.py`` times the engine, which is what the CLI runs. In ComfyUI the same work is split over
nodes: Qwen3 Layer-Concat Encoder, Klein Sampler and Flux2 VAE Decode, each checking its own output
before it returns (one wait for the GPU per node) and handing ComfyUI its latents and images on the
CPU. This script writes full-size random weights as the public files (the transformer in BFL names,
the Qwen3 encoder in ComfyUI's, the VAE), imports ComfyUI from ``.comfy_host`` (prepared by
``tests/e2e/setup_host.py``; the GPU session unpacks it from ``.devpack``) with the pack, loads the
files through Klein Model Loader, and times, with a new prompt each run so the encoder always runs:

* ``nodes``: encoder -> sampler -> VAE decode, each node's ``execute`` called directly (ComfyUI's
  executor, its output cache and its UI messages are not in the time);
* ``engine``: ``klein_core.generate`` on the same files loaded again (speed fast, no prompt cache);
  those loads are timed (``engine_load``: seconds and GB/s per file, from the page cache), and the
  transformer's once more with the page-locked staged reads off (``engine_load_unstaged``).

``nodes_cprofile`` is Python's profile of one more node chain (where the host time goes), and
``nodes_profile`` one more under ``torch.profiler`` (the GPU's idle gaps, each with the node whose
host work it fell in: ``klein.node.*`` ranges).

It reports medians, each node's time, their ratio and the largest pixel difference of the images
(the same prompts and seed on both sides).

Usage::

    python benchmarks/nodes_speed.py --model 4b --runs 3 --out nodes_speed_4b.json   # GPU
    python benchmarks/nodes_speed.py --tiny --device cpu --runs 1 --out /tmp/ns.json  # CPU self-test
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

import klein_core
from benchmarks import comfy_peer
from benchmarks.host_audit import HostAudit
from benchmarks.profile_run import python_profile, summarise
from benchmarks.speed import PROMPT, SEED, _spec, build_ours
from klein_core.files import staging
from klein_core.testing import write_tiny_model_files

PACK = "klein_pack_nodes"  # nodes/ as a package of its own name (ComfyUI has a top-level `nodes` module)
FOLDERS = ("diffusion_models", "text_encoders", "vae")
FILES = {"4b": ("flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors"),
         "9b": ("flux-2-klein-9b.safetensors", "qwen_3_8b.safetensors")}
VAE_FILE = "flux2-vae.safetensors"


def write_full_size_files(model: str, root: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Random full-size weights (built on ``device`` as speed.py builds them) written as the public files."""
    tr, te, vae = build_ours(_spec(model), device, dtype)
    tr_file, te_file = FILES[model]
    parts = (("diffusion_models", tr_file, tr, ""), ("text_encoders", te_file, te, "model."), ("vae", VAE_FILE, vae, ""))
    for folder, name, module, prefix in parts:
        (root / folder).mkdir(parents=True, exist_ok=True)
        save_file({prefix + k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
                  str(root / folder / name))
    del tr, te, vae


def import_pack(device: torch.device, models: Path) -> tuple[Any, Any]:
    """ComfyUI (``--cpu`` off CUDA) and the pack, with the model folders pointed at ``models``;
    returns ``(pack, its cache module)``."""
    host = comfy_peer.import_comfy(cpu=device.type != "cuda")
    comfy_peer.stand_in_for_av()
    stub = host.root.parent / "torchvision_stub"  # setup_host.py's: ComfyUI imports torchvision, unused here
    if importlib.util.find_spec("torchvision") is None and stub.is_dir() and str(stub) not in sys.path:
        sys.path.append(str(stub))
    import folder_paths

    pack = sys.modules.get(PACK)
    if pack is None:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "nodes" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "nodes")])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = pack
        spec.loader.exec_module(pack)  # type: ignore[union-attr]
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(models / f)], folder_paths.folder_names_and_paths[f][1])
    folder_paths.filename_list_cache.clear()
    asyncio.run(pack.comfy_entrypoint())
    return pack, sys.modules[f"{PACK}.cache"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any], name: str = "call") -> tuple[Any, float]:
    """``fn()`` and its milliseconds, the device idle before and after; ``name`` marks it for the
    profiler as ``klein.node.<name>`` (a range costs nothing when no profiler runs)."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"klein.node.{name}"):
        out = fn()
        _sync(device)
    return out, (time.perf_counter() - t0) * 1000.0


def device_profile(device: torch.device, run: Callable[[], Any]) -> dict[str, Any]:
    """One more node chain under ``torch.profiler``, summarised as ``profile_run.py`` summarises a
    generation: GPU busy and idle time, kernels by family, and the largest idle gaps with what the
    host did meanwhile (the ``klein.node.*`` range of the node running, and the engine's ranges)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _, wall = _timed(device, run, "chain")
    return summarise(prof, wall)


def _as_uint8(image: torch.Tensor) -> np.ndarray:
    """A ComfyUI IMAGE ``[1, H, W, 3]`` in [0, 1] rounded to 8 bits (half up; SaveImage truncates
    instead), to compare with the engine's rounded image."""
    return np.clip(image[0].float().cpu().numpy() * 255.0 + 0.5, 0, 255).astype(np.uint8)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype_name = "fp32" if args.tiny else "bf16"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = "4b" if args.tiny else args.model
    size = 64 if args.tiny else args.size
    own_dir = args.models_dir is None
    models = Path(args.models_dir or tempfile.mkdtemp(prefix="klein_nodes_speed_"))
    tr_file, te_file = FILES[model]
    result: dict[str, Any] = {"model": "tiny" if args.tiny else model, "size": size, "steps": args.steps,
                              "device": str(device), "dtype": dtype_name, "runs": args.runs, "warmup": args.warmup}
    try:
        t0 = time.perf_counter()
        if not (models / "diffusion_models" / tr_file).is_file():
            if args.tiny:
                write_tiny_model_files(models, dtype=dtype)
            else:
                write_full_size_files(model, models, device, dtype)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["write_files_s"] = round(time.perf_counter() - t0, 1)
        pack, cache = import_pack(device, models)
        prompts = [f"{PROMPT}, take {i}" for i in range(args.warmup + args.runs + 1)]

        def nodes(prompt: str) -> tuple[np.ndarray, dict[str, float]]:
            ms: dict[str, float] = {}
            with torch.inference_mode():
                (klein, vae), ms["loader"] = _timed(device, lambda: pack.KleinModelLoader.execute(
                    tr_file, VAE_FILE, dtype_name, "auto", "auto", "fast").args[:2], "loader")
                cond, ms["encoder"] = _timed(device, lambda: pack.KleinTextEncode.execute(te_file, prompt, "").args[0],
                                             "encoder")
                latent, ms["sampler"] = _timed(device, lambda: pack.KleinSampler.execute(
                    klein, cond, width=size, height=size, steps=args.steps, guidance=0.0, seed=SEED,
                    batch_size=1).args[0], "sampler")
                image, ms["vae_decode"] = _timed(device, lambda: pack.KleinVAEDecode.execute(latent, vae).args[0],
                                                 "vae_decode")
            ms["chain"] = ms["encoder"] + ms["sampler"] + ms["vae_decode"]  # the loader's output is cached
            return _as_uint8(image), ms

        _, first = nodes(prompts[-1])  # loads the files
        result["nodes_first_chain_ms"] = first
        node_runs = [nodes(p) for p in prompts[: args.warmup]]
        with HostAudit() as nodes_audit:  # garbage collections inside the timed runs
            node_runs = [nodes(p) for p in prompts[args.warmup: args.warmup + args.runs]]
        result["nodes_host_audit"] = nodes_audit.result()
        # where the host time the nodes add goes (the pack's, ComfyUI's and klein_core's functions)
        result["nodes_cprofile"] = python_profile(lambda: nodes(prompts[-1] + ", profiled"),
                                                  r"nodes/|comfy/|klein_core/")
        result["nodes_profile"] = device_profile(device, lambda: nodes(prompts[-1] + ", under torch.profiler"))
        cache.release_all("nodes_speed: the engine's turn")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # The loads are timed too (the files are in the page cache, written just before): what a
        # process pays once per model, file to device, before any Python-side set-up of the nodes.
        loads = (("transformer", klein_core.load_transformer, models / "diffusion_models" / tr_file),
                 ("text_encoder", klein_core.load_text_encoder, models / "text_encoders" / te_file),
                 ("vae", klein_core.load_vae, models / "vae" / VAE_FILE))
        loaded, result["engine_load"] = {}, {}
        for name, load, path in loads:
            loaded[name], ms = _timed(device, lambda load=load, path=path: load(path, device=device, dtype=dtype))
            gb = path.stat().st_size / 1e9
            result["engine_load"][name] = {"s": ms / 1000, "file_gb": gb, "gb_per_s": gb / (ms / 1000)}
        tr, te, vae_m = loaded["transformer"], loaded["text_encoder"], loaded["vae"]
        # The transformer once more through ordinary memory, as loads ran before the staged reads
        # (klein_core.files.staging): the same file, the same process, for the before/after.
        staging.STAGED_READS = False
        try:
            path = models / "diffusion_models" / tr_file
            again, ms = _timed(device, lambda: klein_core.load_transformer(path, device=device, dtype=dtype))
            del again
        finally:
            staging.STAGED_READS = True
        gb = path.stat().st_size / 1e9
        result["engine_load_unstaged"] = {"transformer": {"s": ms / 1000, "file_gb": gb, "gb_per_s": gb / (ms / 1000)}}

        def engine(prompt: str) -> tuple[np.ndarray, dict[str, float]]:
            res, ms = _timed(device, lambda: klein_core.generate(
                tr, te, vae_m, prompt=prompt, width=size, height=size, steps=args.steps, seed=SEED, cache=None,
                speed="fast", kind="distilled"))
            return np.asarray(res.images[0]), {"e2e": ms, **{k: v * 1000.0 for k, v in res.timings.items()}}

        engine(prompts[-1])
        engine_runs = [engine(p) for p in prompts[: args.warmup]]
        with HostAudit() as engine_audit:
            engine_runs = [engine(p) for p in prompts[args.warmup: args.warmup + args.runs]]
        result["engine_host_audit"] = engine_audit.result()
    finally:
        if own_dir:
            shutil.rmtree(models, ignore_errors=True)

    def medians(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}

    result["nodes_ms"] = medians([ms for _, ms in node_runs])
    result["engine_ms"] = medians([ms for _, ms in engine_runs])
    result["nodes_over_engine"] = round(result["nodes_ms"]["chain"] / result["engine_ms"]["e2e"], 3)
    result["image_max_abs_diff"] = max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
                                       for (a, _), (b, _) in zip(node_runs, engine_runs))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(FILES), default="4b")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny random files (the CPU self-test)")
    p.add_argument("--models-dir", default=None, help="write the files there and keep them (reused when present)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = bench(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text + "\n")
    n, e = result["nodes_ms"], result["engine_ms"]
    sys.stdout.write(f"nodes chain {n['chain']:.1f} ms (encoder {n['encoder']:.1f}, sampler {n['sampler']:.1f}, "
                     f"decode {n['vae_decode']:.1f}) vs engine {e['e2e']:.1f} ms: {result['nodes_over_engine']:.3f}x; "
                     f"images differ by at most {result['image_max_abs_diff']}/255\n")
    unstaged = result["engine_load_unstaged"]["transformer"]
    sys.stdout.write("loads: " + ", ".join(f"{k} {v['s']:.2f} s ({v['gb_per_s']:.2f} GB/s)"
                                           for k, v in result["engine_load"].items())
                     + f"; transformer without staged reads {unstaged['s']:.2f} s ({unstaged['gb_per_s']:.2f} GB/s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
