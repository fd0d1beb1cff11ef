# ruff: noqa: F811  (comfy, imported from test_nodes, is a fixture)
"""A hunt over the shipped example workflows and the HTTP API as users drive it, in process (the
pack's node definitions as /object_info serves them, and the hooks ComfyUI calls while it queues a
prompt), on the CPU with tiny models.

Tests whose docstring starts with "BUG:" fail on the code they were written against; "Edge case:"
tests pin behaviour checked and found correct that no other in-process test covers.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
from test_nodes import M4B, PACK, VAE, comfy  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / "example_workflows"
sys.path.append(str(REPO / "tests" / "e2e"))  # appended: the checker the e2e tests run against /object_info
from workflow_check import check_ui_workflow


def _object_info(comfy) -> dict:
    """The pack's part of /object_info, as the server builds it (V3 nodes: GET_NODE_INFO_V1)."""
    return {n.GET_NODE_INFO_V1()["name"]: n.GET_NODE_INFO_V1() for n in comfy.pack.NODES}


# ----- shipped workflows ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_ui_workflows_fit_the_pack_node_definitions_in_process(comfy, path):
    """Edge case: every shipped UI workflow's pack nodes fit the definitions the server would serve
    (widget count and order with the seed's control_after_generate entry, values within min/max and
    in the fixed lists, socket types, outputs, link types) without a running server. Only model-file
    lists are left out (they depend on the files installed; the e2e tests check them live)."""
    info = _object_info(comfy)
    files = ("model_name", "vae_name", "text_encoder", "lora_name")  # lists of the installed files
    problems = [p for p in check_ui_workflow(json.loads(path.read_text()), info)
                if "no such node type" not in p  # core nodes: checked live by tests/e2e
                and not any(f": {f}: " in p and "is not in the live list" in p for f in files)]
    assert not problems, "\n".join(problems)


# ----- what ComfyUI calls while it queues a prompt ---------------------------------------------------------


def test_trainer_fingerprint_survives_a_linked_dataset(comfy):
    """Was a bug: KleinLoraTrainer.fingerprint_inputs raises AttributeError when `dataset` is a link.

    ComfyUI calls fingerprint_inputs (IS_CHANGED) for every prompt with the constant inputs only:
    execution.IsChangedCache.get -> get_input_data(..., execution_list=None) gives every linked input
    as None. That is the normal case for `dataset` turned into an input and fed by a String primitive
    or any STRING node. The node then does `dataset_path(None)`, which calls `None.strip()`.
    Seen in 0.3.75: the host logs "WARNING: 'NoneType' object has no attribute 'strip'" on every queue
    and sets is_changed to NaN. NaN never equals itself, so the trainer is never served from the cache.
    Queueing again (as klein_train_then_generate says to) runs the trainer again: it resumes from its
    final checkpoint and draws every sample prompt anew (sample_steps per prompt at resolution²). The
    LoRA loader and sampler after it run again too. The other fingerprints (loader, encoder, LoRA
    loader, via common.file_state) accept None.
    Fix: nodes/train.py, KleinLoraTrainer.fingerprint_inputs: return None (or a constant) when
    `dataset` is not a str, as common.file_state does; execute then gets the real value."""
    train = importlib.import_module(f"{PACK}.train")
    linked = {"dataset": None, "model_name": "flux-2-klein-base-4b.safetensors", "vae_name": VAE,
              "text_encoder": "qwen_3_4b.safetensors"}
    first = train.KleinLoraTrainer.fingerprint_inputs(**linked)
    second = train.KleinLoraTrainer.fingerprint_inputs(**linked)
    assert first == second  # the same constant inputs: the same fingerprint (ComfyUI's cache hit)
    assert not (isinstance(first, float) and math.isnan(first))


def test_the_other_fingerprints_and_validations_accept_linked_inputs(comfy):
    """Edge case: the other hooks ComfyUI calls while it queues accept None for a linked input, as
    get_input_data gives it. The hooks are the loader's, the encoder's and the LoRA loader's
    fingerprint_inputs, and the loader's, encoder's, LoRA loader's and trainer's validate_inputs on a
    linked file name. None is not refused as a missing file; the node checks the value when it runs."""
    p = comfy.pack
    assert p.KleinModelLoader.fingerprint_inputs(model_name=None, vae_name=None) == (None, None)
    assert p.KleinTextEncode.fingerprint_inputs(text_encoder=None, lora_name=None) == (None, None)
    assert p.KleinLoraLoader.fingerprint_inputs(lora_name=None, strength=None) == (None, None)
    assert p.KleinModelLoader.validate_inputs(model_name=None) is True
    assert p.KleinTextEncode.validate_inputs(text_encoder=None) is True
    assert p.KleinLoraLoader.validate_inputs(lora_name=None) is True
    assert p.KleinLoraTrainer.validate_inputs(model_name=None) is True
    assert p.KleinSampler.validate_inputs(guidance=None) is True


# ----- what /object_info tells users -------------------------------------------------------------------


def test_model_to_model_description_matches_its_memory_mode_behaviour(comfy, monkeypatch):
    """Was a bug: Klein Model to MODEL's description says the loader's memory_mode does not apply, but it
    does.

    /object_info (the node's description in the UI) says "ComfyUI loads it whole onto the GPU; the
    loader's memory_mode does not apply here." But nodes/native_model.py, bridge(), streams the
    transformer blocks when the loader's memory_mode is blocks or minimum (STREAMED_MODES): stream_to
    is the compute device and the load device is the offload device (CPU memory). docs/comfyui.md
    describes the same streaming.
    User effect: someone whose GPU is smaller than the model reads the node's own text. They conclude
    that Klein Model to MODEL cannot run there, or they leave memory_mode at auto/resident and run out
    of memory. In fact memory_mode blocks is exactly the setting that makes it fit.
    Fix: nodes/native_model.py, KleinModelToMODEL.define_schema: say that memory_mode blocks or
    minimum keeps the weights in CPU memory and streams the blocks each step, and that other modes
    let ComfyUI load it whole."""
    native = importlib.import_module(f"{PACK}.native_model")
    model = comfy.pack.KleinModelLoader.execute(M4B, VAE, "fp32", "auto", "blocks").args[0]
    assert model.memory == "blocks"
    seen = {}
    real = native.KleinDiffusionModel

    def spy(*args, **kw):
        seen["stream_to"] = kw.get("stream_to")
        return real(*args, **kw)

    monkeypatch.setattr(native, "KleinDiffusionModel", spy)
    patcher = native.bridge(model)
    assert patcher is not None
    streamed = seen["stream_to"] is not None
    assert streamed, "memory_mode blocks no longer streams: then the description would be right"
    description = native.KleinModelToMODEL.GET_NODE_INFO_V1()["description"]
    assert "memory_mode does not apply" not in description, description
    assert "memory_mode blocks or minimum" in description and "stream" in description, description


def test_sampler_size_and_step_limits_in_object_info_are_the_engines(comfy):
    """Edge case: the sampler's limits in /object_info agree with what klein_core accepts. steps max
    (1000) is within the engine's MAX_STEPS, seed max is the engine's MAX_SEED (unsigned 64-bit, what
    RandomNoise offers too), width/height max 4096 with step 16 gives a 4096x1024 output that the
    engine accepts (exactly 4 megapixels), and the denoise minimum is the one the node's own message
    names."""
    from klein_core.pipeline.request import MAX_PIXELS, MAX_STEPS, Settings, resolve
    from klein_core.pipeline.sampling import MAX_SEED

    spec = _object_info(comfy)["KleinSampler"]["input"]
    req, opt = spec["required"], spec["optional"]
    assert req["steps"][1]["max"] <= MAX_STEPS
    assert req["seed"][1]["max"] == MAX_SEED and req["seed"][1]["min"] == 0
    w = req["width"][1]["max"]
    assert w % req["width"][1]["step"] == 0
    run = resolve(Settings(w, None, req["steps"][1]["max"], None, MAX_SEED, req["batch_size"][1]["max"]),
                  "distilled", warn=False)
    assert run.width * run.height == MAX_PIXELS and run.seed == MAX_SEED
    assert opt["denoise"][1]["min"] == 0.01 and opt["denoise"][1]["max"] == 1.0


def test_api_workflow_node_ids_match_the_docs(comfy):
    """Edge case: the node ids that docs/comfyui.md gives for the API files, which scripts edit by
    id, are the node types it names in every shipped API file with the Klein Sampler ("1" loader,
    "2" encoder, "3" sampler, "4" decode, "5" Save Image). The ids for the edit, inpaint, outpaint,
    img2img and native-sampler workflows are checked the same way."""
    def api(name):
        return json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())

    with_sampler = [p.name.removesuffix(".api.json") for p in sorted((WORKFLOWS / "api").glob("*.api.json"))
                    if any(n["class_type"] == "KleinSampler" for n in json.loads(p.read_text()).values())]
    assert len(with_sampler) >= 8
    for name in with_sampler:
        g = api(name)
        assert [g[k]["class_type"] for k in "12345"] == [
            "KleinModelLoader", "KleinTextEncode", "KleinSampler", "KleinVAEDecode", "SaveImage"], name
    edit = api("klein_4b_two_reference_edit")
    assert [edit[k]["class_type"] for k in ("7", "8", "9", "10", "11")] == [
        "LoadImage", "LoadImage", "KleinReferenceStacker", "KleinReferenceStacker", "PreviewAny"]
    for name in ("klein_4b_inpaint", "klein_4b_outpaint"):
        g = api(name)
        assert g["5"]["inputs"]["images"] == ["10", 0] and g["10"]["class_type"] == "KleinInpaintStitch"
        assert (g["7"]["class_type"], g["9"]["class_type"], g["8"]["class_type"]) == (
            "LoadImage", "KleinInpaintCrop", "KleinVAEEncode")
    assert api("klein_4b_outpaint")["11"]["class_type"] == "ImagePadForOutpaint"
    assert "right" in api("klein_4b_outpaint")["11"]["inputs"]
    img2img = api("klein_4b_img2img")
    assert img2img["7"]["class_type"] == "LoadImage" and "denoise" in img2img["3"]["inputs"]
    for name in ("klein_core_sampler", "klein_base_dpmpp_2m_easycache"):
        g = api(name)
        assert {k: g[k]["class_type"] for k in ("1", "2", "3", "5", "7", "8", "10", "11")} == {
            "1": "KleinModelLoader", "2": "KleinTextEncode", "3": "KleinModelToMODEL", "5": "RandomNoise",
            "7": "Flux2Scheduler", "8": "EmptyFlux2LatentImage", "10": "VAEDecode", "11": "SaveImage"}, name
        assert "noise_seed" in g["5"]["inputs"] and "steps" in g["7"]["inputs"]
