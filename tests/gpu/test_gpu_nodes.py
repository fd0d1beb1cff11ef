"""The ComfyUI nodes on the device: Klein Model Loader -> Qwen3 encoder -> Klein Sampler with
``memory_mode`` auto, against the resident mode and against klein_core called directly.

Needs the ComfyUI host that ``python tests/e2e/setup_host.py`` prepares in ``.comfy_host/`` (carry
``.comfy_host/ComfyUI`` and ``.comfy_host/torchvision_stub`` to a GPU machine) and ComfyUI's import-time
dependencies; without them the test skips naming what is missing. ComfyUI's model management is
imported without ``--cpu`` on CUDA, so the sampler computes on the GPU. ``av`` (PyAV, only used by
ComfyUI's video types) is replaced by an empty stand-in when it is not installed, as the host's
torchvision stub does for torchvision.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from script_module import load_script

import klein_core as kc

from .helpers import rel_l2, tag

REPO = Path(__file__).resolve().parents[2]
PACK = "klein_pack_nodes"
M4B, Q4B, VAE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae")


_load_by_path = load_script  # tests/script_module.py


class _Stand(types.ModuleType):
    """A module whose every attribute is a placeholder class (for imports the pack never uses)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def _stand_in_for_av() -> None:
    if importlib.util.find_spec("av") is not None:
        return
    for name in ("av", "av.container", "av.subtitles", "av.subtitles.stream", "av.video", "av.audio"):
        sys.modules.setdefault(name, _Stand(name))


@pytest.fixture(scope="module")
def comfy_on_device(gpu, tmp_path_factory):
    """``nodes/`` as ``klein_pack_nodes`` inside ComfyUI 0.3.75 whose torch device is the suite's."""
    setup = _load_by_path("klein_gpu_setup_host", REPO / "tests" / "e2e" / "setup_host.py")
    problem = setup.host_problem(setup.HOST_DIR)
    if problem is not None and not (setup.HOST_DIR / "ComfyUI" / "comfy").is_dir():
        pytest.skip(f"ComfyUI host not ready: {problem} (python tests/e2e/setup_host.py, then carry .comfy_host)")
    paths = setup.host_paths(setup.HOST_DIR)
    already = sys.modules.get("comfy.model_management")
    if already is not None and already.get_torch_device().type != gpu.device.type:
        pytest.skip("ComfyUI was already imported in this process for another device")
    missing = [m for m in ("psutil", "tqdm", "einops") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"ComfyUI needs {missing}: carry their wheels in .whl/ (benchmarks/GPU_SESSION.md)")
    _stand_in_for_av()
    for p in (str(REPO), str(paths["comfyui"]), str(paths["stub"])):
        if p not in sys.path:
            sys.path.append(p)
    argv = sys.argv
    try:
        sys.argv = [argv[0]] + (["--cpu"] if gpu.cpu else [])
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.model_management
        import comfy.utils
        import folder_paths
    except ImportError as exc:
        pytest.skip(f"ComfyUI does not import here: {exc}")
    finally:
        sys.argv = argv
    pack = sys.modules.get(PACK) or _load_by_path(PACK, REPO / "nodes" / "__init__.py", REPO / "nodes")
    models = tmp_path_factory.mktemp("gpu_node_models")
    from klein_core.testing import write_tiny_model_files

    paths_written = write_tiny_model_files(models)
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(models / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    asyncio.run(pack.comfy_entrypoint())
    cache = importlib.import_module(f"{PACK}.cache")
    try:
        yield SimpleNamespace(pack=pack, mm=comfy.model_management, paths=paths_written, cache=cache)
    finally:
        cache.release_all("gpu tests done")
        for f in FOLDERS:
            folder_paths.folder_names_and_paths[f] = saved[f]
        folder_paths.filename_list_cache.clear()


def _sample(comfy, mode: str, cond, **kw):
    with torch.inference_mode():
        model, _ = comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto", mode).args
        kw = {"width": 128, "height": 96, "steps": 3, "guidance": 0.0, "seed": 5, "batch_size": 1, **kw}
        return comfy.pack.KleinSampler.execute(model, cond, **kw).args[0]["samples"]


def test_sampler_node_memory_mode_auto(gpu, comfy_on_device, caplog, parity):
    comfy = comfy_on_device
    assert comfy.mm.get_torch_device().type == gpu.device.type
    with torch.inference_mode():
        cond = comfy.pack.KleinTextEncode.execute(Q4B, "a quiet harbour", "").args[0]
    with caplog.at_level(logging.INFO):
        auto = _sample(comfy, "auto", cond)
    assert "memory mode auto -> " in caplog.text
    if gpu.device.type == "cuda":  # off CUDA there is nothing to plan
        assert "estimated peak" in caplog.text, caplog.text
    assert auto.shape == (1, 128, 6, 8) and auto.dtype == torch.float32 and torch.isfinite(auto).all()
    assert auto.device == comfy.mm.intermediate_device()
    resident = _sample(comfy, "resident", cond)
    diff = parity(tag(gpu, "Klein Sampler node auto vs resident, max abs"), float((auto - resident).abs().max()))
    assert diff == 0.0 if gpu.cpu else rel_l2(auto, resident) < 1e-2, diff
    # klein_core directly, on the same files and device: the node adds nothing to the numbers
    tr = kc.load_transformer(comfy.paths["klein_4b"], device=gpu.device, dtype=torch.bfloat16)
    engine = kc.Engine(tr, device=gpu.device, memory="resident", prompt_cache=None)
    direct, _ = engine.denoise(kc.Conditioning(cond.positive.to(gpu.device)), (),
                               kc.Settings(128, 96, 3, None, 5, 1))
    rel = parity(tag(gpu, "Klein Sampler node vs klein_core Engine, relative L2"), rel_l2(auto, direct))
    assert rel < (1e-2 if gpu.device.type == "cuda" else 1e-5), rel
