"""The nodes as ComfyUI citizens: encoder options, warnings the user sees, errors without server
paths, validation once per input, previews from the denoised estimate, the disk prompt cache.

Nodes' ``execute`` are called directly in ComfyUI 0.3.75's modules (``--cpu``), as in test_nodes.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from encoder_node_runs import assert_replayed_after_the_second_run, encode_runs
from extras import require
from test_nodes import M4B, M4B_BASE, Q4B, VAE, _load, _sample, comfy, progress  # noqa: F401 (fixtures)
from test_text_graph import cpu_graphs  # noqa: F401 (fixture)

import klein_core as kc
from klein_core.memory.placement import module_bytes
from klein_core.pipeline.inpaint import comfy_mask_to_latents
from klein_core.pipeline.inputs import InitLatents
from klein_core.pipeline.prompts import encode_prompts
from klein_core.pipeline.tokenizer import count_tokens

LONG = " ".join(f"word{i}" for i in range(700))


def _encode_out(comfy, prompt="a red fox", negative="", precision="model dtype", max_tokens="512"):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinTextEncode.execute(Q4B, prompt, negative, precision, max_tokens)


def _warnings(out) -> list[str]:
    ui = out.ui or {}
    return list(ui.get("warnings", []))


# ----- encoder options ------------------------------------------------------------------------------


def test_encoder_options_match_klein_core(comfy):  # noqa: F811
    direct = kc.load_text_encoder(comfy.paths["qwen_4b"], dtype=torch.bfloat16)
    default = _encode_out(comfy, "a red fox", "blurry").args[0]
    expected = encode_prompts(direct, ["a red fox", "blurry"], cache=None)
    assert default.positive.dtype == torch.bfloat16 and torch.equal(default.positive, expected[:1])
    comfy_way = _encode_out(comfy, LONG, "blurry", "fp32 activations", "whole prompt").args[0]
    n = count_tokens(LONG)
    assert comfy_way.positive.shape == (1, n, 96) and comfy_way.negative.shape == (1, 512, 96)
    assert comfy_way.positive.dtype == torch.float32
    assert torch.equal(comfy_way.positive, encode_prompts(direct, [LONG], cache=None, options=kc.COMFYUI_TEXT))
    with pytest.raises(ValueError, match=r"Qwen3 Layer-Concat Encoder: precision 'fp64' is not one of"):
        _encode_out(comfy, precision="fp64")


def test_the_encoder_node_replays_its_graph_run_after_run(comfy, cpu_graphs):  # noqa: F811
    """At speed fast the encoder node records its forward once per prompt shape and then replays
    it on every run, though each run asks ComfyUI to load the encoder (which detaches it first)."""
    cond, counts = encode_runs(comfy.pack, comfy.cache, Q4B, "a red fox number")
    assert_replayed_after_the_second_run(counts)
    with torch.inference_mode():
        plain = comfy.pack.KleinTextEncode.execute(Q4B, "a red fox number 3", "", speed="plain").args[0]
    assert torch.equal(cond.positive, plain.positive)


def test_trimmed_padding_choice(comfy):  # noqa: F811
    """max_tokens "512, padding trimmed": prompt and negative padded together to a multiple of 64,
    the rows of the 512-token encode; the sampler runs on them."""
    direct = kc.load_text_encoder(comfy.paths["qwen_4b"], dtype=torch.bfloat16)
    cond = _encode_out(comfy, "a red fox", "blurry", max_tokens="512, padding trimmed (approximate)").args[0]
    assert cond.positive.shape == (1, 64, 96) and cond.negative.shape == (1, 64, 96)
    full = encode_prompts(direct, ["a red fox", "blurry"], cache=None)
    assert torch.equal(cond.positive, full[:1, :64]) and torch.equal(cond.negative, full[1:, :64])
    model, _ = _load(comfy, M4B)
    latents = _sample(comfy, model, cond, steps=2)
    assert latents.shape == (1, 128, 4, 4) and torch.isfinite(latents).all()
    with pytest.raises(ValueError, match=r"Qwen3 Layer-Concat Encoder: max_tokens 'trimmed' is not one of"):
        _encode_out(comfy, max_tokens="trimmed")


def test_long_prompts_warn_by_input_name_also_from_the_cache(comfy):  # noqa: F811
    n = count_tokens(LONG)
    for _ in range(2):  # the second time the embeddings come from the cache: still said
        out = _encode_out(comfy, LONG, "blurry")
        [warning] = _warnings(out)
        assert f"prompt is {n} tokens; only the first 512 are used ({n - 512} cut" in warning
        assert "whole prompt" in warning
    assert _warnings(_encode_out(comfy, LONG, "blurry", max_tokens="whole prompt")) == []
    assert _encode_out(comfy, "short").ui is None


def test_whole_prompts_of_different_lengths_sample_with_cfg(comfy):  # noqa: F811
    model, _ = _load(comfy, M4B_BASE)
    cond = _encode_out(comfy, LONG, "blurry", "fp32 activations", "whole prompt").args[0]
    latents = _sample(comfy, model, cond, steps=2, guidance=3.0)
    assert latents.shape == (1, 128, 4, 4) and torch.isfinite(latents).all()


# ----- warnings reach the user ----------------------------------------------------------------------


def test_sampler_warnings_are_in_the_ui_output_and_on_the_node(comfy, monkeypatch):  # noqa: F811
    import server
    from comfy_execution.utils import CurrentNodeContext

    sent = []

    class FakeServer:
        client_id = "client-1"

        def send_progress_text(self, text, node_id, sid=None):
            sent.append((text, node_id, sid))

    monkeypatch.setattr(server.PromptServer, "instance", FakeServer(), raising=False)
    model, _ = _load(comfy)
    cond = _encode_out(comfy, "a red fox", "blurry").args[0]
    with torch.inference_mode(), CurrentNodeContext("prompt-1", "7"):
        out = comfy.pack.KleinSampler.execute(model, cond, width=72, height=64, steps=1, guidance=3.0, seed=1,
                                              batch_size=1)
    warnings = _warnings(out)
    assert any("negative prompt is not used" in w and "model_kind" in w for w in warnings), warnings
    assert any("guidance 3.00 is ignored" in w for w in warnings), warnings
    assert any("not a multiple of 16" in w for w in warnings), warnings
    assert out.args[0]["samples"].shape == (1, 128, 4, 4)
    [(text, node_id, sid)] = sent
    assert node_id == "7" and sid == "client-1" and all(w in text for w in warnings)
    # a clean run says nothing
    with torch.inference_mode():
        clean = comfy.pack.KleinSampler.execute(model, _encode_out(comfy, "a fox").args[0], width=64, height=64,
                                                steps=1, guidance=0.0, seed=1, batch_size=1)
    assert clean.ui is None


def test_reference_sizes_text_and_warnings_share_the_ui(comfy, monkeypatch):  # noqa: F811
    import logging

    _, vae = _load(comfy)
    real = kc.Engine.encode_references

    def warn_then_encode(self, images, **kw):
        logging.getLogger("klein_core.pipeline.engine").warning("a warning from the core")
        return real(self, images, **kw)

    monkeypatch.setattr(kc.Engine, "encode_references", warn_then_encode)
    with torch.inference_mode():
        out = comfy.pack.KleinReferenceStacker.execute(torch.rand(1, 72, 88, 3), vae, None)
    assert list(out.ui["text"]) == ["ref 1: 80x64 (from 88x72)"]  # the node's own text output is kept
    assert out.ui["warnings"] == ["a warning from the core"]


def test_every_node_execute_is_reported(comfy):  # noqa: F811
    for node in comfy.pack.NODES:
        assert getattr(node.execute, "__wrapped__", None) is not None, node.__name__


# ----- errors ---------------------------------------------------------------------------------------


def test_errors_name_files_but_never_server_paths(comfy, tmp_path):  # noqa: F811
    folder = Path(comfy.folder_paths.get_folder_paths("diffusion_models")[0])
    bad = folder / "broken-klein.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    comfy.folder_paths.filename_list_cache.clear()
    try:
        with pytest.raises(ValueError) as err, torch.inference_mode():
            comfy.pack.KleinModelLoader.execute("broken-klein.safetensors", VAE, "bf16", "auto", "auto")
        msg = str(err.value)
        assert "broken-klein.safetensors" in msg
        assert str(folder) not in msg and "/tmp" not in msg
        assert err.value.__cause__ is not None and str(folder) in str(err.value.__cause__)  # the log keeps it
        with pytest.raises(ValueError) as err, torch.inference_mode():
            comfy.pack.KleinModelLoader.execute("missing.safetensors", VAE, "bf16", "auto", "auto")
        assert "models/diffusion_models" in str(err.value) and str(folder) not in str(err.value)
    finally:
        bad.unlink()
        comfy.folder_paths.filename_list_cache.clear()


def test_scrub_paths(comfy):  # noqa: F811
    from klein_pack_nodes.notices import scrub_paths

    assert scrub_paths("/home/me/models/x.safetensors: bad") == "x.safetensors: bad"
    assert scrub_paths("file 'C:\\Program Files\\Comfy\\m 1.st' x") == "file 'm 1.st' x"
    for keep in ("models/loras/x.st", "width/height: 3", "see https://example.org/a/b", "and/or 1/2"):
        assert scrub_paths(keep) == keep


def test_each_validation_names_only_its_input(comfy):  # noqa: F811
    loader, lora = comfy.pack.KleinModelLoader, sys.modules["klein_pack_nodes.lora"].KleinLoraLoader
    import inspect

    assert list(inspect.signature(loader.validate_inputs).parameters) == ["model_name"]
    assert list(inspect.signature(lora.validate_inputs).parameters) == ["lora_name"]
    assert "model_name 'nope.safetensors' is not available" in loader.validate_inputs("nope.safetensors")
    assert loader.validate_inputs(M4B) is True
    msg = lora.validate_inputs("nope.safetensors")
    assert msg.startswith("lora_name 'nope.safetensors' is not available") and "models/loras" in msg
    with pytest.raises(ValueError, match=r"Klein Model Loader: vae_name 'nope.safetensors' was not found"):
        with torch.inference_mode():
            loader.execute(M4B, "nope.safetensors", "bf16", "auto", "auto")
    with pytest.raises(ValueError, match=r"Klein Model Loader: memory_mode 'fast' is not one of auto"):
        with torch.inference_mode():
            loader.execute(M4B, VAE, "bf16", "auto", "fast")


def test_node_values_print_without_paths(comfy):  # noqa: F811
    model, vae = _load(comfy)
    cond = _encode_out(comfy).args[0]
    for value in (model, vae, cond):
        text = str(value)
        assert "/" not in text and len(text) < 200, text


# ----- previews -------------------------------------------------------------------------------------


def test_previews_come_from_the_hosts_previewer_fed_with_the_denoised_estimate(comfy, progress, monkeypatch):  # noqa: F811
    import latent_preview

    seen = []
    real = latent_preview.get_previewer

    def spy(device, latent_format):
        previewer = real(device, latent_format)
        decode = previewer.decode_latent_to_preview_image

        def recording(fmt, x0):
            seen.append(x0.clone())
            return decode(fmt, x0)

        previewer.decode_latent_to_preview_image = recording
        return previewer

    monkeypatch.setattr(latent_preview, "get_previewer", spy)
    monkeypatch.setattr(comfy.args.args, "preview_method", comfy.args.LatentPreviewMethod.Auto)
    model, _ = _load(comfy)
    steps = []
    real_denoise = kc.Engine.denoise

    def denoise(self, conditioning, references=(), settings=kc.Settings(), **kw):
        inner = kw["callback"]
        assert inner.wants_denoised

        def cb(step, total, latents, denoised=None):
            steps.append((latents.clone(), denoised.clone()))
            return inner(step, total, latents, denoised=denoised)

        cb.wants_denoised = True
        kw["callback"] = cb
        return real_denoise(self, conditioning, references, settings, **kw)

    monkeypatch.setattr(kc.Engine, "denoise", denoise)
    out = _sample(comfy, model, _encode_out(comfy, "a fox").args[0], steps=3, width=128, height=96)
    assert len(seen) == 3 and all(p is not None for _, _, p in progress)
    for (latents, denoised), shown in zip(steps, seen):
        assert torch.equal(shown, denoised[:1].float())  # the estimate, never the noisy latents
        assert not torch.equal(shown, latents[:1].float())
    # the last estimate is the result (up to its bf16 rounding)
    assert (seen[-1] - out[:1]).abs().max() <= 0.02 * out.abs().max()


def test_without_previews_the_steps_compute_no_denoised_estimate(comfy, progress, monkeypatch):  # noqa: F811
    monkeypatch.setattr(comfy.args.args, "preview_method", comfy.args.LatentPreviewMethod.NoPreviews)
    model, _ = _load(comfy)
    asked = []
    real_denoise = kc.Engine.denoise

    def denoise(self, conditioning, references=(), settings=None, **kw):
        asked.append(kw["callback"].wants_denoised)
        return real_denoise(self, conditioning, references, settings, **kw)

    monkeypatch.setattr(kc.Engine, "denoise", denoise)
    _sample(comfy, model, _encode_out(comfy, "a fox").args[0], steps=2, width=128, height=96)
    assert asked == [False] and [p for _, _, p in progress] == [None, None]


# ----- disk prompt cache ----------------------------------------------------------------------------


class _Opens:
    active: list[str] | None = None
    installed = False

    @staticmethod
    def hook(event, args):
        if _Opens.active is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            _Opens.active.append(os.fsdecode(args[0]))


def test_disk_prompt_cache_second_run_opens_no_encoder_file(comfy, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KLEIN_PROMPT_CACHE", str(tmp_path / "prompt_cache"))
    cache = comfy.cache
    cache.release_all("test start")
    loads = cache.loads["text_encoder"]
    first = _encode_out(comfy, "a lighthouse at dusk", "fog").args[0]
    assert cache.loads["text_encoder"] == loads + 1
    assert len(list((tmp_path / "prompt_cache").glob("*.safetensors"))) == 2
    cache.release_all("as after a restart: nothing in memory")
    if not _Opens.installed:
        sys.addaudithook(_Opens.hook)
        _Opens.installed = True
    _Opens.active = opened = []
    try:
        second = _encode_out(comfy, "a lighthouse at dusk", "fog").args[0]
    finally:
        _Opens.active = None
    encoder_file = str(comfy.paths["qwen_4b"])
    assert encoder_file not in opened, "the encoder file was opened"
    assert cache.loads["text_encoder"] == loads + 1 and "text_encoder" not in cache.resident()
    assert torch.equal(second.positive, first.positive.cpu()) and torch.equal(second.negative, first.negative.cpu())
    assert second.text_dim == first.text_dim and second.variant == first.variant
    # a new prompt loads the encoder as usual, or takes back the one an earlier test still holds
    held = any(ref.role == "text_encoder" for ref in list(cache._released.keys()))
    _encode_out(comfy, "a lighthouse at noon", "fog")
    assert "text_encoder" in cache.resident()
    assert cache.loads["text_encoder"] == loads + (1 if held else 2)
    monkeypatch.delenv("KLEIN_PROMPT_CACHE")
    assert cache.prompt_cache().disk is None


def test_unusable_prompt_cache_folder_is_a_warning_not_a_failure(comfy, tmp_path, monkeypatch):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("KLEIN_PROMPT_CACHE", str(blocker / "cache"))
    out = _encode_out(comfy, "a windmill in fog")
    assert out.args[0].positive.shape == (1, 512, 96)
    assert any("prompt cache folder" in w and "cache" in w for w in _warnings(out))
    assert all(str(tmp_path) not in w for w in _warnings(out))



@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "lots", "1e-9"])
def test_prompt_cache_size_setting_never_breaks_the_encoder(comfy, tmp_path, monkeypatch, value):  # noqa: F811
    monkeypatch.setenv("KLEIN_PROMPT_CACHE", str(tmp_path / "prompt_cache"))
    monkeypatch.setenv("KLEIN_PROMPT_CACHE_MB", value)
    out = _encode_out(comfy, "a kite over dunes")
    assert out.args[0].positive.shape == (1, 512, 96)
    disk = comfy.cache.prompt_cache().disk
    if value == "1e-9":  # a positive size too small to hold anything: the smallest usable bound
        assert disk.max_bytes == 1 << 20 and not _warnings(out)
    else:
        assert disk.max_bytes == comfy.cache.PROMPT_CACHE_MB << 20
        assert any("KLEIN_PROMPT_CACHE_MB" in w and "not a positive number" in w for w in _warnings(out))


# ----- image to image and inpainting in the nodes ------------------------------------------------------


def _vae_encode(comfy, vae, pixels, size="crop to 16"):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinVAEEncode.execute(pixels, vae, size).args[0]


def test_sampler_from_a_latent_equals_the_engine(comfy):  # noqa: F811
    model, vae = _load(comfy)
    cond = _encode_out(comfy, "a watercolour").args[0]
    latent = _vae_encode(comfy, vae, torch.rand(1, 64, 96, 3))
    got = _sample(comfy, model, cond, width=0, height=0, steps=4, latent=latent, denoise=0.6, seed=3)
    engine = kc.Engine(model.ref.get(), kind="distilled", prompt_cache=None)
    lat = latent["samples"]
    expected, _ = engine.denoise(kc.Conditioning(cond.positive), [lat], kc.Settings(steps=4, seed=3),
                                 init=InitLatents(lat, 0.6))
    assert torch.equal(got, expected.float())
    plain = _sample(comfy, model, cond, width=0, height=0, steps=4, latent=latent, denoise=0.6, seed=3,
                    latent_as_reference=False)
    assert not torch.equal(plain, got)  # the reference really was used


def test_sampler_mask_keeps_the_unmasked_latents(comfy):  # noqa: F811
    model, vae = _load(comfy)
    cond = _encode_out(comfy, "a red door").args[0]
    latent = _vae_encode(comfy, vae, torch.rand(1, 96, 128, 3))
    mask = torch.zeros(1, 96, 128)
    mask[:, 16:64, 32:96] = 1
    got = _sample(comfy, model, cond, width=0, height=0, steps=3, latent=latent, mask=mask)
    lat_mask = comfy_mask_to_latents(mask, 6, 8)
    keep = (lat_mask == 0).expand_as(got)
    src = latent["samples"].to(torch.bfloat16).float()  # the bf16 model's latents: the image's, rounded
    assert torch.equal(got[keep], src[keep])
    assert not torch.equal(got[~keep], src[~keep])


def test_sampler_latent_and_mask_errors_name_the_input(comfy):  # noqa: F811
    model, vae = _load(comfy)
    cond = _encode_out(comfy).args[0]
    latent = _vae_encode(comfy, vae, torch.rand(1, 64, 64, 3))
    with pytest.raises(ValueError, match="mask needs latent"):
        _sample(comfy, model, cond, mask=torch.ones(1, 64, 64))
    with pytest.raises(ValueError, match="takes the size of latent"):
        _sample(comfy, model, cond, width=64, height=64, latent=latent)
    with pytest.raises(ValueError, match="mask: the mask is empty"):
        _sample(comfy, model, cond, width=0, height=0, latent=latent, mask=torch.zeros(1, 64, 64))
    with pytest.raises(ValueError, match="latent must be FLUX.2 latents"):
        _sample(comfy, model, cond, width=0, height=0, latent={"samples": torch.zeros(1, 4, 8, 8)})


def test_vae_encode_fit_one_megapixel(comfy):  # noqa: F811
    _, vae = _load(comfy)
    assert _vae_encode(comfy, vae, torch.rand(1, 150, 200, 3), "fit 1 megapixel")["samples"].shape[-2:] == (9, 12)
    assert _vae_encode(comfy, vae, torch.rand(1, 150, 200, 3))["samples"].shape[-2:] == (9, 12)  # cropped


def test_inpaint_crop_and_stitch_nodes(comfy):  # noqa: F811
    mod = sys.modules["klein_pack_nodes.inpaint"]
    image = torch.rand(1, 300, 400, 3, dtype=torch.float32)  # not 8-bit values: kept bit for bit anyway
    mask = torch.zeros(1, 300, 400)
    mask[:, 100:140, 250:300] = 1
    with torch.inference_mode():
        crop, crop_mask, info = mod.KleinInpaintCrop.execute(image, mask, 16, 0.0625).args
    assert crop.shape[1] % 16 == 0 and crop.shape[2] % 16 == 0 and crop.shape[1:3] == crop_mask.shape[1:]
    x1, y1, x2, y2 = info.box
    assert x1 <= 234 and y1 <= 84 and x2 >= 316 and y2 >= 156 and "crop" in str(info)
    painted = torch.rand(2, *crop.shape[1:])  # a batch of two painted crops
    with torch.inference_mode():
        out = mod.KleinInpaintStitch.execute(info, painted, 4, True).args[0]
    keep = (mask[0] == 0)
    assert out.shape == (2, 300, 400, 3)
    assert torch.equal(out[:, keep], image[0, keep].expand(2, -1, -1))
    assert not torch.equal(out[:, ~keep], image[0, ~keep].expand(2, -1, -1))
    with torch.inference_mode():
        whole = mod.KleinInpaintStitch.execute(info, painted, 0, False).args[0]
    assert not torch.equal(whole[0, y1:y2, x1:x2], image[0, y1:y2, x1:x2])  # the box replaced
    assert torch.equal(whole[0, :y1], image[0, :y1])
    with pytest.raises(ValueError, match="the mask is 40x30 but the image is 400x300"):
        mod.KleinInpaintCrop.execute(image, torch.ones(1, 30, 40), 16, 1.0)
    with pytest.raises(ValueError, match="empty"):
        mod.KleinInpaintCrop.execute(image, torch.zeros(1, 300, 400), 16, 1.0)
    # a picture without alpha: LoadImage's blank 64x64 mask is named as such, not as a size mismatch
    with pytest.raises(ValueError, match="the picture has no mask.*mask editor"):
        mod.KleinInpaintCrop.execute(image, torch.zeros(1, 64, 64), 16, 1.0)


# ----- GGUF files in the model folders --------------------------------------------------------------


def test_gguf_files_are_listed_load_and_mix_with_safetensors(comfy):  # noqa: F811
    require("gguf")
    from gguf_files import write_tiny_gguf_qwen, write_tiny_gguf_transformer

    from klein_core.quant.ggml import ggml_layers

    unet = comfy.models / "diffusion_models" / "gguf"
    unet.mkdir(exist_ok=True)
    write_tiny_gguf_transformer(unet / "flux-2-klein-4b-Q8_0.gguf")
    write_tiny_gguf_qwen(comfy.models / "text_encoders" / "qwen_3_4b-Q8_0.gguf")
    comfy.folder_paths.filename_list_cache.clear()
    try:
        loader, encoder = comfy.pack.KleinModelLoader, comfy.pack.KleinTextEncode
        names = loader.define_schema().inputs[0].options
        assert "gguf/flux-2-klein-4b-Q8_0.gguf" in names
        assert "qwen_3_4b-Q8_0.gguf" in encoder.define_schema().inputs[0].options
        assert loader.validate_inputs("gguf/flux-2-klein-4b-Q8_0.gguf") is True
        with torch.inference_mode():
            model, *_ = loader.execute("gguf/flux-2-klein-4b-Q8_0.gguf", VAE, "bf16", "auto", "auto").args
        assert set(ggml_layers(model.ref.get()).values()) == {"Q8_0"}
        assert comfy.cache.weight_bytes(model.ref) == module_bytes(model.ref.get())  # planner: real bytes
        # a GGUF transformer with a safetensors encoder, and a GGUF encoder with it
        for enc in (Q4B, "qwen_3_4b-Q8_0.gguf"):
            with torch.inference_mode():
                cond = encoder.execute(enc, "a fox", "").args[0]
            latents = _sample(comfy, model, cond, steps=2)
            assert latents.shape == (1, 128, 4, 4) and torch.isfinite(latents).all()
        with torch.inference_mode():
            q4, *_ = loader.execute(M4B, VAE, "q4", "auto", "auto").args
        assert q4.ref.quantize == "q4" and set(ggml_layers(q4.ref.get()).values()) == {"Q4_0"}
    finally:
        comfy.cache.release_all("gguf test done")
        for p in (unet / "flux-2-klein-4b-Q8_0.gguf", comfy.models / "text_encoders" / "qwen_3_4b-Q8_0.gguf"):
            p.unlink(missing_ok=True)
        unet.rmdir()
        comfy.folder_paths.filename_list_cache.clear()


def test_nvfp4_file_loads_in_the_loader_and_samples(comfy):  # noqa: F811
    require("comfy_kitchen")
    from test_nvfp4 import _nvfp4_file

    from klein_core.quant.nvfp4 import nvfp4_layers
    from klein_core.testing import tiny_transformer

    path = comfy.models / "diffusion_models" / "flux-2-klein-4b-nvfp4.safetensors"
    _nvfp4_file(path, tiny_transformer().float(), "metadata")
    comfy.folder_paths.filename_list_cache.clear()
    try:
        with torch.inference_mode():
            model, *_ = comfy.pack.KleinModelLoader.execute(path.name, VAE, "bf16", "auto", "auto").args
        assert len(nvfp4_layers(model.ref.get())) == 12  # every block Linear of the tiny model (1 + 2 blocks)
        assert comfy.cache.weight_bytes(model.ref) == module_bytes(model.ref.get())
        latents = _sample(comfy, model, _encode_out(comfy, "a fox").args[0], steps=2)
        assert torch.isfinite(latents).all()
    finally:
        comfy.cache.release_all("nvfp4 test done")
        path.unlink()
        comfy.folder_paths.filename_list_cache.clear()


def test_node_outputs_on_the_cpu_are_cast_and_not_copied_through_page_locked_memory(comfy):  # noqa: F811
    """Under ``--cpu`` the outputs stay ordinary CPU tensors; the cast happens as before (the GPU's
    page-locked path: tests/gpu/test_gpu_nodes.py)."""
    x = torch.randn(2, 128, 4, 4, dtype=torch.bfloat16)
    out = comfy.host.to_intermediate(x, torch.float32)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and not out.is_pinned()
    assert torch.equal(out, x.float()) and comfy.host.to_intermediate(out) is out
