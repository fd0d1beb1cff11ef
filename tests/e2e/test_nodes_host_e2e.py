"""The pack among ComfyUI's own nodes in a real 0.3.75 server: warnings in the history and on the
node, each validation error once under its input, no server paths in errors, and our LATENT through
the core latent nodes and back into Flux2 VAE Decode."""

from __future__ import annotations

import io
import json
import shutil
import time

import numpy as np
import pytest
from extras import require
from PIL import Image
from test_nodes_e2e import api, klein, node_id  # noqa: F401 (klein is a fixture)

pytestmark = pytest.mark.e2e

LONG = " ".join(f"word{i}" for i in range(700))


def _pixels(srv, image: dict) -> np.ndarray:
    raw = srv.view(image["filename"], image.get("subfolder", ""), image.get("type", "output"))
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def _images_of(res, node: str) -> list[dict]:
    return res.outputs.get(node, {}).get("images", [])


# ----- warnings ---------------------------------------------------------------------------------------


def test_warnings_reach_the_history_and_the_node(klein):  # noqa: F811
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1, guidance=2.5)
    enc, sampler = node_id(graph, "KleinTextEncode"), node_id(graph, "KleinSampler")
    graph[enc]["inputs"].update(prompt=f"{LONG} {time.time()}", negative_prompt="blurry")
    res = klein.run_prompt(graph, timeout=90)
    assert res.ok, res.describe()
    [cut] = res.outputs[enc]["warnings"]
    assert "prompt is" in cut and "only the first 512 are used" in cut and "whole prompt" in cut
    sampler_warnings = res.outputs[sampler]["warnings"]
    assert any("negative prompt is not used" in w for w in sampler_warnings), sampler_warnings
    assert any("guidance 2.50 is ignored" in w for w in sampler_warnings), sampler_warnings
    shown = dict(res.node_texts)
    assert cut in shown.get(enc, "") and all(w in shown.get(sampler, "") for w in sampler_warnings), res.node_texts
    # the same prompt with the whole-prompt option: nothing to say
    graph[enc]["inputs"]["max_tokens"] = "whole prompt"
    graph[sampler]["inputs"].update(guidance=0.0, seed=graph[sampler]["inputs"]["seed"] + 1)
    graph[enc]["inputs"]["negative_prompt"] = ""
    res = klein.run_prompt(graph, timeout=90)
    assert res.ok, res.describe()
    assert "warnings" not in res.outputs.get(enc, {}) and "warnings" not in res.outputs.get(sampler, {})


# ----- errors -----------------------------------------------------------------------------------------


def test_bad_model_name_is_one_error_under_model_name(klein):  # noqa: F811
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    loader = node_id(graph, "KleinModelLoader")
    graph[loader]["inputs"].update(model_name="nope.safetensors")
    status, body = klein.post_prompt(graph)
    assert status == 400
    errors = body["node_errors"][loader]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == ["model_name"], errors


def test_bad_lora_name_is_refused_when_queued(klein):  # noqa: F811
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    sampler, loader = node_id(graph, "KleinSampler"), node_id(graph, "KleinModelLoader")
    graph["90"] = {"class_type": "KleinLoraLoader",
                   "inputs": {"model": [loader, 0], "lora_name": "missing_lora.safetensors", "strength": 1.0}}
    graph[sampler]["inputs"]["model"] = ["90", 0]
    status, body = klein.post_prompt(graph)
    assert status == 400, body
    errors = body["node_errors"]["90"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == ["lora_name"], errors
    assert "missing_lora.safetensors' is not available" in errors[0]["details"]


def test_bad_fixed_choice_fails_by_name_when_run(klein):  # noqa: F811
    """ComfyUI 0.3.75 does not check V3 combo values when a prompt is queued (current ComfyUI does);
    the node refuses the value when it runs, naming the input."""
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    graph[node_id(graph, "KleinModelLoader")]["inputs"]["weight_dtype"] = "int4"
    res = klein.run_prompt(graph, timeout=60)
    assert res.error is not None, res.describe()
    assert "Klein Model Loader: weight_dtype 'int4' is not one of bf16, fp16, fp32, fp8" in \
        res.error["exception_message"]


def test_errors_sent_to_clients_carry_no_server_paths(klein, e2e_models_dir):  # noqa: F811
    bad = e2e_models_dir / "diffusion_models" / "klein-broken.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    try:
        deadline = time.monotonic() + 10
        while "klein-broken.safetensors" not in klein.models("diffusion_models"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
        graph[node_id(graph, "KleinModelLoader")]["inputs"]["model_name"] = "klein-broken.safetensors"
        res = klein.run_prompt(graph, timeout=60)
        err = res.error
        assert err is not None, res.describe()
        assert "klein-broken.safetensors" in err["exception_message"]
        client_view = json.dumps({k: err.get(k) for k in ("exception_message", "current_inputs")})
        assert str(e2e_models_dir) not in client_view and "/tmp" not in client_view, client_view
        assert str(e2e_models_dir) not in json.dumps(klein.history(res.prompt_id).get("status", {}))
        assert str(e2e_models_dir) in klein.log_text()  # the server log keeps the full story
    finally:
        bad.unlink()


# ----- our LATENT among the core latent nodes ----------------------------------------------------------


def test_latent_through_core_nodes_and_back(klein):  # noqa: F811
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    sampler, loader = node_id(graph, "KleinSampler"), node_id(graph, "KleinModelLoader")
    vae = [loader, 1]
    prefix = f"klein_latent_{time.time_ns()}"
    graph.update({
        "20": {"class_type": "LatentUpscaleBy", "inputs": {"samples": [sampler, 0], "upscale_method": "nearest-exact",
                                                           "scale_by": 1.5}},
        "21": {"class_type": "LatentBatch", "inputs": {"samples1": ["20", 0], "samples2": [sampler, 0]}},
        "22": {"class_type": "KleinVAEDecode", "inputs": {"samples": ["21", 0], "vae": vae}},
        "23": {"class_type": "SaveImage", "inputs": {"images": ["22", 0], "filename_prefix": "upscaled_batch"}},
        "24": {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": prefix}},
        "25": {"class_type": "LatentUpscale", "inputs": {"samples": [sampler, 0], "upscale_method": "nearest-exact",
                                                         "width": 128, "height": 128, "crop": "disabled"}},
        "26": {"class_type": "KleinVAEDecode", "inputs": {"samples": ["25", 0], "vae": vae}},
        "27": {"class_type": "SaveImage", "inputs": {"images": ["26", 0], "filename_prefix": "latent_upscale"}},
    })
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    direct = [_pixels(klein, i) for i in _images_of(res, "5")]
    batch = [_pixels(klein, i) for i in _images_of(res, "23")]
    assert [d.shape for d in direct] == [(64, 64, 3)]
    assert [b.shape for b in batch] == [(96, 96, 3)] * 2  # 1.5x; the second input resized to the first
    # LatentUpscale assumes 8 pixels per latent position (SD); FLUX.2 latents have 16, so 128 px asked
    # gives 16 positions = 256 px: documented in docs/comfyui.md.
    assert [_pixels(klein, i).shape for i in _images_of(res, "27")] == [(256, 256, 3)]

    [saved] = res.outputs["24"]["latents"]
    src = klein.output_dir / saved.get("subfolder", "") / saved["filename"]
    name = f"{prefix}.latent"
    shutil.copy(src, klein.input_dir / name)
    back = {
        "30": {"class_type": "LoadLatent", "inputs": {"latent": name}},
        loader: graph[loader],
        "31": {"class_type": "KleinVAEDecode", "inputs": {"samples": ["30", 0], "vae": vae}},
        "32": {"class_type": "SaveImage", "inputs": {"images": ["31", 0], "filename_prefix": "loaded_latent"}},
    }
    res2 = klein.run_prompt(back, timeout=60)
    assert res2.ok, res2.describe()
    [loaded] = [_pixels(klein, i) for i in _images_of(res2, "32")]
    assert np.array_equal(loaded, direct[0])  # SaveLatent/LoadLatent round trip: the same image


# ----- image to image, inpainting, outpainting ---------------------------------------------------------


def _photo(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _shrunk(graph: dict) -> dict:
    for n in graph.values():  # paint the crop small: tiny models, two CPU cores
        if n["class_type"] == "KleinInpaintCrop":
            n["inputs"]["megapixels"] = 0.0625
    return graph


def test_img2img_workflow(klein):  # noqa: F811
    Image.fromarray(_photo(200, 150, 1)).save(klein.input_dir / "klein_img2img_input.png")
    graph = api("klein_4b_img2img")
    res = klein.run_prompt(graph, timeout=90)
    assert res.ok, res.describe()
    sampler = node_id(graph, "KleinSampler")
    assert {p["max"] for p in res.progress if p["node"] == sampler} == {3}  # int(4 * 0.6) -> 3 of 4 steps run
    [image] = _images_of(res, "5")
    assert _pixels(klein, image).shape == (144, 192, 3)  # 200x150 resized to multiples of 16


def test_inpaint_workflow_changes_only_the_painted_pixels(klein):  # noqa: F811
    rgb = _photo(240, 176, 2)
    alpha = np.full((176, 240), 255, dtype=np.uint8)
    alpha[60:120, 150:200] = 0  # transparent = LoadImage's mask = repaint
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(klein.input_dir / "klein_inpaint_input.png")
    graph = _shrunk(api("klein_4b_inpaint"))
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    [image] = _images_of(res, "5")
    out = _pixels(klein, image)
    keep = alpha == 255
    assert out.shape == rgb.shape
    assert np.array_equal(out[keep], rgb[keep])  # every unmasked pixel, exactly
    assert np.abs(out[~keep].astype(int) - rgb[~keep]).mean() > 5


def test_outpaint_workflow_with_core_padding(klein):  # noqa: F811
    rgb = _photo(160, 128, 3)
    Image.fromarray(rgb).save(klein.input_dir / "klein_outpaint_input.png")
    graph = _shrunk(api("klein_4b_outpaint"))
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    [image] = _images_of(res, "5")
    out = _pixels(klein, image)
    assert out.shape == (128, 160 + 256, 3)
    feather = 40  # ImagePadForOutpaint's feathering repaints that band of the picture's right edge
    assert np.array_equal(out[:, : 160 - feather], rgb[:, : 160 - feather])
    assert np.abs(out[:, 160:].astype(int) - 128).mean() > 3  # the new area is painted, not the grey fill


def test_core_image_composite_masked_takes_our_images(klein):  # noqa: F811
    """ComfyUI's ImageCompositeMasked works on our decoded images too (an alternative to the stitch)."""
    rgb = _photo(96, 64, 4)
    Image.fromarray(rgb).save(klein.input_dir / "klein_composite_input.png")
    graph = api("klein_4b_text_to_image", width=96, height=64, steps=1)
    graph.update({
        "40": {"class_type": "LoadImage", "inputs": {"image": "klein_composite_input.png"}},
        "41": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": 96, "height": 64}},
        "42": {"class_type": "ImageCompositeMasked", "inputs": {
            "destination": ["40", 0], "source": ["4", 0], "x": 32, "y": 0, "resize_source": False,
            "mask": ["41", 0]}},
        "43": {"class_type": "SaveImage", "inputs": {"images": ["42", 0], "filename_prefix": "composited"}},
    })
    res = klein.run_prompt(graph, timeout=60)
    assert res.ok, res.describe()
    [image] = _images_of(res, "43")
    [decoded] = _images_of(res, "5")
    out, ours = _pixels(klein, image), _pixels(klein, decoded)
    assert np.array_equal(out[:, :32], rgb[:, :32])  # left of the pasted image: the destination's pixels
    assert np.array_equal(out[:, 32:], ours[:, :64])  # our decoded image, placed at x=32


# ----- Klein 9B-KV -----------------------------------------------------------------------------------


def test_kv_workflow_runs_and_reuses_the_reference_pass(klein):  # noqa: F811
    import re

    graph = api("klein_9b_kv_edit", steps=2)
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    assert _pixels(klein, _images_of(res, "5")[0]).shape == (144, 192, 3)  # reference 1's size
    assert re.search(r"Klein Sampler: kv .*\(kv\)", klein.log_text())
    reused = len(re.findall(r"reference keys/values reused", klein.log_text()))
    graph[node_id(graph, "KleinTextEncode")]["inputs"]["prompt"] = "another prompt, same pictures"
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    assert len(re.findall(r"reference keys/values reused", klein.log_text())) == reused + 1


# ----- GGUF --------------------------------------------------------------------------------------------


def test_gguf_transformer_and_encoder_run_in_the_server(klein, e2e_models_dir):  # noqa: F811
    require("gguf")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gguf_files import write_tiny_gguf_qwen, write_tiny_gguf_transformer

    tr = write_tiny_gguf_transformer(e2e_models_dir / "diffusion_models" / "flux-2-klein-4b-Q8_0.gguf")
    te = write_tiny_gguf_qwen(e2e_models_dir / "text_encoders" / "qwen_3_4b-Q4_0.gguf", block="Q4_0")
    try:
        deadline = time.monotonic() + 10
        while "flux-2-klein-4b-Q8_0.gguf" not in json.dumps(klein.object_info("KleinModelLoader")):
            assert time.monotonic() < deadline, "the .gguf file is not listed"
            time.sleep(0.2)
        graph = api("klein_4b_text_to_image", width=64, height=64, steps=2)
        graph[node_id(graph, "KleinModelLoader")]["inputs"]["model_name"] = "flux-2-klein-4b-Q8_0.gguf"
        res = klein.run_prompt(graph, timeout=90)  # GGUF transformer + safetensors encoder
        assert res.ok, res.describe()
        graph[node_id(graph, "KleinTextEncode")]["inputs"]["text_encoder"] = "qwen_3_4b-Q4_0.gguf"
        res = klein.run_prompt(graph, timeout=90)  # both GGUF
        assert res.ok, res.describe()
        assert "Linear layers kept as GGML blocks (Q8_0)" in klein.log_text()
    finally:
        tr.unlink(missing_ok=True)
        te.unlink(missing_ok=True)
