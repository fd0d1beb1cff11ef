"""Smoke tests of the e2e harness: a real ComfyUI 0.3.75 server with the pack whitelisted.

Core nodes only (no models needed); the pack's own nodes get their own e2e files.
"""

from __future__ import annotations

import io
import itertools
import re

import pytest
from comfy_host import PACK_NAME, REPO_ROOT, empty_image_graph, traceback_blocks

pytestmark = pytest.mark.e2e

_colors = itertools.count(0x102030, 0x010101)  # a new color per run defeats ComfyUI's output cache


def _fresh_graph(**kw) -> dict:
    return empty_image_graph(color=next(_colors), **kw)


def _mentions_pack(text: str) -> bool:
    # The host lives under the repo (.comfy_host/), so its own paths must not count as the pack's.
    repo = re.escape(str(REPO_ROOT))
    return bool(re.search(rf"{PACK_NAME}|klein_core|{repo}(?!/\.comfy_host)", text))


def _assert_png(raw: bytes, width: int, height: int):
    from PIL import Image

    assert raw[:8] == b"\x89PNG\r\n\x1a\n", raw[:16]
    img = Image.open(io.BytesIO(raw))
    img.load()
    assert img.format == "PNG"
    assert img.size == (width, height)
    return img


def test_server_starts_and_lists_core_nodes(comfy_server):
    stats = comfy_server.system_stats()
    assert stats["system"]["comfyui_version"] == "0.3.75"
    assert "--cpu" in stats["system"]["argv"]
    assert stats["devices"][0]["type"] == "cpu"
    info = comfy_server.object_info()
    for name in ("KSampler", "EmptyImage", "SaveImage", "EmptyFlux2LatentImage", "Flux2Scheduler",
                 "ReferenceLatent", "CFGGuider", "SamplerCustomAdvanced", "UNETLoader", "VAELoader"):
        assert name in info, name
    assert info["KSampler"]["python_module"] == "nodes"
    # Only the whitelisted pack may contribute custom nodes.
    foreign = {n: v["python_module"] for n, v in info.items()
               if v["python_module"].startswith("custom_nodes.")
               and v["python_module"] != f"custom_nodes.{PACK_NAME}"}
    assert not foreign
    # The models folders point at the caller's models dir (empty here).
    assert comfy_server.models("diffusion_models") is not None
    assert comfy_server.object_info("UNETLoader")["UNETLoader"]["input"]["required"]["unet_name"][0] == []


def test_pack_imported_without_error(comfy_server):
    log = comfy_server.log_text()
    pack_path = str(comfy_server.work_dir / "pack_nodes" / PACK_NAME)
    import_lines = [ln for ln in log.splitlines() if re.match(r"\s*\d+\.\d+ seconds", ln) and pack_path in ln]
    assert import_lines, "no import-time line for the pack:\n" + comfy_server.log_tail()
    assert all("IMPORT FAILED" not in ln for ln in import_lines), import_lines
    suspicious = re.compile(r"import failed|cannot import|error|warning|skip|did not return|not callable"
                            r"|unable to parse", re.IGNORECASE)
    bad_lines = [ln for ln in log.splitlines()
                 if not ln.startswith("$ ") and _mentions_pack(ln) and suspicious.search(ln)]
    assert not bad_lines, "\n".join(bad_lines)
    bad_tracebacks = [t for t in ("\n".join(b) for b in traceback_blocks(log)) if _mentions_pack(t)]
    assert not bad_tracebacks, "\n\n".join(bad_tracebacks)
    # The pack's nodes (none registered yet is fine) must all come from the pack module.
    info = comfy_server.object_info()
    for name, v in info.items():
        if v["python_module"] == f"custom_nodes.{PACK_NAME}":
            assert name.startswith("Klein"), f"pack node id {name!r} lacks the Klein prefix"


def test_core_graph_runs_and_image_is_served(comfy_server):
    res = comfy_server.run_prompt(_fresh_graph(width=64, height=64, prefix="e2e_smoke"), timeout=30)
    assert res.ok, res.describe()
    assert "execution_start" in res.types and "execution_success" in res.types
    executed = res.of_type("executed")
    assert [e["node"] for e in executed] == ["2"]
    assert len(res.images) == 1
    img_ref = res.images[0]
    assert img_ref["type"] == "output"
    assert executed[0]["output"]["images"] == [img_ref]
    raw = comfy_server.view(**img_ref)
    img = _assert_png(raw, 64, 64)
    assert "prompt" in img.info  # saved PNGs embed the API graph
    assert (comfy_server.output_dir / img_ref["subfolder"] / img_ref["filename"]).is_file()


def test_bad_graph_is_rejected_and_server_stays_usable(comfy_server):
    bad = _fresh_graph()
    bad["1"]["inputs"]["width"] = -5
    status, body = comfy_server.post_prompt(bad)
    assert status == 400, body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    err = body["node_errors"]["1"]
    assert err["class_type"] == "EmptyImage"
    assert any(e["type"] == "value_smaller_than_min" and e["extra_info"]["input_name"] == "width"
               for e in err["errors"]), err
    res = comfy_server.run_prompt(_fresh_graph(width=32, height=16), timeout=30)
    assert res.ok, res.describe()
    _assert_png(comfy_server.view(**res.images[0]), 32, 16)


def test_interrupt_while_idle_leaves_server_usable(comfy_server):
    assert comfy_server.interrupt() == 200
    assert comfy_server.free(unload_models=True, free_memory=True) == 200
    res = comfy_server.run_prompt(_fresh_graph(), timeout=30)
    assert res.ok, res.describe()
    assert not res.interrupted


def test_interrupt_during_run(comfy_server):
    # EmptyImage -> 6 x ImageBlur (~60 ms each here) -> SaveImage; interrupt as soon as the first blur
    # starts. ComfyUI checks the flag before each node, so the run stops at a later blur with
    # execution_interrupted (the POST needs only a few ms, so there is ample margin).
    graph = _fresh_graph(width=512, height=512)
    src = ["1", 0]
    for i in range(6):
        nid = f"b{i}"
        graph[nid] = {"class_type": "ImageBlur", "inputs": {"image": src, "blur_radius": 15, "sigma": 3.0}}
        src = [nid, 0]
    graph["2"]["inputs"]["images"] = src
    sent = []

    def on_message(kind, data):
        if kind == "executing" and isinstance(data, dict) and data.get("node") == "b0" and not sent:
            sent.append(comfy_server.interrupt(data.get("prompt_id")))

    res = comfy_server.run_prompt(graph, timeout=60, on_message=on_message)
    assert sent == [200]
    assert res.interrupted, res.describe()
    assert res.status_str == "error"
    assert not res.images
    assert not res.of_type("execution_error")
    res2 = comfy_server.run_prompt(_fresh_graph(), timeout=30)
    assert res2.ok, res2.describe()
