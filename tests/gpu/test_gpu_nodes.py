"""The ComfyUI nodes on the device: Klein Model Loader -> Qwen3 encoder -> Klein Sampler with
``memory_mode`` auto, against the resident mode and against klein_core called directly.

Needs the ComfyUI host that ``python tests/e2e/setup_host.py`` prepares in ``.comfy_host/`` (carry
``.comfy_host/ComfyUI`` and ``.comfy_host/torchvision_stub``, or all of ``.comfy_host``, to a GPU machine)
and the modules ComfyUI imports on the way to the nodes (:data:`COMFY_MODULES`); without them the
test skips naming what is missing. The GPU image has them all but ``av`` (PyAV, only used by
ComfyUI's video types), which is replaced by an empty stand-in when it is not installed, as the host's
torchvision stub does for torchvision (checked on the CPU with every module the image lacks hidden:
torchsde, av, pydantic, kornia, sqlalchemy, alembic, diffusers, gguf, comfy-kitchen). ComfyUI's model
management is imported without ``--cpu`` on CUDA, so the sampler computes on the GPU.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from encoder_node_runs import assert_replayed_after_the_second_run, encode_runs
from script_module import load_script

import klein_core as kc

from .helpers import rel_l2, tag

REPO = Path(__file__).resolve().parents[2]
PACK = "klein_pack_nodes"
M4B, Q4B, VAE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae")
# What ComfyUI 0.3.75 (comfy.model_management, comfy.utils, folder_paths, comfy_api) and the pack import
# besides torch and klein_core's own requirements, traced on the CPU; import name -> pip name.
COMFY_MODULES = {"psutil": "psutil", "einops": "einops", "safetensors": "safetensors", "numpy": "numpy",
                 "PIL": "pillow", "tqdm": "tqdm", "packaging": "packaging"}


_load_by_path = load_script  # tests/script_module.py


@pytest.fixture(scope="module")
def comfy_on_device(gpu, tmp_path_factory):
    """``nodes/`` as ``klein_pack_nodes`` inside ComfyUI 0.3.75 whose torch device is the suite's."""
    setup = _load_by_path("klein_gpu_setup_host", REPO / "tests" / "e2e" / "setup_host.py")
    paths = setup.host_paths(setup.HOST_DIR)
    # The ComfyUI folder is what counts: READY.json and the host's pip installs stay on the machine that
    # ran setup_host.py when only the folders travel (the modules are checked below).
    if not (paths["comfyui"] / "comfy").is_dir():
        pytest.skip(f"ComfyUI host not here: {paths['comfyui'] / 'comfy'} is missing (python tests/e2e/"
                    "setup_host.py, then carry .comfy_host/ComfyUI and .comfy_host/torchvision_stub)")
    already = sys.modules.get("comfy.model_management")
    if already is not None and already.get_torch_device().type != gpu.device.type:
        pytest.skip("ComfyUI was already imported in this process for another device")
    missing = [pip for name, pip in COMFY_MODULES.items() if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"ComfyUI needs {', '.join(missing)}, not installed here: carry their wheels in .whl/ "
                    "(benchmarks/GPU_SESSION.md)")
    _load_by_path("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py").stand_in_for_av()
    for p in (str(REPO), str(paths["comfyui"]), str(paths["stub"])):
        if p not in sys.path:
            sys.path.append(p)
    # ComfyUI's import switches a process-wide flag (fp16/bf16 reductions in math SDPA): put it back
    # for the suite's later modules.
    reduced_math_sdp = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    argv = sys.argv
    try:
        sys.argv = [argv[0]] + (["--cpu"] if gpu.cpu else [])
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.model_management
        import comfy.utils
        import folder_paths

        pack = sys.modules.get(PACK) or _load_by_path(PACK, REPO / "nodes" / "__init__.py", REPO / "nodes")
    except ImportError as exc:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced_math_sdp)
        pytest.skip(f"ComfyUI or the pack does not import here: {exc} (missing module: {exc.name}; carry "
                    "its wheel in .whl/)")
    finally:
        sys.argv = argv
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
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced_math_sdp)


def _sample(comfy, mode: str, cond, **kw):
    with torch.inference_mode():
        model, *_ = comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto", mode).args
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


def test_encoder_node_replays_its_graph_run_after_run(gpu, comfy_on_device, parity):
    """Speed fast (the default): the encoder node records its forward once per prompt shape and
    replays it on the next runs, though each run asks ComfyUI to load the encoder again (which
    detaches it with ``unpatch_all=False`` first); the embeddings are the plain path's."""
    comfy = comfy_on_device
    cond, counts = encode_runs(comfy.pack, comfy.cache, Q4B, "a quiet harbour, take")
    if gpu.device.type == "cuda":  # (off CUDA nothing is recorded)
        assert_replayed_after_the_second_run(counts)
    with torch.inference_mode():
        plain = comfy.pack.KleinTextEncode.execute(Q4B, "a quiet harbour, take 3", "", speed="plain").args[0]
    diff = parity(tag(gpu, "encoder node fast (graph replay) vs plain, max abs"),
                  float((cond.positive.float() - plain.positive.float()).abs().max()))
    assert diff == 0.0, diff


def test_node_outputs_cross_to_the_host_through_page_locked_memory(gpu, comfy_on_device, monkeypatch):
    """The sampler's latents and the VAE decode's image reach ComfyUI's intermediate device (the CPU)
    through page-locked memory (a copy to ordinary memory runs at a fraction of the bus speed), with
    the values of an ordinary copy; above ``PINNED_OUTPUT_MAX_BYTES`` the latents are copied the
    ordinary way (one decoded image is the engine's own page-locked copy, as ``generate`` makes)."""
    comfy = comfy_on_device
    host = importlib.import_module(f"{PACK}.host")
    with torch.inference_mode():
        cond = comfy.pack.KleinTextEncode.execute(Q4B, "a quiet harbour", "").args[0]
        _, vae = comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto", "resident").args[:2]
    latents = _sample(comfy, "resident", cond)
    with torch.inference_mode():
        image = comfy.pack.KleinVAEDecode.execute({"samples": latents}, vae).args[0]
    assert latents.device.type == image.device.type == "cpu" and latents.dtype == image.dtype == torch.float32
    on_cuda = gpu.device.type == "cuda"
    assert latents.is_pinned() == image.is_pinned() == on_cuda
    monkeypatch.setattr(host, "PINNED_OUTPUT_MAX_BYTES", 0)
    ordinary = _sample(comfy, "resident", cond)
    with torch.inference_mode():
        ordinary_image = comfy.pack.KleinVAEDecode.execute({"samples": ordinary}, vae).args[0]
    assert not ordinary.is_pinned() and ordinary_image.is_pinned() == on_cuda
    assert torch.equal(ordinary, latents) and torch.equal(ordinary_image, image)
