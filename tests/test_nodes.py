"""Unit tests of the ComfyUI nodes: each node's ``execute`` called directly, on the CPU, with tiny models.

The nodes need ``comfy_api`` and ``comfy.*``: the ``comfy`` fixture puts the e2e host prepared by
``tests/e2e/setup_host.py`` on ``sys.path`` (appended, so nothing of the repo is shadowed) with
``--cpu``, loads ``nodes/`` as the package ``klein_pack_nodes`` (never as top-level ``nodes``, which
is ComfyUI's own module), and points the model folders at tiny files. A missing host skips these
tests with the command to run, or fails them when ``CI`` is set.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import shutil
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import ANY

import numpy as np
import pytest
import torch
from PIL import Image
from script_module import load_script

import klein_core as kc
from klein_core.files.fp8 import quantize_state_dict
from klein_core.files.loaders import LOADERS
from klein_core.memory.placement import module_bytes
from klein_core.pipeline.images import prepare_reference_image
from klein_core.pipeline.prompts import encode_prompts
from klein_core.pipeline.request import Resolved
from klein_core.pipeline.vae_io import decode_to_pixels, encode_references
from klein_core.quant.formats import stored_formats
from klein_core.testing import write_tiny_model_files

REPO = Path(__file__).resolve().parents[1]
PACK = "klein_pack_nodes"  # how the comfy_pack fixture (conftest.py) imports nodes/
NODE_IDS = {
    "KleinTextEncode": "Qwen3 Layer-Concat Encoder",
    "KleinModelLoader": "Klein Model Loader",
    "KleinReferenceStacker": "Klein Reference Stacker",
    "KleinSampler": "Klein Sampler",
    "KleinVAEDecode": "Flux2 VAE Decode",
    "KleinVAEEncode": "Flux2 VAE Encode",
}
M4B, M9B = "flux-2-klein-4b.safetensors", "flux-2-klein-9b.safetensors"
M4B_BASE = "flux-2-klein-base-4b.safetensors"
Q4B, Q8B, VAE = "qwen_3_4b.safetensors", "qwen_3_8b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae")


@pytest.fixture(scope="module")
def comfy(comfy_pack, tmp_path_factory):
    pack, folder_paths = comfy_pack.pack, comfy_pack.folder_paths
    models = tmp_path_factory.mktemp("unit_models")
    paths = write_tiny_model_files(models)
    # A VAE under the transformers' folder, to check the wrong-kind message.
    shutil.copy(paths["vae"], models / "diffusion_models" / "flux2-vae-copy.safetensors")
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(models / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    asyncio.run(pack.comfy_entrypoint())  # installs the /free hook, as inside the host
    mods = {m: importlib.import_module(f"{PACK}.{m}") for m in
            ("cache", "host", "encode", "loaders", "references", "sampler", "vae", "preview", "types")}
    try:
        yield SimpleNamespace(pack=pack, mm=comfy_pack.mm, utils=comfy_pack.utils, args=comfy_pack.args,
                              folder_paths=folder_paths, models=models, paths=paths, **mods)
    finally:
        mods["cache"].release_all("unit tests done")
        for f in FOLDERS:
            folder_paths.folder_names_and_paths[f] = saved[f]
        folder_paths.filename_list_cache.clear()


@pytest.fixture
def progress(comfy, monkeypatch):
    """Records ComfyUI progress-bar updates ``(value, total, preview)``, as main.py's hook would receive."""
    calls = []
    def hook(value, total, preview, node_id=None):
        calls.append((value, total, preview))

    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", hook)
    return calls


def _denoise_call(engine, conditioning, references, settings, callback):
    """What the sampler node asked klein_core's engine for, as the keywords of the equivalent
    ``klein_core.generate`` call."""
    run = settings if isinstance(settings, Resolved) else engine.resolve(settings, references)
    return {"steps": run.steps, "guidance": run.guidance, "width": run.width, "height": run.height,
            "distilled": engine.kind == "distilled", "batch_size": run.batch_size, "seed": run.seed,
            "prompt_embeds": conditioning.positive, "negative_embeds": conditioning.negative,
            "reference_latents": list(references), "callback": callback}


@pytest.fixture
def spy_generate(monkeypatch):
    """Records every denoising run the sampler node asks klein_core's engine for."""
    calls = []
    real = kc.Engine.denoise

    def denoise(self, conditioning, references=(), settings=kc.Settings(), **kw):
        calls.append(_denoise_call(self, conditioning, references, settings, kw.get("callback")))
        return real(self, conditioning, references, settings, **kw)

    monkeypatch.setattr(kc.Engine, "denoise", denoise)
    return calls


@pytest.fixture
def fake_generate(monkeypatch):
    """Stands in for the engine's denoising (records what the sampler node asks for, reports each
    step, returns zeros): for tests of what the node passes, without the cost of sampling."""
    calls = []

    def denoise(self, conditioning, references=(), settings=kc.Settings(), **kw):
        kw = _denoise_call(self, conditioning, references, settings, kw.get("callback"))
        calls.append(kw)
        latents = torch.zeros(kw["batch_size"], 128, kw["height"] // 16, kw["width"] // 16)
        for step in range(1, kw["steps"] + 1):
            kw["callback"](step, kw["steps"], latents)
        return latents, self.resolve(settings, references) if not isinstance(settings, Resolved) else settings

    monkeypatch.setattr(kc.Engine, "denoise", denoise)
    return calls


def _load(comfy, model=M4B, dtype="bf16", kind="auto"):
    with torch.inference_mode():
        return comfy.pack.KleinModelLoader.execute(model, VAE, dtype, kind).args[:2]  # model, KLEIN_VAE


def _encode(comfy, prompt="a red fox in the snow", negative="", encoder=Q4B):
    with torch.inference_mode():
        return comfy.pack.KleinTextEncode.execute(encoder, prompt, negative).args[0]


def _stack(comfy, image, vae, references=None):
    with torch.inference_mode():
        return comfy.pack.KleinReferenceStacker.execute(image, vae, references).args


def _sample(comfy, model, cond, **kw):
    kw = {"width": 64, "height": 64, "steps": 2, "guidance": 0.0, "seed": 7, "batch_size": 1, **kw}
    with torch.inference_mode():
        return comfy.pack.KleinSampler.execute(model, cond, **kw).args[0]["samples"]


def _as_loadimage(pil: Image.Image) -> torch.Tensor:
    """What ComfyUI's LoadImage makes of a file: RGB float32 [1, H, W, 3] = uint8 / 255."""
    return torch.from_numpy(np.asarray(pil.convert("RGB")).astype(np.float32) / 255.0)[None]


def _random_image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}[mode]
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr)


# ----- registration and schemas ----------------------------------------------------------------------


def test_nodes_registered_with_names_categories_and_tooltips(comfy, monkeypatch):
    ext = asyncio.run(comfy.pack.comfy_entrypoint())
    nodes = asyncio.run(ext.get_node_list())

    def no_cuda(*a, **k):
        raise AssertionError("CUDA touched at schema time")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    infos = {n.GET_NODE_INFO_V1()["name"]: n.GET_NODE_INFO_V1() for n in nodes}
    assert NODE_IDS.items() <= {k: v["display_name"] for k, v in infos.items()}.items()
    for name, info in infos.items():
        assert info["category"].split("/")[0] == "Klein", name
        assert info["description"], name
        for group in ("required", "optional"):
            for inp, (_, opts) in info["input"].get(group, {}).items():
                assert opts.get("tooltip"), f"{name}.{inp} has no tooltip"
        assert all(info["output_tooltips"]), name
    sampler = infos["KleinSampler"]["input"]
    assert sampler["optional"]["references"][0] == "KLEIN_REFS"
    assert sampler["required"]["seed"][1]["control_after_generate"] is True
    assert sampler["required"]["seed"][1]["max"] == 2**64 - 1
    assert infos["KleinTextEncode"]["input"]["required"]["text_encoder"] == (
        "COMBO", {"options": [Q4B, Q8B], "multiselect": False, "tooltip": ANY})
    assert infos["KleinModelLoader"]["input"]["required"]["weight_dtype"][1]["default"] == "bf16"
    assert infos["KleinVAEDecode"]["output"] == ["IMAGE"] and infos["KleinSampler"]["output"] == ["LATENT"]


def test_workflow_generator_specs_match_the_node_schemas(comfy):
    wf = load_script("klein_make_workflows", REPO / "example_workflows" / "make_workflows.py")
    for node in comfy.pack.NODES:
        info = node.GET_NODE_INFO_V1()
        spec = wf.SPECS.get(info["name"])
        if spec is None:
            continue
        assert wf.DISPLAY_NAMES[info["name"]] == info["display_name"]
        sockets, widgets, extra = [], [], {}
        for group in ("required", "optional"):
            for name in info["input_order"].get(group, []):
                typ, opts = info["input"][group][name]
                if typ in ("COMBO", "INT", "FLOAT", "STRING", "BOOLEAN"):
                    widgets.append(name)
                    if opts.get("control_after_generate"):
                        extra[name] = "randomize"
                else:
                    sockets.append((name, typ, group == "optional"))
        assert list(spec.sockets) == sockets, info["name"]
        assert list(spec.widgets) == widgets, info["name"]
        assert dict(spec.frontend_extra) == extra, info["name"]
        assert list(spec.outputs) == list(zip(info["output_name"], info["output"], strict=True)), info["name"]


# ----- Qwen3 Layer-Concat Encoder --------------------------------------------------------------------


def test_text_encoder_outputs_and_exact_embeddings(comfy):
    cond = _encode(comfy, "a red fox", "blurry")
    assert isinstance(cond, comfy.types.KleinConditioning)
    assert cond.positive.shape == cond.negative.shape == (1, 512, 96)
    assert (cond.encoder_name, cond.text_dim) == (Q4B, 96)
    assert cond.variant.startswith("Qwen3")
    direct = kc.load_text_encoder(comfy.paths["qwen_4b"], dtype=torch.bfloat16)
    expected = encode_prompts(direct, ["a red fox", "blurry"], cache=None)
    assert torch.equal(cond.positive, expected[:1]) and torch.equal(cond.negative, expected[1:])


def test_a_transformer_homed_on_the_cpu_for_a_gpu_is_page_locked_when_loaded(comfy, monkeypatch):
    """Loaded into CPU memory to be streamed or copied onto a GPU, the transformer is page-locked
    at once (its LoRA'd copies then share the page-locked tensors); for CPU compute it is not."""
    cache = comfy.cache
    pinned_models = []
    monkeypatch.setattr(cache, "pin_memory_", lambda m: pinned_models.append(m) or m)
    for compute, expect in ((torch.device("cpu"), 0), (torch.device("cuda", 0), 1)):
        cache.release_all("fresh load")
        monkeypatch.setattr(cache.host, "torch_device", lambda compute=compute: compute)
        ref = cache.model_ref("transformer", comfy.paths["klein_4b"], "flux-2-klein-4b.safetensors",
                              torch.device("cpu"), torch.bfloat16)
        model = cache.acquire(ref)
        assert len(pinned_models) == expect and (not expect or pinned_models[-1] is model)
    cache.release_all("done")


def test_comfyui_pinned_memory_counts_against_the_packs_bound(comfy, monkeypatch):
    """ComfyUI page-locks its own models' weights outside torch's allocator (cudaHostRegister), so
    torch's statistics miss it: the pack, once ComfyUI loaded it, counts it against its own bound."""
    from klein_core.memory import pinned

    mm = importlib.import_module("comfy.model_management")
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 5 << 30)
    monkeypatch.setattr(pinned, "_locked_now", lambda: 0)
    monkeypatch.setattr(sys, "platform", "linux")
    assert pinned.other_locked is not None and pinned.other_locked() == 5 << 30
    assert pinned.pin_budget(64 << 30) == int(0.9 * (64 << 30)) - (5 << 30)


def test_text_encoder_is_cached_and_only_changed_texts_are_encoded(comfy, monkeypatch):
    cache = comfy.cache
    unlocked = []
    monkeypatch.setattr(cache.pinned, "release_cached", lambda: unlocked.append(1) or True)
    cache.release_all("test start")
    assert unlocked == [1]  # the models' page-locked CPU memory goes back to the system too
    loads, misses = cache.loads["text_encoder"], cache.prompts.misses
    first = _encode(comfy, "a castle on a hill", "fog")
    assert cache.loads["text_encoder"] == loads + 1 and cache.prompts.misses == misses + 2
    again = _encode(comfy, "a castle on a hill", "fog")
    assert cache.loads["text_encoder"] == loads + 1, "the encoder was reloaded"
    assert cache.prompts.misses == misses + 2, "an unchanged prompt was encoded again"
    assert torch.equal(first.positive, again.positive)
    _encode(comfy, "a castle at night", "fog")
    assert cache.loads["text_encoder"] == loads + 1 and cache.prompts.misses == misses + 3
    _encode(comfy, "a castle at night", "fog", encoder=Q8B)  # another file replaces the cached one
    assert cache.loads["text_encoder"] == loads + 2 and cache.resident()["text_encoder"] == Q8B


# ----- Klein Model Loader ----------------------------------------------------------------------------


def test_model_loader_outputs_kinds_and_reuse(comfy):
    loads = comfy.cache.loads["transformer"]
    model, vae = _load(comfy)
    assert isinstance(model, comfy.types.KleinModel) and isinstance(vae, comfy.types.KleinVAE)
    assert (model.name, model.kind, model.config.context_dim) == (M4B, "distilled", 96)
    assert (model.ref.device, model.ref.dtype) == ("cpu", torch.bfloat16)
    assert (vae.name, vae.config.latent_channels) == (VAE, 128)
    assert vae.ref.dtype == torch.float32  # ComfyUI's vae_dtype: no bf16 VAE on the CPU
    transformer = model.ref.get()
    assert transformer.dtype == torch.bfloat16 and transformer.device.type == "cpu"
    assert _load(comfy, M4B_BASE)[0].kind == "base"
    assert _load(comfy, M4B_BASE, kind="distilled")[0].kind == "distilled"
    again = _load(comfy, M4B, kind="base")[0]
    assert again.kind == "base"
    # 4b, base-4b; then 4b again is the transformer still held here, taken back rather than read again
    assert comfy.cache.loads["transformer"] == loads + 2 and again.ref.get() is transformer
    del transformer, again
    _load(comfy, M4B_BASE)[0].ref.get()  # drops the 4b, which nothing holds now
    assert _load(comfy, M4B, kind="distilled")[0].ref.get() is not None
    assert comfy.cache.loads["transformer"] == loads + 4, "a dropped transformer nothing held was not read again"
    _load(comfy, M4B, kind="distilled")
    assert comfy.cache.loads["transformer"] == loads + 4, "the same file was loaded again"
    assert _load(comfy, M4B, dtype="fp32")[0].ref.get().dtype == torch.float32


def test_model_loader_names_the_input_for_wrong_or_missing_files(comfy):
    with pytest.raises(ValueError) as err:
        _load(comfy, "flux2-vae-copy.safetensors")
    msg = str(err.value)
    assert msg.startswith("Klein Model Loader: model_name 'flux2-vae-copy.safetensors' is a FLUX.2 VAE")
    assert "vae_name" in msg and "pick a Klein diffusion model here" in msg
    with pytest.raises(ValueError, match=r"Klein Model Loader: model_name 'missing\.safetensors' was not"):
        _load(comfy, "missing.safetensors")


def test_model_files_are_probed_once_until_they_change(comfy, monkeypatch):
    """The encoder node checks its file on every new prompt: the header is read once while the file
    keeps its size and time, and again once it is replaced (a VAE written under the transformer's
    name is then refused as the VAE it now is)."""
    common = importlib.import_module(f"{PACK}.common")
    read = []
    real = common.probe
    monkeypatch.setattr(common, "probe", lambda path: read.append(path) or real(path))
    common._probe_state.cache_clear()
    name = "replaced-later.safetensors"
    target = comfy.models / "diffusion_models" / name
    shutil.copy(comfy.paths["klein_4b"], target)
    try:
        for _ in range(3):
            assert common.model_file("N", "model_name", "diffusion_models", name, expect="transformer") == str(target)
        assert read == [str(target)]
        shutil.copy(comfy.paths["vae"], target)  # another size: a new file
        with pytest.raises(ValueError, match="is a FLUX.2 VAE"):
            common.model_file("N", "model_name", "diffusion_models", name, expect="transformer")
        assert len(read) == 2
        common._probe(str(comfy.paths["vae"]) + ".missing")  # unreadable: never remembered
        assert common._probe_state.cache_info().currsize == 2
        bound = common._probe_state.cache_info().maxsize
        for i in range(bound + 5):  # bounded: as many states of one file as fit, the oldest dropped
            common._probe_state(str(comfy.paths["vae"]), 1, i)
        assert common._probe_state.cache_info().currsize == bound == 64
    finally:
        target.unlink()
        comfy.folder_paths.filename_list_cache.clear()


# ----- Klein Reference Stacker -----------------------------------------------------------------------


def test_reference_stacker_matches_the_core_preprocessing(comfy, tmp_path):
    _, vae = _load(comfy)
    png = tmp_path / "ref.png"
    _random_image(300, 200).save(png)
    refs, text = _stack(comfy, _as_loadimage(Image.open(png)), vae)
    expected = encode_references(vae.ref.get(), [Image.open(png)])[0]
    (ref,) = refs.items
    assert torch.equal(ref.latent, expected)
    assert (ref.width, ref.height) == (288, 192) == (expected.shape[-1] * 16, expected.shape[-2] * 16)
    assert text == "ref 1: 288x192 (from 300x200)"
    assert ref.latent.device == comfy.host.intermediate_device()


def test_reference_frames_become_the_pil_images_the_core_opens(comfy, tmp_path):
    # Over 1 MP, so the core scales it down; the stacker hands the core the very same pixels.
    png = tmp_path / "big.png"
    _random_image(1100, 1000, seed=9).save(png)
    (pil,) = comfy.references.frames_to_pil(_as_loadimage(Image.open(png)))
    assert pil.mode == "RGB" and np.array_equal(np.asarray(pil), np.asarray(Image.open(png)))
    assert torch.equal(prepare_reference_image(pil), prepare_reference_image(Image.open(png)))


def test_reference_frames_round_any_image_to_8_bits_and_leave_it_unchanged(comfy):
    """frames_to_pil rounds in place on its own copy: the 8 bits numpy gives (clipped to 0..1, times
    255, half to even) for values inside, outside and between the levels, frame by frame, and the
    caller's IMAGE (which ComfyUI may hand to other nodes) is left as it was."""
    g = torch.Generator().manual_seed(4)
    image = torch.rand(2, 64, 72, 3, generator=g) * 1.4 - 0.2  # some values outside 0..1
    image[0, 0, :4, 0] = torch.tensor([0.5 / 255, 1.5 / 255, 254.5 / 255, 1.0])  # halves: to even
    before = image.clone()
    frames = comfy.references.frames_to_pil(image)
    assert torch.equal(image, before)
    want = np.round(np.clip(image.numpy(), 0, 1) * np.float32(255)).astype(np.uint8)
    assert len(frames) == 2 and all(np.array_equal(np.asarray(f), w) for f, w in zip(frames, want))
    half = image.half()  # a half-precision IMAGE: rounded from its float32 values, itself unchanged
    half_before = half.clone()
    frames = comfy.references.frames_to_pil(half)
    want = np.round(np.clip(half.float().numpy(), 0, 1) * np.float32(255)).astype(np.uint8)
    assert torch.equal(half, half_before) and all(np.array_equal(np.asarray(f), w) for f, w in zip(frames, want))


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA"])
def test_reference_stacker_channel_counts(comfy, mode):
    _, vae = _load(comfy)
    pil = _random_image(96, 80, mode, seed=3)
    arr = np.asarray(pil).astype(np.float32) / 255.0
    image = torch.from_numpy(arr if arr.ndim == 3 else arr[..., None])[None]
    (ref,) = _stack(comfy, image, vae)[0].items
    assert torch.equal(ref.latent, encode_references(vae.ref.get(), [pil])[0])


def test_reference_stacker_batches_and_chaining(comfy):
    _, vae = _load(comfy)
    batch = torch.stack([_as_loadimage(_random_image(200, 150, seed=s))[0] for s in (1, 2)])
    first, text1 = _stack(comfy, batch, vae)
    assert len(first.items) == 2
    assert text1 == "ref 1: 192x144 (from 200x150)\nref 2: 192x144 (from 200x150)"
    assert not torch.equal(first.items[0].latent, first.items[1].latent)
    second, text2 = _stack(comfy, _as_loadimage(_random_image(128, 96, seed=4)), vae, first)
    assert len(second.items) == 3 and len(first.items) == 2, "the incoming stack must not change"
    assert second.items[:2] == first.items
    assert text2.splitlines()[2] == "ref 3: 128x96 (from 128x96)"


def test_reference_stacker_error_names_the_node_and_reference(comfy):
    _, vae = _load(comfy)
    refs, _ = _stack(comfy, _as_loadimage(_random_image(96, 96)), vae)
    with pytest.raises(ValueError, match=r"Klein Reference Stacker: image frame for reference 2: .*at least 64 px"):
        _stack(comfy, torch.rand(1, 40, 40, 3), vae, refs)
    with pytest.raises(ValueError, match=r"Klein Reference Stacker: image must be an IMAGE"):
        _stack(comfy, torch.rand(1, 64, 64, 5), vae)


# ----- Klein Sampler ---------------------------------------------------------------------------------


def test_sampler_defaults_distilled(comfy, fake_generate, progress):
    model, _ = _load(comfy)
    samples = _sample(comfy, model, _encode(comfy), width=0, height=0, steps=0)
    call = fake_generate[-1]
    assert (call["steps"], call["guidance"], call["width"], call["height"]) == (4, 1.0, 1024, 1024)
    assert call["distilled"] is True and call["negative_embeds"] is None
    assert samples.shape == (1, 128, 64, 64)
    assert [(v, t) for v, t, _ in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_sampler_defaults_base(comfy, fake_generate, progress):
    model, _ = _load(comfy, M4B_BASE)
    cond = _encode(comfy, negative="blurry")
    _sample(comfy, model, cond, steps=0, guidance=0.0, batch_size=3)
    call = fake_generate[-1]
    assert (call["steps"], call["guidance"], call["distilled"], call["batch_size"]) == (50, 4.0, False, 3)
    assert torch.equal(call["negative_embeds"], cond.negative)
    assert torch.equal(call["prompt_embeds"], cond.positive)
    assert len(progress) == 50
    _sample(comfy, model, cond, steps=3, guidance=2.5)
    assert (fake_generate[-1]["steps"], fake_generate[-1]["guidance"]) == (3, 2.5)


def test_sampler_size_from_the_first_reference(comfy):
    model, vae = _load(comfy)
    refs, _ = _stack(comfy, _as_loadimage(_random_image(200, 150)), vae)
    refs, _ = _stack(comfy, _as_loadimage(_random_image(96, 128, seed=1)), vae, refs)
    cond = _encode(comfy)
    assert _sample(comfy, model, cond, width=0, height=0, references=refs).shape == (1, 128, 9, 12)
    assert _sample(comfy, model, cond, width=320, height=0, references=refs).shape == (1, 128, 9, 20)
    with pytest.raises(ValueError, match=r"Klein Sampler: width/height: .*too small.*Set both to 0"):
        _sample(comfy, model, cond, width=32, height=32)


def test_sampler_output_is_the_core_result_in_comfy_layout(comfy):
    model, _ = _load(comfy)
    samples = _sample(comfy, model, _encode(comfy, "a lighthouse"), width=96, height=80, steps=3, seed=11,
                      batch_size=2)
    assert samples.shape == (2, 128, 5, 6) and samples.dtype == torch.float32
    assert samples.device == comfy.host.intermediate_device()
    te = kc.load_text_encoder(comfy.paths["qwen_4b"], dtype=torch.bfloat16)
    tr = kc.load_transformer(comfy.paths["klein_4b"], dtype=torch.bfloat16)
    direct = kc.generate(tr, te, prompt="a lighthouse", width=96, height=80, steps=3, seed=11, batch_size=2,
                         output="latent", cache=None).latents
    assert torch.equal(samples, direct.float())


def test_sampler_refuses_a_mismatched_encoder_before_compute(comfy, spy_generate, monkeypatch):
    """The engine's one input check runs before the model loads; the node restates its refusal with
    the files on both sides and the encoder to select."""
    model9, _ = _load(comfy, M9B)
    cond = _encode(comfy)  # before the spy: run alone, this loads the text encoder (through ModelRef.get too)
    loads = []
    real_get = type(model9.ref).get
    monkeypatch.setattr(type(model9.ref), "get", lambda self, *a, **kw: loads.append(1) or real_get(self, *a, **kw))
    with pytest.raises(ValueError) as err:
        _sample(comfy, model9, cond)
    assert type(err.value) is ValueError  # what ComfyUI shows as the exception type
    msg = str(err.value)
    for part in ("Klein Sampler", M9B, Q4B, f"set text_encoder in Qwen3 Layer-Concat Encoder to {Q8B}",
                 "(text width 96) does not fit", "which expects 144"):
        assert part in msg, msg
    assert msg.count("does not fit") == 1 and "use Qwen3" not in msg  # the node's fix, not the engine's too
    assert not spy_generate and not loads  # refused before loading the transformer


def test_sampler_mismatch_without_a_fitting_file_says_what_to_get(comfy, tmp_path, monkeypatch):
    model9, _ = _load(comfy, M9B)
    cond = _encode(comfy)
    only_4b = tmp_path / "te"
    only_4b.mkdir()
    shutil.copy(comfy.paths["qwen_4b"], only_4b / Q4B)
    monkeypatch.setitem(comfy.folder_paths.folder_names_and_paths, "text_encoders",
                        ([str(only_4b)], comfy.folder_paths.supported_pt_extensions))
    comfy.folder_paths.filename_list_cache.clear()
    with pytest.raises(ValueError, match=r"put a Qwen3 encoder with hidden size 48 into models/text_enc"):
        _sample(comfy, model9, cond)
    comfy.folder_paths.filename_list_cache.clear()


def test_sampler_reports_each_step_with_a_preview(comfy, progress, monkeypatch):
    model, _ = _load(comfy)
    cond = _encode(comfy)
    monkeypatch.setattr(comfy.args.args, "preview_method", comfy.args.LatentPreviewMethod.Auto)
    _sample(comfy, model, cond, width=128, height=96, steps=3)
    assert [(v, t) for v, t, _ in progress] == [(1, 3), (2, 3), (3, 3)]
    for _, _, preview in progress:
        fmt, image, max_size = preview
        assert fmt == "JPEG" and isinstance(image, Image.Image) and image.size == (16, 12)
        assert max_size == comfy.args.args.preview_size
    progress.clear()
    monkeypatch.setattr(comfy.args.args, "preview_method", comfy.args.LatentPreviewMethod.NoPreviews)
    _sample(comfy, model, cond, width=128, height=96, steps=2)
    assert [p for _, _, p in progress] == [None, None]


def test_preview_unpatchify_inverts_the_vae_patchify(comfy):
    from klein_core.models.vae import patchify

    x = torch.randn(2, 32, 6, 8)
    assert torch.equal(comfy.preview.unpatchify(patchify(x)), x)
    assert comfy.host.flux2_latent_rgb()[0].shape == (32, 3)  # ComfyUI's own Flux2 preview factors


def test_interrupt_stops_within_a_step_and_the_next_run_is_correct(comfy, monkeypatch, progress):
    model, _ = _load(comfy)
    cond = _encode(comfy, "a harbour at dusk")
    loads = comfy.cache.loads["transformer"]
    real = comfy.mm.throw_exception_if_processing_interrupted
    calls = []

    def interrupt_at_step_2():
        calls.append(1)
        if len(calls) == 2:
            raise comfy.mm.InterruptProcessingException()

    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", interrupt_at_step_2)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _sample(comfy, model, cond, width=128, height=96, steps=6, seed=5)
    assert [v for v, _, _ in progress] == [1], "the run did not stop at step 2"
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", real)
    after = _sample(comfy, model, cond, width=128, height=96, steps=6, seed=5)
    assert comfy.cache.loads["transformer"] == loads, "the model had to be reloaded after the interrupt"
    comfy.cache.release_all("fresh run")
    fresh = _sample(comfy, *_load(comfy)[:1], _encode(comfy, "a harbour at dusk"), width=128, height=96,
                    steps=6, seed=5)
    assert torch.equal(after, fresh)


# ----- Flux2 VAE Decode / Encode ---------------------------------------------------------------------


def test_vae_decode_gives_comfy_images(comfy):
    model, vae = _load(comfy)
    samples = _sample(comfy, model, _encode(comfy), width=96, height=64, batch_size=2)
    with torch.inference_mode():
        (image,) = comfy.pack.KleinVAEDecode.execute({"samples": samples}, vae).args
    assert image.shape == (2, 64, 96, 3) and image.dtype == torch.float32
    assert image.device == comfy.host.intermediate_device()
    assert 0.0 <= image.min() and image.max() <= 1.0
    expected = decode_to_pixels(vae.ref.get(), samples).permute(0, 2, 3, 1)
    torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)  # decoded one by one: conv batching noise


def test_vae_decode_refuses_other_latents(comfy):
    _, vae = _load(comfy)
    with pytest.raises(ValueError, match=r"Flux2 VAE Decode: samples must be FLUX.2 latents \[batch, 128.*"
                                         r"got \[1, 4, 8, 8\]"):
        comfy.pack.KleinVAEDecode.execute({"samples": torch.zeros(1, 4, 8, 8)}, vae)


def test_vae_encode_crops_to_16_and_round_trips_shapes(comfy):
    _, vae = _load(comfy)
    with torch.inference_mode():
        (latent,) = comfy.pack.KleinVAEEncode.execute(torch.rand(2, 70, 100, 3), vae).args
        (gray,) = comfy.pack.KleinVAEEncode.execute(torch.rand(1, 64, 64, 1), vae).args
        (image,) = comfy.pack.KleinVAEDecode.execute(latent, vae).args
    assert latent["samples"].shape == (2, 128, 4, 6) and latent["samples"].dtype == torch.float32
    assert gray["samples"].shape == (1, 128, 4, 4)
    assert image.shape == (2, 64, 96, 3)


# ----- /free ----------------------------------------------------------------------------------------


def test_free_hook_releases_every_cache_and_models_reload_on_demand(comfy, caplog):
    model, _ = _load(comfy)
    cond = _encode(comfy, "a windmill")
    assert set(comfy.cache.resident()) == {"transformer", "text_encoder", "vae"}
    assert len(comfy.cache.prompts) > 0
    loads = comfy.cache.loads["transformer"]
    weights = weakref.ref(model.ref.get())
    with caplog.at_level("INFO"):
        comfy.mm.unload_all_models()  # what POST /free runs in ComfyUI's prompt worker
    assert comfy.cache.resident() == {} and len(comfy.cache.prompts) == 0
    assert "Klein: released 3 cached model(s)" in caplog.text
    gc.collect()
    assert weights() is None, "the node outputs still pin the released transformer"
    # Outputs still held by ComfyUI's cache keep working: the model is loaded again when needed.
    assert _sample(comfy, model, cond).shape == (1, 128, 4, 4)
    assert comfy.cache.loads["transformer"] == loads + 1


def test_free_hook_is_installed_once(comfy):
    hooked = comfy.mm.unload_all_models
    assert comfy.cache.release_all in hooked._klein_unload_hooks
    assert not comfy.host.install_unload_hook(comfy.cache.release_all)  # the same callback: hooked already
    asyncio.run(comfy.pack.comfy_entrypoint())
    assert comfy.mm.unload_all_models is hooked and hooked._klein_unload_hooks.count(comfy.cache.release_all) == 1
    assert not hasattr(hooked.__wrapped__, "_klein_unload_hooks")  # one wrapper, around ComfyUI's own


def test_free_empties_the_page_locked_cache_once_the_models_are_dead(comfy, monkeypatch):
    """The pack's hook runs before ComfyUI's own unloading, but ComfyUI holds its loaded models by
    weak reference only (``LoadedModel.real_model``), so when the hook empties torch's page-locked
    cache the transformer is already freed: its page-locked blocks are in the cache, and go back."""
    model, _ = _load(comfy)
    cond = _encode(comfy, "a windmill at dusk")
    _sample(comfy, model, cond)  # ComfyUI now lists the transformer among its loaded models
    assert any(lm.model is not None and getattr(lm.model.model, "inner", None) is model.ref.get()
               for lm in comfy.mm.current_loaded_models)
    weights = weakref.ref(model.ref.get())
    alive_at_release = []

    def release_cached() -> bool:
        alive_at_release.append(weights() is not None)
        return True

    monkeypatch.setattr(comfy.cache.pinned, "release_cached", release_cached)
    comfy.mm.unload_all_models()
    assert alive_at_release == [False]


def test_free_hook_releases_every_copy_of_the_pack(comfy):
    """The pack loaded again under another module name (ComfyUI keeps that copy's nodes): its
    release_all is added to the one wrapper, so Free releases both copies' caches."""
    hooked = comfy.mm.unload_all_models
    released = []

    def other_copy() -> None:
        released.append(1)

    assert comfy.host.install_unload_hook(other_copy)
    try:
        assert comfy.mm.unload_all_models is hooked  # no second wrapper
        comfy.mm.unload_all_models()
        assert released == [1]
    finally:
        hooked._klein_unload_hooks.remove(other_copy)


def test_models_are_registered_with_comfy_model_management(comfy):
    """Our loaded models are in ComfyUI's list of loaded models, so ComfyUI can unload them when
    another model needs the memory; a later use brings them back without reading the file again."""
    mm, cache = comfy.mm, comfy.cache
    model, vae = _load(comfy)
    cond = _encode(comfy, "a lighthouse")
    _sample(comfy, model, cond)

    def ours():
        return {type(lm.model.model).__name__: lm.model.model.inner for lm in mm.current_loaded_models
                if lm.model is not None and type(lm.model.model).__name__.startswith("Klein")}

    registered = ours()
    assert registered.keys() == {"KleinTransformer", "KleinTextEncoder", "KleinVae"}
    assert registered["KleinTransformer"] is model.ref.get()
    loads = dict(cache.loads)
    mm.free_memory(1e30, mm.get_torch_device())  # what ComfyUI does when another model needs the memory
    assert ours() == {}
    assert _sample(comfy, model, cond).shape == (1, 128, 4, 4)  # used again: registered again, not reloaded
    assert "KleinTransformer" in ours() and dict(cache.loads) == loads
    mm.unload_all_models()  # POST /free: ComfyUI unloads, and our cache lets go of the weights
    assert ours() == {} and cache.resident() == {}


def test_loads_ask_comfy_for_memory_first(comfy, monkeypatch):
    cache, host = comfy.cache, comfy.host
    events = []
    monkeypatch.setattr(host, "make_room", lambda n, d: events.append(("make_room", n, str(d))))
    real_use = host.use_models
    monkeypatch.setattr(host, "use_models", lambda h, m=0: (events.append(("use_models", m)), real_use(h, m)))
    real_loaders = dict(LOADERS)
    for role, load in real_loaders.items():
        monkeypatch.setitem(LOADERS, role, lambda *a, _l=load, _r=role, **k: (
            events.append(("load", _r, str(k.get("device")))), _l(*a, **k))[1])
    cache.release_all("test")
    model, _ = _load(comfy)
    weights = cache.weight_bytes(model.ref)
    assert weights == module_bytes(model.ref.get())  # the header-only estimate is the real size
    real = [e for e in events if e[0] != "load" or e[2] != "meta"]  # header-only (meta) builds read no data
    assert real[:2] == [("make_room", weights, "cpu"), ("load", "transformer", "cpu")]
    cond = _encode(comfy, "a tower")
    engines = []
    real_engine = kc.Engine
    monkeypatch.setattr(kc, "Engine", lambda *a, **k: engines.append(real_engine(*a, **k)) or engines[-1])
    _sample(comfy, model, cond, width=128, height=96)
    (engine,) = engines
    # The engine asks ComfyUI for its activations' memory when it plans (on CUDA; this host is a CPU):
    # through load_models_gpu with the sampler's own model, so ComfyUI frees others and keeps it.
    events.clear()
    engine.make_room(12345, torch.device("cpu"))
    assert events == [("use_models", 12345)]
    assert engine.check_cancel is comfy.host.check_interrupt


def test_each_node_run_plans_memory_once(comfy, monkeypatch):
    import klein_core.memory.planner as planner

    model, vae = _load(comfy)
    _encode(comfy, "warm up")
    estimates = []
    real = planner.estimate
    monkeypatch.setattr(planner, "estimate", lambda *a, **k: estimates.append(1) or real(*a, **k))
    cond = _encode(comfy, "a tower at dusk")  # not cached: the encoder runs
    assert len(estimates) == 1
    refs, _ = _stack(comfy, torch.cat([_as_loadimage(_random_image(96, 96, seed=s)) for s in (1, 2)]), vae)
    assert len(estimates) == 2  # two frames, one plan
    latents = _sample(comfy, model, cond, width=128, height=96, references=refs)
    assert len(estimates) == 3
    with torch.inference_mode():
        comfy.vae.KleinVAEDecode.execute({"samples": torch.cat([latents] * 2)}, vae)
    assert len(estimates) == 4  # two images, one plan


@pytest.mark.parametrize("mode", ["resident", "swap", "blocks", "minimum"])
def test_memory_modes_give_the_same_latents_and_log_the_plan(comfy, mode, caplog):
    cond = _encode(comfy, "a quiet harbour")
    auto, _ = _load(comfy)
    with caplog.at_level(logging.INFO):
        expected = _sample(comfy, auto, cond, seed=5)
    assert "memory mode auto -> resident" in caplog.text
    with torch.inference_mode():
        model, *_ = comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto", mode).args
    assert model.memory == mode
    caplog.clear()
    with caplog.at_level(logging.INFO):
        got = _sample(comfy, model, cond, seed=5)
    assert torch.equal(got, expected)
    assert f"memory mode {mode} -> " in caplog.text and "estimated peak" in caplog.text
    if mode in ("blocks", "minimum"):
        assert "Block offload" in caplog.text  # the transformer's blocks were really streamed


def test_storage_choices_that_a_quantised_file_overrides_are_said(comfy, monkeypatch, caplog):
    from safetensors.torch import load_file, save_file

    from klein_core.quant.fp8 import block_linear_names

    sd = load_file(str(comfy.paths["klein_4b"]))
    layers = block_linear_names(kc.load_transformer(comfy.paths["klein_4b"]))
    name = "flux-2-klein-4b-fp8.safetensors"
    save_file(quantize_state_dict(sd, layers, style="comfy_quant"), str(comfy.models / "diffusion_models" / name))
    comfy.folder_paths.filename_list_cache.clear()
    try:
        out = comfy.pack.KleinModelLoader.execute(name, VAE, "q4", "auto")
        warnings = out.ui["warnings"]
        assert any(f"{name} stores {len(layers)} layers in fp8 e4m3fn; weight_dtype q4" in w for w in warnings), warnings
        assert stored_formats(out.args[0].ref.get()) == {"fp8 e4m3fn": len(layers)}
        assert not getattr(comfy.pack.KleinModelLoader.execute(name, VAE, "bf16", "auto"), "ui", None)  # as stored: nothing to say
        q4 = comfy.pack.KleinModelLoader.execute(M4B, VAE, "q4", "auto")
        assert stored_formats(q4.args[0].ref.get()) == {"GGUF Q4_0": len(layers)}
        assert not getattr(q4, "ui", None)  # a bf16 file quantised as asked: nothing to say
    finally:
        comfy.cache.release_all("test done")
        (comfy.models / "diffusion_models" / name).unlink()
        comfy.folder_paths.filename_list_cache.clear()
    # fp8 on a GPU without fp8 matmuls (an RTX 3090 here, by its answers): said with the GPU's name
    monkeypatch.setattr(comfy.loaders, "scaled_mm_available", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce RTX 3090")
    with caplog.at_level(logging.WARNING):
        comfy.loaders.report_weight_choice("fp8", M4B, torch.nn.Linear(2, 2), torch.device("cuda", 0))
    assert "fp8 on NVIDIA GeForce RTX 3090 (compute capability 8.6, fp8 matmuls need 8.9)" in caplog.text
    monkeypatch.setattr(comfy.loaders, "scaled_mm_available", lambda device: True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        comfy.loaders.report_weight_choice("fp8", M4B, torch.nn.Linear(2, 2), torch.device("cuda", 0))
    assert not caplog.text


def test_a_device_without_float8_loads_fp8_files_dequantised(comfy, monkeypatch):
    """On Apple's MPS (no float8 dtypes; the CPU stands in, its answer patched) the loader loads an fp8
    file's layers dequantised, whichever memory mode keeps its weights in CPU memory first, and
    refuses weight_dtype fp8 naming the input and the device."""
    from safetensors.torch import load_file, save_file

    import klein_core.files.loaders as core_loaders
    from klein_core.quant.fp8 import block_linear_names, fp8_layers

    sd = load_file(str(comfy.paths["klein_4b"]))
    layers = block_linear_names(kc.load_transformer(comfy.paths["klein_4b"]))
    name = "flux-2-klein-4b-fp8.safetensors"
    save_file(quantize_state_dict(sd, layers, style="comfy_quant"), str(comfy.models / "diffusion_models" / name))
    comfy.folder_paths.filename_list_cache.clear()
    monkeypatch.setattr(core_loaders, "holds_float8", lambda device: False)
    try:
        for memory_mode in ("resident", "blocks"):
            with torch.inference_mode():
                model = comfy.pack.KleinModelLoader.execute(name, VAE, "bf16", "auto", memory_mode).args[0]
            assert model.ref.quantize == "dequantize" and not fp8_layers(model.ref.get())
            comfy.cache.release_all("next mode")
        with pytest.raises(ValueError, match="weight_dtype.*cpu cannot hold float8 tensors"):
            comfy.pack.KleinModelLoader.execute(M4B, VAE, "fp8", "auto")
    finally:
        comfy.cache.release_all("test done")
        (comfy.models / "diffusion_models" / name).unlink()
        comfy.folder_paths.filename_list_cache.clear()


def test_fp8_weight_option_keeps_block_weights_in_fp8(comfy):
    from klein_core.quant.fp8 import fp8_layers

    cond = _encode(comfy, "a quiet harbour")
    bf16, _ = _load(comfy)
    expected = _sample(comfy, bf16, cond, seed=5)
    fp8, _ = _load(comfy, dtype="fp8")
    assert fp8.ref.quantize == "fp8"
    assert fp8_layers(fp8.ref.get())  # FP8Linear layers in the loaded transformer
    got = _sample(comfy, fp8, cond, seed=5)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < 0.2, rel
