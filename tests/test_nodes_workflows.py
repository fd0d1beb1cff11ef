"""The example workflows: committed files equal the generator's output, and each UI file agrees with
itself and with its API twin. (Validation against a live server's /object_info is in tests/e2e.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script

REPO = Path(__file__).resolve().parents[1]
NAMES = ("klein_4b_text_to_image", "klein_4b_base_cfg", "klein_4b_two_reference_edit", "klein_4b_img2img",
         "klein_4b_inpaint", "klein_4b_outpaint", "klein_9b_kv_edit", "klein_core_reference_chain",
         "klein_train_then_generate", "klein_core_sampler", "klein_base_dpmpp_2m_easycache")


@pytest.fixture(scope="module")
def make():
    return load_script("klein_make_workflows", REPO / "example_workflows" / "make_workflows.py")


def _ui(name: str) -> dict:
    return json.loads((REPO / "example_workflows" / f"{name}.json").read_text())


def _api(name: str) -> dict:
    return json.loads((REPO / "example_workflows" / "api" / f"{name}.api.json").read_text())


def test_committed_files_are_the_generated_ones(make):
    assert make.main(["--check"]) == 0, "run: python example_workflows/make_workflows.py"
    listed = sorted(p.name for p in (REPO / "example_workflows").glob("*.json"))
    assert listed == sorted(f"{n}.json" for n in NAMES)
    assert sorted(p.name for p in (REPO / "example_workflows" / "api").glob("*.json")) == \
        sorted(f"{n}.api.json" for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_ui_links_are_consistent(name):
    wf = _ui(name)
    assert wf["version"] == 0.4
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert wf["last_node_id"] == max(nodes) and wf["last_link_id"] == max(lk[0] for lk in wf["links"])
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        out, inp = nodes[src]["outputs"][src_slot], nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"] and inp["link"] == link_id
        # "*": an input taking any type (PreviewAny); "A,B": a socket taking either (the pack's vae sockets)
        assert out["type"] == typ and (inp["type"] == "*" or typ in inp["type"].split(","))
        assert nodes[src]["order"] < nodes[dst]["order"]
    linked = {lk[0] for lk in wf["links"]}
    assert {i["link"] for n in wf["nodes"] for i in n["inputs"]} - {None} == linked
    assert {x for n in wf["nodes"] for o in n["outputs"] for x in o["links"]} == linked
    assert sorted(n["order"] for n in wf["nodes"]) == list(range(len(nodes)))


@pytest.mark.parametrize("name", NAMES)
def test_api_twin_matches_the_ui_file(make, name):
    ui, api = _ui(name), _api(name)
    real = {str(n["id"]): n for n in ui["nodes"] if not make.SPECS[n["type"]].virtual}
    assert set(api) == set(real)
    for nid, node in real.items():
        spec = make.SPECS[node["type"]]
        assert api[nid]["class_type"] == node["type"]
        values = list(node["widgets_values"])
        for widget, _ in spec.frontend_extra:  # drop the frontend-only entries
            values.pop(spec.widgets.index(widget) + 1)
        widgets = {w: api[nid]["inputs"][w] for w in spec.widgets}
        assert widgets == dict(zip(spec.widgets, values, strict=True))
        for inp in node["inputs"]:
            if inp["link"] is not None:
                _, src, slot, _, _, _ = next(lk for lk in ui["links"] if lk[0] == inp["link"])
                assert api[nid]["inputs"][inp["name"]] == [str(src), slot]
            else:
                assert inp["name"] not in api[nid]["inputs"]


def test_workflows_use_the_public_file_names_and_settings():
    t2i, base, edit, img2img, inpaint, outpaint, kv = (_api(n) for n in NAMES[:7])

    def only(graph, cls):
        (node,) = [n for n in graph.values() if n["class_type"] == cls]
        return node["inputs"]

    assert only(t2i, "KleinModelLoader")["model_name"] == "flux-2-klein-4b.safetensors"
    assert only(base, "KleinModelLoader")["model_name"] == "flux-2-klein-base-4b.safetensors"
    for graph in (t2i, base, edit, img2img, inpaint, outpaint, kv):
        assert only(graph, "KleinModelLoader")["vae_name"] == "flux2-vae.safetensors"
        assert only(graph, "KleinTextEncode")["text_encoder"] == (
            "qwen_3_8b_fp8mixed.safetensors" if graph is kv else "qwen_3_4b.safetensors")
        assert "SaveImage" in {n["class_type"] for n in graph.values()}
    assert (only(t2i, "KleinSampler")["steps"], only(t2i, "KleinSampler")["guidance"]) == (4, 1.0)
    assert (only(base, "KleinSampler")["steps"], only(base, "KleinSampler")["guidance"]) == (50, 4.0)
    assert only(base, "KleinTextEncode")["negative_prompt"]
    sampler = only(edit, "KleinSampler")
    assert (sampler["width"], sampler["height"]) == (0, 0)
    assert sorted(n["inputs"]["image"] for n in edit.values() if n["class_type"] == "LoadImage") == \
        ["klein_reference_1.png", "klein_reference_2.png"]
    stackers = [n["inputs"] for n in edit.values() if n["class_type"] == "KleinReferenceStacker"]
    assert len(stackers) == 2 and sum("references" in s for s in stackers) == 1
    # image to image: a latent at denoise 0.6; inpaint / outpaint: crop, mask into the sampler, stitch back
    assert only(img2img, "KleinSampler")["denoise"] == 0.6 and "latent" in only(img2img, "KleinSampler")
    for graph in (inpaint, outpaint):
        sampler = only(graph, "KleinSampler")
        crop_id = next(k for k, n in graph.items() if n["class_type"] == "KleinInpaintCrop")
        assert sampler["mask"] == [crop_id, 1] and sampler["denoise"] == 1.0
        assert only(graph, "KleinInpaintStitch")["stitch"] == [crop_id, 2]
        save = only(graph, "SaveImage")["images"][0]
        assert graph[save]["class_type"] == "KleinInpaintStitch"
    assert only(outpaint, "ImagePadForOutpaint")["right"] > 0
    # KV: BFL's public 9B-KV file; model_kind auto reads "kv" from its name
    assert only(kv, "KleinModelLoader")["model_name"] == "flux-2-klein-9b-kv-fp8.safetensors"
    assert only(kv, "KleinModelLoader")["model_kind"] == "auto" and only(kv, "KleinSampler")["reference_mode"] == "auto"


@pytest.mark.parametrize("name", NAMES)
def test_layout_leaves_room_for_previews_and_the_view_shows_everything(make, name):
    wf = next(w for w in make.WORKFLOWS if w.name == name)
    boxes = {}
    for n in wf.nodes:  # what each node covers once its preview or picture has grown it
        w, h = make.SPECS[n.type].size
        boxes[n.id] = (n.pos[0], n.pos[1] - make.NODE_TITLE_HEIGHT, n.pos[0] + w,
                       n.pos[1] + max(h, make.GROWS.get(n.type, 0)))
    for a in boxes:
        for b in boxes:
            if a < b:
                (l1, t1, r1, b1), (l2, t2, r2, b2) = boxes[a], boxes[b]
                assert r1 <= l2 or r2 <= l1 or b1 <= t2 or b2 <= t1, f"nodes {a} and {b} overlap in {name}"
    ds = _ui(name)["extra"]["ds"]
    for left, top, right, bottom in boxes.values():  # every corner on screen, below the tab bar
        for x, y in ((left, top), (right, bottom)):
            sx, sy = (x + ds["offset"][0]) * ds["scale"], (y + ds["offset"][1]) * ds["scale"]
            assert 0 <= sx <= make.VIEW[0] and make.TAB_BAR <= sy <= make.VIEW[1], (name, x, y, sx, sy)
    thumb = REPO / "example_workflows" / f"{name}.jpg"
    from PIL import Image

    assert Image.open(thumb).size == (512, 384)


def test_edit_workflow_shows_the_reference_sizes(make):
    api = _api("klein_4b_two_reference_edit")
    previews = [n for n in api.values() if n["class_type"] == "PreviewAny"]
    assert len(previews) == 1
    source = previews[0]["inputs"]["source"]
    assert api[source[0]]["class_type"] == "KleinReferenceStacker" and source[1] == 1  # its "sizes" output
