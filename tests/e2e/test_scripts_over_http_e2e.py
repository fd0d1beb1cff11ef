# ruff: noqa: F811  (the klein fixture, imported from test_nodes_e2e, is every test's argument)
"""Driving the pack over ComfyUI's HTTP API from a script, and loading the shipped workflows, against a
real headless ComfyUI 0.3.75 with tiny models.

Tests whose docstring starts with "Was a bug:" failed on the code before their fix (a hunt over the
HTTP API); the others pin behaviour a script relies on that no other e2e test checks: the shipped API files are what the UI files
export, /object_info defaults fit their own limits, bad values are refused by input name, a failed,
interrupted or cached run leaves the next run bit-identical, and saved PNGs carry a prompt that
re-creates them.

Its runs fail on purpose, which logs errors naming the pack: the file is named to run after the
session server's log checks (test_host_smoke, test_nodes_e2e's traceback check), as the other files
with deliberate failures (test_nodes_host_e2e, test_seed_e2e) are.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import shutil
import time

import numpy as np
import pytest
from comfy_host import PromptRejected
from PIL import Image
from test_nodes_e2e import WORKFLOWS, api, klein, node_id  # noqa: F401 (klein is a fixture)
from workflow_check import VIRTUAL_NODES, _inputs, _is_widget, _value_problem

pytestmark = pytest.mark.e2e

_seeds = itertools.count(770_000)  # own seed range: other modules' cached sampler outputs never match


def _pixels(srv, image: dict) -> np.ndarray:
    raw = srv.view(image["filename"], image.get("subfolder", ""), image.get("type", "output"))
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def _t2i(seed: int, **sampler) -> dict:
    return api("klein_4b_text_to_image", **{"width": 64, "height": 64, "steps": 2, "seed": seed, **sampler})


def _image(srv, graph: dict, **kw) -> tuple[np.ndarray, object]:
    res = srv.run_prompt(graph, timeout=60, **kw)
    assert res.ok, res.describe()
    (img,) = res.images
    return _pixels(srv, img), res


def _cached(res) -> set[str]:
    return {n for m in res.of_type("execution_cached") for n in m["nodes"]}


def _errors_by_input(body: dict, node: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in body["node_errors"][node]["errors"]:
        out.setdefault(e["extra_info"].get("input_name"), []).append(e["details"])
    return out


# ----- the shipped workflows and /object_info ------------------------------------------------------------


def _ui_to_api(workflow: dict, info: dict) -> dict:
    """What the frontend's "Export (API)" makes of a UI-format workflow: widget values by position
    (skipping the frontend-only control_after_generate / upload entries), links as [node id, slot]."""
    links = {lk[0]: lk for lk in workflow["links"]}
    out = {}
    for node in workflow["nodes"]:
        if node["type"] in VIRTUAL_NODES or node.get("mode", 0) in (2, 4):  # notes; muted / bypassed
            continue
        spec = info[node["type"]]
        values = iter(node.get("widgets_values", []))
        inputs: dict = {}
        for name, typ, opts, _ in _inputs(spec):
            if not _is_widget(typ, opts):
                continue
            inputs[name] = next(values)
            if opts.get("control_after_generate"):
                next(values)
            if opts.get("image_upload"):
                next(values)
        for inp in node.get("inputs", []):
            if inp.get("link") is not None:
                _, src, slot, *_ = links[inp["link"]]
                name = inp["widget"]["name"] if "widget" in inp else inp["name"]
                inputs[name] = [str(src), slot]
        out[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return out


@pytest.mark.parametrize("name", sorted(p.name[: -len(".api.json")] for p in (WORKFLOWS / "api").glob("*.api.json")))
def test_api_workflow_is_the_export_of_its_ui_twin_and_fits_object_info(klein, name):
    """Each shipped API file holds exactly what exporting its UI file gives (the same nodes, widget values
    and links), and fits the live node definitions: no unknown or missing inputs, values within the
    inputs' limits and lists, links between matching types. A script editing the API file and a user
    opening the UI file run the same graph."""
    info = klein.object_info()
    graph = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    exported = _ui_to_api(ui, info)
    assert {k: (v["class_type"], v["inputs"]) for k, v in graph.items()} == \
        {k: (v["class_type"], v["inputs"]) for k, v in exported.items()}
    problems = []
    for nid, node in graph.items():
        spec = info.get(node["class_type"])
        if spec is None:
            problems.append(f"{nid}: no node {node['class_type']}")
            continue
        specs = {n: (t, o, opt) for n, t, o, opt in _inputs(spec)}
        problems += [f"{nid}.{n}: not an input of {node['class_type']}" for n in node["inputs"] if n not in specs]
        problems += [f"{nid}.{n}: required input missing" for n, (_, _, opt) in specs.items()
                     if not opt and n not in node["inputs"]]
        for n, value in node["inputs"].items():
            if n not in specs:
                continue
            typ, opts, _ = specs[n]
            if isinstance(value, list):
                src = graph[value[0]]
                out_type = info[src["class_type"]]["output"][value[1]]
                if typ != "*" and out_type not in str(typ).split(","):
                    problems.append(f"{nid}.{n}: linked {out_type}, takes {typ}")
            elif (p := _value_problem(n, typ, opts, value)) and not (
                    node["class_type"] == "LoadImage"  # the user's own pictures
                    or "'klein_lora.safetensors' is not in the live list" in p):  # written by its first run
                problems.append(f"{nid}: {p}")
    assert not problems, "\n".join(problems)


def test_object_info_defaults_fit_their_own_inputs(klein):
    """Every default the pack declares is one the server accepts: numbers within min/max (and on the
    INT grid), combo defaults in their options; every input and output has a tooltip."""
    info = klein.object_info()
    pack = {k: v for k, v in info.items() if v["python_module"].startswith("custom_nodes.")}
    assert {"KleinModelLoader", "KleinTextEncode", "KleinSampler", "KleinLoraTrainer"} <= set(pack), sorted(pack)
    problems = []
    for name, spec in pack.items():
        for group in ("required", "optional"):
            for inp in spec["input_order"].get(group, []):
                typ, opts = spec["input"][group][inp][0], spec["input"][group][inp][1]
                where = f"{name}.{inp}"
                if not opts.get("tooltip"):
                    problems.append(f"{where}: no tooltip")
                if "default" not in opts:
                    continue
                d = opts["default"]
                if typ == "COMBO" and d not in opts.get("options", []):
                    problems.append(f"{where}: default {d!r} not in {opts.get('options')}")
                if typ in ("INT", "FLOAT"):
                    if ("min" in opts and d < opts["min"]) or ("max" in opts and d > opts["max"]):
                        problems.append(f"{where}: default {d} outside [{opts.get('min')}, {opts.get('max')}]")
                    if typ == "INT" and d != int(d):
                        problems.append(f"{where}: INT default {d}")
        if len(spec.get("output_tooltips") or []) != len(spec["output"]) or not all(spec["output_tooltips"]):
            problems.append(f"{name}: output tooltips {spec.get('output_tooltips')}")
    assert not problems, "\n".join(problems)


# ----- validation when queued ----------------------------------------------------------------------------


def test_guidance_linked_from_a_node_is_accepted(klein):
    """Was a bug: KleinSampler.validate_inputs(guidance) returns an error for a linked guidance. ComfyUI calls it
    while queueing with guidance=None when the input is a link (the value is not known yet), and the
    check `isinstance(guidance, (int, float))` refuses None. So guidance converted to an input and fed
    by any FLOAT node (core PrimitiveFloat here) makes POST /prompt answer 400: node_errors["3"] under
    "guidance": "Klein Sampler: guidance must be a finite number from 0 to 20, got None.". The same
    graph with the literal value runs. (nodes/sampler.py, KleinSampler.validate_inputs: return True for
    None and check the value in execute, as linked widgets get no host range check either.)"""
    graph = _t2i(next(_seeds))
    sampler = node_id(graph, "KleinSampler")
    graph["40"] = {"class_type": "PrimitiveFloat", "inputs": {"value": 1.0}}
    graph[sampler]["inputs"]["guidance"] = ["40", 0]
    status, body = klein.post_prompt(graph)
    assert status == 200, json.dumps(body)[:800]
    deadline = time.monotonic() + 60
    while not (hist := klein.history(body["prompt_id"])).get("status", {}).get("completed"):
        assert time.monotonic() < deadline, "prompt did not finish"
        time.sleep(0.2)
    assert hist["status"]["status_str"] == "success", hist["status"]
    graph["40"]["inputs"]["value"] = 25.0  # a linked value out of range: refused when the node runs
    res = klein.run_prompt(graph, timeout=60)
    err = res.error
    assert err is not None and err["node_id"] == sampler, res.describe()
    assert "guidance must be a finite number from 0 to 20, got 25.0" in err["exception_message"], err


def _trainer_graph() -> dict:
    graph = json.loads((WORKFLOWS / "api" / "klein_train_then_generate.api.json").read_text())
    trainer = node_id(graph, "KleinLoraTrainer")
    keep = {trainer, *(k for k, n in graph.items() if n["class_type"] == "PreviewAny")}
    return {k: n for k, n in graph.items() if k in keep}


@pytest.mark.parametrize("case", ["encoder lora_name", "encoder text_encoder", "trainer model_name",
                                  "trainer vae_name"])
def test_a_bad_file_name_is_reported_under_its_own_input_only(klein, case):
    """Was a bug: a wrong file name in Qwen3 Layer-Concat Encoder or Klein LoRA Trainer was reported under
    every input their validate_inputs named, not under the wrong one. ComfyUI 0.3.75 attaches a failed
    validate_inputs to each argument of its signature; KleinTextEncode.validate_inputs(text_encoder,
    lora_name) and KleinLoraTrainer.validate_inputs(model_name, vae_name, text_encoder) checked several
    files in one call. Seen: lora_name 'nope.safetensors' gave 400 with two errors, input_name
    "text_encoder" ("text_encoder - lora_name 'nope.safetensors' is not available ...") and "lora_name";
    a wrong trainer model_name was also listed under vae_name and text_encoder. Now each node validates
    its model file alone (refused when queued, under it); the others are named when the node runs on
    0.3.75 (current ComfyUI checks every list input when queued, under its own name)."""
    if case.startswith("encoder"):
        graph = _t2i(next(_seeds))
        node = node_id(graph, "KleinTextEncode")
    else:
        graph = _trainer_graph()
        node = node_id(graph, "KleinLoraTrainer")
    bad = case.split()[1]
    graph[node]["inputs"][bad] = "nope.safetensors"
    if bad in ("lora_name", "vae_name"):  # not validated when queued: named when the node runs
        res = klein.run_prompt(graph, timeout=60)
        err = res.error
        assert err is not None and err["node_id"] == node, res.describe()
        assert f"{bad} 'nope.safetensors'" in err["exception_message"], err["exception_message"]
        return
    status, body = klein.post_prompt(graph)
    assert status == 400, body
    errors = _errors_by_input(body, node)
    assert bad in errors and "'nope.safetensors' is not available" in errors[bad][0], errors
    assert list(errors) == [bad], f"the error is also listed under {sorted(set(errors) - {bad})}: {errors}"


def test_out_of_range_and_wrong_type_values_are_a_400_naming_the_input(klein):
    """Values outside a widget's limits or of the wrong type are refused when queued (HTTP 400), each under
    its input's name, before any model loads; NaN guidance is refused too (ComfyUI's own min/max
    check lets NaN through)."""
    cases = [("KleinSampler", "batch_size", 0, "value_smaller_than_min"),
             ("KleinSampler", "seed", -1, "value_smaller_than_min"),
             ("KleinSampler", "steps", 1001, "value_bigger_than_max"),
             ("KleinSampler", "width", "abc", "invalid_input_type"),
             ("KleinSampler", "denoise", 0.0, "value_smaller_than_min"),
             ("KleinSampler", "guidance", float("nan"), "custom_validation_failed"),
             ("KleinSampler", "guidance", 20.5, "custom_validation_failed"),
             ("KleinTextEncode", "lora_strength", 11.0, "value_bigger_than_max"),
             ("KleinModelLoader", "model_name", "missing.safetensors", "custom_validation_failed")]
    for class_type, inp, value, kind in cases:
        graph = _t2i(next(_seeds))
        node = node_id(graph, class_type)
        graph[node]["inputs"][inp] = value
        status, body = klein.post_prompt(graph)
        assert status == 400, (inp, value, body)
        [err] = body["node_errors"][node]["errors"]
        assert (err["type"], err["extra_info"]["input_name"]) == (kind, inp), (inp, value, err)
    graph = _t2i(next(_seeds))
    del graph[node_id(graph, "KleinTextEncode")]["inputs"]["prompt"]
    status, body = klein.post_prompt(graph)
    assert status == 400
    [err] = body["node_errors"][node_id(graph, "KleinTextEncode")]["errors"]
    assert (err["type"], err["extra_info"]["input_name"]) == ("required_input_missing", "prompt")


def test_optional_inputs_left_out_run_as_their_defaults(klein):
    """A script that sends only the required inputs gets what the UI's defaults give: every optional
    widget left out of the API graph (speed, precision, max_tokens, lora, denoise, reference_mode...)
    takes the default /object_info declares, the same image bit for bit."""
    info = klein.object_info()
    seed = next(_seeds)
    full, _ = _image(klein, _t2i(seed))
    _image(klein, _t2i(next(_seeds)))  # the sampler runs anew below, not from ComfyUI's cache
    graph = _t2i(seed)
    dropped = []
    for node in graph.values():
        spec = info[node["class_type"]]
        for inp in spec["input_order"].get("optional", []):
            if inp in node["inputs"] and not isinstance(node["inputs"][inp], list):
                opts = spec["input"]["optional"][inp][1]
                assert node["inputs"].pop(inp) == opts.get("default"), (node["class_type"], inp)
                dropped.append(inp)
    assert {"speed", "precision", "max_tokens", "lora_name", "denoise", "reference_mode"} <= set(dropped)
    short, res = _image(klein, graph)
    assert node_id(graph, "KleinSampler") not in _cached(res)
    assert np.array_equal(full, short)


# ----- errors while running, and the next run ------------------------------------------------------------


def test_failed_runs_name_node_and_fix_and_leave_the_next_run_identical(klein):
    """Values the 0.3.75 host does not check when queued (V3 combos) and a mismatched encoder fail when
    run, each execution_error naming the node, the input and the choices or the fix; the server then
    gives the same seed the same pixels as before the failures."""
    seed = next(_seeds)
    before, _ = _image(klein, _t2i(seed))
    bad_runs = [
        ("KleinSampler", "reference_mode", "bogus", ["Klein Sampler: reference_mode 'bogus' is not one of auto"]),
        ("KleinTextEncode", "max_tokens", "999", ["Qwen3 Layer-Concat Encoder: max_tokens '999' is not one of 512"]),
        ("KleinModelLoader", "memory_mode", "huge", ["Klein Model Loader: memory_mode 'huge' is not one of auto"]),
        ("KleinModelLoader", "vae_name", "gone.safetensors",
         ["Klein Model Loader: vae_name 'gone.safetensors' was not found in models/vae"]),
        ("KleinModelLoader", "model_name", "flux-2-klein-9b.safetensors",
         ["Klein Sampler", "flux-2-klein-9b.safetensors",
          ("set text_encoder in Qwen3 Layer-Concat Encoder to qwen_3_8b")]),
    ]
    for class_type, inp, value, parts in bad_runs:
        graph = _t2i(seed)
        graph[node_id(graph, class_type)]["inputs"][inp] = value
        res = klein.run_prompt(graph, timeout=60)
        err = res.error
        assert err is not None and res.status_str == "error", res.describe()
        assert all(p in err["exception_message"] for p in parts), err["exception_message"]
        assert not res.images
    _image(klein, _t2i(next(_seeds)))
    after, res = _image(klein, _t2i(seed))
    assert node_id(_t2i(seed), "KleinSampler") not in _cached(res)
    assert np.array_equal(before, after)


@pytest.mark.parametrize("name", ["klein_4b_text_to_image", "klein_core_sampler"])
def test_interrupted_run_then_rerun_matches_an_uninterrupted_run(klein, name):
    """POST /interrupt during sampling (the Klein Sampler, and ComfyUI's SamplerCustomAdvanced over Klein
    Model to MODEL) stops the run without an image or error; queueing the same graph again gives the
    pixels an uninterrupted run of it gave."""
    def graph_for(seed: int) -> dict:
        if name == "klein_4b_text_to_image":
            return _t2i(seed, width=96, height=96, steps=5)
        g = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
        g[node_id(g, "Flux2Scheduler")]["inputs"].update(steps=5, width=96, height=64)
        g[node_id(g, "EmptyFlux2LatentImage")]["inputs"].update(width=96, height=64)
        g[node_id(g, "RandomNoise")]["inputs"]["noise_seed"] = seed
        return g

    seed = next(_seeds)
    graph = graph_for(seed)
    sampler = next(k for k, n in graph.items() if n["class_type"] in ("KleinSampler", "SamplerCustomAdvanced"))
    whole, _ = _image(klein, graph)
    _image(klein, graph_for(next(_seeds)))  # so the interrupted run is not served from the cache
    sent = []

    def on_message(kind, data):
        if kind == "progress" and data["node"] == sampler and data["value"] >= 2 and not sent:
            sent.append(klein.interrupt())

    res = klein.run_prompt(graph, timeout=60, on_message=on_message)
    assert sent == [200] and res.interrupted and not res.error and not res.images, res.describe()
    assert max(p["value"] for p in res.progress if p["node"] == sampler) < 5
    again, res = _image(klein, graph)
    assert sampler not in _cached(res)
    assert np.array_equal(whole, again)


# ----- cache and saved metadata ----------------------------------------------------------------------


def test_png_metadata_recreates_the_image_and_a_repeat_is_served_from_cache(klein):
    """SaveImage's PNG carries the queued API graph (text chunk "prompt", plus the "is_changed" values
    ComfyUI stores on nodes with fingerprint_inputs) and the UI workflow given in extra_pnginfo
    ("workflow"); the same graph queued again is served whole from ComfyUI's cache (the same file); the
    graph read back from the PNG, queued as is after another seed, re-creates the pixels."""
    seed = next(_seeds)
    graph = _t2i(seed)
    ui = json.loads((WORKFLOWS / "klein_4b_text_to_image.json").read_text())
    first, res = _image(klein, graph, extra_data={"extra_pnginfo": {"workflow": ui}})
    (ref,) = res.images
    png = Image.open(io.BytesIO(klein.view(ref["filename"], ref.get("subfolder", ""), ref.get("type", "output"))))
    saved = json.loads(png.text["prompt"])  # the host adds each fingerprinted node's "is_changed"
    assert {k: {f: v for f, v in n.items() if f != "is_changed"} for k, n in saved.items()} == graph
    assert json.loads(png.text["workflow"]) == ui
    repeat = klein.run_prompt(copy.deepcopy(graph), timeout=60)
    assert repeat.ok and _cached(repeat) == set(graph), repeat.describe()
    assert repeat.images == [ref]
    _image(klein, _t2i(next(_seeds)))
    again, res = _image(klein, saved)
    assert node_id(graph, "KleinSampler") not in _cached(res)
    assert np.array_equal(first, again)


# ----- image to image --------------------------------------------------------------------------------


def test_img2img_denoise_that_skips_no_step_is_said_and_the_tooltip_tells_the_rule(klein):
    """Was a bug (silent): Klein Sampler's denoise 0.8 on the distilled model's 4 steps threw the input
    latent away while the tooltip said "0.5-0.8 = keep the composition (image-to-image)":
    steps_to_run (klein_core/pipeline/inpaint.py) follows diffusers' rule, int(4 x 0.2) = 0 steps
    skipped, so sampling started at sigma 1.0, pure noise. Seen over HTTP: the img2img workflow with
    latent_as_reference off, denoise 0.8 and 1.0 (same seed) give the same pixels. The rule stays
    (parity with diffusers); the run now says so in the node's warnings (naming 0.75), the tooltip
    states the rule, and 0.75 does start from the picture."""
    rgb = np.random.default_rng(11).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(klein.input_dir / "klein_hunt_img2img.png")
    seed = next(_seeds)

    def run(denoise: float) -> tuple[np.ndarray, list[str]]:
        graph = api("klein_4b_img2img", steps=4, seed=seed, denoise=denoise, latent_as_reference=False)
        graph[node_id(graph, "LoadImage")]["inputs"]["image"] = "klein_hunt_img2img.png"
        pixels, res = _image(klein, graph)
        return pixels, res.outputs.get(node_id(graph, "KleinSampler"), {}).get("warnings", [])

    (full, _), (at_08, said_08), (at_075, said_075) = run(1.0), run(0.8), run(0.75)
    assert np.array_equal(full, at_08)  # diffusers' rule: nothing skipped
    assert any("skips no step" in w and "Use 0.75 or less" in w for w in said_08), said_08
    assert not any("skips no step" in w for w in said_075), said_075
    assert not np.array_equal(full, at_075), "denoise 0.75 (one step skipped) gave the denoise 1.0 image"
    tooltip = klein.object_info()["KleinSampler"]["input"]["optional"]["denoise"][1]["tooltip"]
    assert "above 0.75 runs all 4 from noise" in tooltip, tooltip


# ----- training from the shipped workflow ----------------------------------------------------------------


def test_train_workflow_dataset_is_found_in_comfyui_input_folder(klein):
    """Was a bug: the shipped klein_train_then_generate workflow's dataset "input/klein_lora_dataset" (its note:
    "here ComfyUI/input/klein_lora_dataset") is read relative to the server process's working
    directory, not ComfyUI's input folder (folder_paths.get_input_directory()). With the images put in
    the input folder, a server whose working directory is not the ComfyUI folder that holds it
    (the portable build runs `python ComfyUI\\main.py` from its parent, the desktop app and
    --input-directory / --base-directory keep input elsewhere; here --input-directory) fails:
    execution_error "Klein LoRA Trainer: dataset not found: input/klein_lora_dataset". The absolute path
    of the same folder trains. (nodes/train.py execute / dataset_fingerprint: resolve a relative dataset
    against the input directory, accepting a leading "input/", before the working directory.)"""
    folder = klein.input_dir / "klein_lora_dataset"
    folder.mkdir(exist_ok=True)
    for i in range(2):
        img = np.random.default_rng(20 + i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(img).save(folder / f"hunt_{i}.png")
        (folder / f"hunt_{i}.txt").write_text(f"a hunt test picture {i}")
    graph = _trainer_graph()
    trainer = node_id(graph, "KleinLoraTrainer")
    assert graph[trainer]["inputs"]["dataset"] == "input/klein_lora_dataset"
    lora = f"hunt_{time.time_ns()}"
    graph[trainer]["inputs"].update(steps=1, resolution=64, rank=2, sample_prompts="", checkpoint_every=0,
                                    lora_name=lora)
    written = []
    try:
        res = klein.run_prompt(graph, timeout=90)
        if res.ok:
            written.append(lora)
        absolute = copy.deepcopy(graph)
        absolute[trainer]["inputs"].update(dataset=str(folder), lora_name=lora + "_abs")
        res_abs = klein.run_prompt(absolute, timeout=90)
        if res_abs.ok:
            written.append(lora + "_abs")
        assert res_abs.ok, res_abs.describe()  # the folder itself is a good dataset
        assert res.ok, res.describe()
    finally:
        for root in (klein.work_dir, klein.models_dir):
            for name in written:
                for p in root.rglob(f"{name}*"):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_rejected_prompt_does_not_enter_queue_or_history(klein):
    """A 400 answer leaves nothing behind: the queue stays empty and no history entry appears, so a script
    may fix the value and queue again."""
    before = set(klein.get_json("/history?max_items=1000"))
    graph = _t2i(next(_seeds))
    graph[node_id(graph, "KleinSampler")]["inputs"]["batch_size"] = 0
    with pytest.raises(PromptRejected) as info:
        klein.run_prompt(graph, timeout=30)
    assert info.value.status == 400
    q = klein.queue()
    assert not q["queue_running"] and not q["queue_pending"]
    assert set(klein.get_json("/history?max_items=1000")) == before
