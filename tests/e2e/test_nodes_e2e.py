"""The pack's nodes inside a real ComfyUI 0.3.75 server, over HTTP and the websocket, with tiny models.

The tiny models are written into the session's models folder by the ``klein`` fixture, after the
shared server started (the harness smoke tests check that folder is empty); ComfyUI re-lists a
folder when its mtime changes. Sizes and steps of the example workflows are patched down so the
module runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import re
import shutil
import time

import pytest
from comfy_host import PACK_NAME, REPO_ROOT, traceback_blocks
from PIL import Image
from workflow_check import check_ui_workflow

from klein_core.testing import write_tiny_model_files

pytestmark = pytest.mark.e2e

WORKFLOWS = REPO_ROOT / "example_workflows"
NAMES = ("klein_4b_text_to_image", "klein_4b_base_cfg", "klein_4b_two_reference_edit", "klein_4b_img2img",
         "klein_4b_inpaint", "klein_4b_outpaint", "klein_9b_kv_edit", "klein_core_reference_chain",
         "klein_core_sampler", "klein_base_dpmpp_2m_easycache", "klein_train_then_generate")
DISPLAY = {
    "KleinTextEncode": "Qwen3 Layer-Concat Encoder",
    "KleinModelLoader": "Klein Model Loader",
    "KleinReferenceStacker": "Klein Reference Stacker",
    "KleinSampler": "Klein Sampler",
    "KleinVAEDecode": "Flux2 VAE Decode",
    "KleinVAEEncode": "Flux2 VAE Encode",
}
REF_SIZES = {"klein_reference_1.png": (200, 150), "klein_reference_2.png": (96, 128)}
_seeds = itertools.count(1000)  # a new seed per run defeats ComfyUI's output cache


@pytest.fixture(scope="module")
def klein(comfy_server, e2e_models_dir):
    if not (e2e_models_dir / "diffusion_models" / "flux-2-klein-4b.safetensors").is_file():
        paths = write_tiny_model_files(e2e_models_dir)
        # the KV workflow's public file names (BFL's fp8 KV file, ComfyUI's fp8-mixed Qwen3-8B)
        shutil.copy(paths["klein_9b_kv"], e2e_models_dir / "diffusion_models" / "flux-2-klein-9b-kv-fp8.safetensors")
        shutil.copy(paths["qwen_8b"], e2e_models_dir / "text_encoders" / "qwen_3_8b_fp8mixed.safetensors")
    for i, (name, size) in enumerate(REF_SIZES.items()):
        Image.new("RGB", size, (40 + 80 * i, 120, 200 - 60 * i)).save(comfy_server.input_dir / name)
    for name in ("klein_img2img_input.png", "klein_inpaint_input.png", "klein_outpaint_input.png"):
        Image.new("RGB", (128, 96), (90, 120, 150)).save(comfy_server.input_dir / name)  # tests write real ones
    deadline = time.monotonic() + 10
    while "flux-2-klein-4b.safetensors" not in comfy_server.models("diffusion_models"):
        assert time.monotonic() < deadline, "the server does not list the tiny models"
        time.sleep(0.2)
    return comfy_server


def api(name: str, **sampler) -> dict:
    """An API workflow with the sampler's inputs patched (small sizes, few steps, a fresh seed)."""
    graph = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
    node = next(n for n in graph.values() if n["class_type"] == "KleinSampler")
    node["inputs"].update({"seed": next(_seeds), **sampler})
    return graph


def node_id(graph: dict, class_type: str) -> str:
    return next(k for k, n in graph.items() if n["class_type"] == class_type)


def png_size(srv, res) -> tuple[int, int]:
    (img_ref,) = res.images
    raw = srv.view(**img_ref)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(raw)).size


def count(srv, pattern: str) -> int:
    return len(re.findall(pattern, srv.log_text()))


# ----- (a) registration --------------------------------------------------------------------------------


def test_every_node_is_in_object_info(klein):
    info = klein.object_info()
    pack = {k: v for k, v in info.items() if v["python_module"] == f"custom_nodes.{PACK_NAME}"}
    assert DISPLAY.items() <= {k: v["display_name"] for k, v in pack.items()}.items()
    for name, v in pack.items():
        assert name.startswith("Klein") and v["category"].startswith("Klein"), name
        for group in ("required", "optional"):
            for inp, spec in v["input"].get(group, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{inp}"
    loader = pack["KleinModelLoader"]["input"]["required"]
    assert loader["model_name"][1]["options"] == [
        "flux-2-klein-4b.safetensors", "flux-2-klein-9b-kv-fp8.safetensors", "flux-2-klein-9b-kv.safetensors",
        "flux-2-klein-9b.safetensors", "flux-2-klein-base-4b.safetensors"]
    assert pack["KleinModelLoader"]["output"] == ["KLEIN_MODEL", "KLEIN_VAE", "VAE"]
    assert pack["KleinTextEncode"]["input"]["required"]["text_encoder"][1]["options"] == [
        "qwen_3_4b.safetensors", "qwen_3_8b.safetensors", "qwen_3_8b_fp8mixed.safetensors"]
    assert pack["KleinTextEncode"]["output"] == ["KLEIN_COND", "CONDITIONING", "CONDITIONING"]
    assert pack["KleinReferenceStacker"]["input_order"] == {"required": ["image", "vae"],
                                                            "optional": ["references"]}
    assert pack["KleinReferenceStacker"]["output"] == ["KLEIN_REFS", "STRING"]
    sampler = pack["KleinSampler"]
    assert sampler["input_order"] == {
        "required": ["model", "conditioning", "width", "height", "steps", "guidance", "seed", "batch_size"],
        "optional": ["references", "latent", "mask", "denoise", "latent_as_reference", "reference_mode",
                     "negative"]}
    assert sampler["input"]["required"]["seed"][1]["control_after_generate"] is True
    assert sampler["output"] == ["LATENT"]
    assert pack["KleinVAEDecode"]["output"] == ["IMAGE"]


# ----- (b) the UI workflows against the live definitions ------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_validates_against_live_object_info(klein, name):
    workflow = json.loads((WORKFLOWS / f"{name}.json").read_text())
    problems = check_ui_workflow(workflow, klein.object_info())
    if name == "klein_train_then_generate":  # the LoRA it loads exists once its first run has trained it
        problems = [p for p in problems if "lora_name: 'klein_lora.safetensors' is not in the live list" not in p]
    assert not problems, "\n".join(problems)


def test_workflow_check_catches_mistakes(klein):
    info = klein.object_info()
    good = json.loads((WORKFLOWS / "klein_4b_two_reference_edit.json").read_text())
    bad = copy.deepcopy(good)
    sampler = next(n for n in bad["nodes"] if n["type"] == "KleinSampler")
    sampler["widgets_values"].remove("randomize")
    loader = next(n for n in bad["nodes"] if n["type"] == "KleinModelLoader")
    loader["widgets_values"][0] = "flux-2-klein-404.safetensors"
    vae_link = next(lk for lk in bad["links"] if lk[5] == "KLEIN_VAE")
    vae_link[5] = "KLEIN_MODEL"
    problems = "\n".join(check_ui_workflow(bad, info))
    assert "widget values" in problems and "flux-2-klein-404" in problems
    assert f"link {vae_link[0]}:" in problems


# ----- (c) the API workflows run -----------------------------------------------------------------------


@pytest.mark.parametrize("name,patch,size", [
    ("klein_4b_text_to_image", {"width": 128, "height": 96, "steps": 3}, (128, 96)),
    ("klein_4b_base_cfg", {"width": 96, "height": 64, "steps": 3}, (96, 64)),
    ("klein_4b_two_reference_edit", {"steps": 2}, (192, 144)),  # 0x0 = reference 1 (200x150 -> 192x144)
])
def test_api_workflow_runs_with_progress_and_image(klein, name, patch, size):
    graph = api(name, **patch)
    res = klein.run_prompt(graph, timeout=90)
    assert res.ok, res.describe()
    sampler = node_id(graph, "KleinSampler")
    steps = [(p["value"], p["max"]) for p in res.progress if p["node"] == sampler]
    assert steps == [(i, patch["steps"]) for i in range(1, patch["steps"] + 1)], res.progress
    assert res.binary_frames >= patch["steps"], "no preview images"  # --preview-method auto
    assert png_size(klein, res) == size
    if name == "klein_4b_two_reference_edit":
        texts = [o["text"] for o in res.outputs.values() if "text" in o]
        assert ["ref 1: 192x144 (from 200x150)\nref 2: 96x128 (from 96x128)"] in texts, res.outputs


# ----- (d) errors ----------------------------------------------------------------------------------------


def test_wrong_file_name_is_a_validation_error(klein):
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    loader = node_id(graph, "KleinModelLoader")
    graph[loader]["inputs"]["model_name"] = "flux-2-klein-404.safetensors"
    status, body = klein.post_prompt(graph)
    assert status == 400, body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    err = body["node_errors"][loader]
    assert err["class_type"] == "KleinModelLoader"
    (hit,) = [e for e in err["errors"] if e["extra_info"]["input_name"] == "model_name"]
    assert "model_name 'flux-2-klein-404.safetensors' is not available" in hit["details"]
    assert "models/diffusion_models" in hit["details"]


def test_mismatched_encoder_is_an_execution_error_naming_the_fix(klein):
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    graph[node_id(graph, "KleinModelLoader")]["inputs"]["model_name"] = "flux-2-klein-9b.safetensors"
    res = klein.run_prompt(graph, timeout=60)
    err = res.error
    assert err is not None, res.describe()
    assert (err["node_type"], err["exception_type"]) == ("KleinSampler", "ValueError")
    msg = err["exception_message"]
    for part in ("Klein Sampler", "flux-2-klein-9b.safetensors", "qwen_3_4b.safetensors",
                 "qwen_3_8b.safetensors"):
        assert part in msg, msg
    ok = klein.run_prompt(api("klein_4b_text_to_image", width=64, height=64, steps=1), timeout=60)
    assert ok.ok, ok.describe()
    assert png_size(klein, ok) == (64, 64)


# ----- (e) interrupt -------------------------------------------------------------------------------------


def test_interrupt_stops_the_sampler_and_the_next_run_works(klein):
    graph = api("klein_4b_text_to_image", width=512, height=512, steps=1000)
    sampler = node_id(graph, "KleinSampler")
    sent = []

    def on_message(kind, data):
        if kind == "progress" and data["node"] == sampler and data["value"] >= 2 and not sent:
            sent.append((data["value"], klein.interrupt()))

    res = klein.run_prompt(graph, timeout=120, on_message=on_message)
    assert sent and sent[0][1] == 200
    assert res.interrupted, res.describe()
    assert not res.error and not res.images
    done = max(p["value"] for p in res.progress if p["node"] == sampler)
    assert 2 <= done < 1000 and done <= sent[0][0] + 20, f"stopped at {done}, interrupted at {sent[0][0]}"
    again = klein.run_prompt(api("klein_4b_text_to_image", width=96, height=80, steps=2), timeout=60)
    assert again.ok, again.describe()
    assert png_size(klein, again) == (96, 80)


# ----- (f) /free ------------------------------------------------------------------------------------------


def test_free_releases_the_cached_models(klein):
    first = klein.run_prompt(api("klein_4b_text_to_image", width=64, height=64, steps=1), timeout=60)
    assert first.ok, first.describe()
    loaded = count(klein, r"Klein: loaded transformer flux-2-klein-4b\.safetensors")
    released = count(klein, r"Klein: released \d+ cached model")
    assert klein.free(unload_models=True, free_memory=False) == 200
    deadline = time.monotonic() + 15
    while count(klein, r"Klein: released \d+ cached model") == released:
        assert time.monotonic() < deadline, "no release line after POST /free\n" + klein.log_tail(2000)
        time.sleep(0.1)
    line = re.findall(r"Klein: released .*", klein.log_text())[-1]
    assert "transformer flux-2-klein-4b.safetensors" in line and "vae flux2-vae.safetensors" in line
    assert line.endswith("cache empty"), line
    # ComfyUI still caches the loader's output; the sampler loads the weights again from the file.
    second = klein.run_prompt(api("klein_4b_text_to_image", width=64, height=64, steps=1), timeout=60)
    assert second.ok, second.describe()
    assert count(klein, r"Klein: loaded transformer flux-2-klein-4b\.safetensors") == loaded + 1
    cached = {n for m in second.of_type("execution_cached") for n in m["nodes"]}
    assert node_id(api("klein_4b_text_to_image"), "KleinModelLoader") in cached


def test_our_models_go_through_comfy_model_management(klein):
    """ComfyUI loads our models itself (so it can make room for them, and unload them for others)."""
    released = count(klein, r"Klein: released \d+ cached model")
    assert klein.free(unload_models=True, free_memory=False) == 200  # start with nothing loaded
    deadline = time.monotonic() + 15
    while count(klein, r"Klein: released \d+ cached model") == released:
        assert time.monotonic() < deadline, klein.log_tail(2000)
        time.sleep(0.1)
    before = {name: count(klein, rf"Requested to load {name}\b") for name in ("KleinTransformer", "KleinVae",
                                                                                "KleinTextEncoder")}
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=1)
    graph[node_id(graph, "KleinTextEncode")]["inputs"]["prompt"] = f"a quiet pond {time.time()}"  # not cached
    res = klein.run_prompt(graph, timeout=60)
    assert res.ok, res.describe()
    for name, n in before.items():
        assert count(klein, rf"Requested to load {name}\b") > n, f"{name} was not loaded through ComfyUI"


def test_pack_logged_no_unexpected_tracebacks(klein):
    expected = ("ValueError: Klein Sampler: the conditioning", "InterruptProcessingException")
    deliberate = "wrong_size.safetensors: this LoRA was trained for"  # test_lora_e2e.py's bad LoRA
    ours = [b for b in traceback_blocks(klein.log_text())
            if any(PACK_NAME in ln or "klein_core" in ln for ln in b)
            and not b[-1].startswith(expected) and deliberate not in b[-1]]
    assert not ours, "\n\n".join("\n".join(b) for b in ours)


@pytest.mark.parametrize("name", ["klein_core_sampler", "klein_base_dpmpp_2m_easycache"])
def test_native_model_workflows_run_over_http(klein, name):
    """The bridged MODEL through ComfyUI's own sampler nodes, queued over HTTP as a script would, decoded
    by the loader's native VAE: the server runs the graph and saves a picture of the size asked."""
    graph = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
    graph[node_id(graph, "Flux2Scheduler")]["inputs"].update({"steps": 3, "width": 96, "height": 64})
    graph[node_id(graph, "EmptyFlux2LatentImage")]["inputs"].update({"width": 96, "height": 64})
    graph[node_id(graph, "RandomNoise")]["inputs"]["noise_seed"] = next(_seeds)
    res = klein.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    assert png_size(klein, res) == (96, 64)
