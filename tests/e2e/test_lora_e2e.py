"""The Klein LoRA Loader inside the real ComfyUI server, with a tiny LoRA file in models/loras."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from safetensors.torch import save_file
from test_nodes_e2e import WORKFLOWS, klein  # noqa: F401  (klein is a fixture)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lora_server(klein, e2e_models_dir):  # noqa: F811
    torch.manual_seed(3)
    sd = {}
    for name, (out_f, in_f) in {"double_blocks.0.img_attn.proj": (64, 64),
                                "single_blocks.0.linear1": (576, 64)}.items():
        sd[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(4, in_f) * 0.5
        sd[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(out_f, 4) * 0.5
    save_file(sd, e2e_models_dir / "loras" / "tiny_klein_style.safetensors")
    deadline = time.monotonic() + 10
    while "tiny_klein_style.safetensors" not in klein.models("loras"):
        assert time.monotonic() < deadline, "the server does not list the LoRA"
        time.sleep(0.2)
    return klein


def _graph(strength: float | None, seed: int) -> dict:
    g = json.loads((WORKFLOWS / "api" / "klein_4b_text_to_image.api.json").read_text())
    g["1"]["inputs"]["weight_dtype"] = "fp32"
    g["3"]["inputs"].update(width=80, height=64, steps=2, seed=seed)
    if strength is not None:
        g["10"] = {"class_type": "KleinLoraLoader", "inputs": {
            "model": ["1", 0], "lora_name": "tiny_klein_style.safetensors", "strength": strength}}
        g["3"]["inputs"]["model"] = ["10", 0]
    return g


def _pixels(srv, graph) -> str:
    res = srv.run_prompt(graph, timeout=120)
    assert res.ok, res.describe()
    (img,) = res.images
    raw = srv.view(**img)
    return hashlib.sha256(raw[raw.index(b"IDAT"):]).hexdigest()


def test_lora_node_changes_the_image_and_strength_zero_does_not(lora_server):
    srv = lora_server
    assert "KleinLoraLoader" in srv.object_info()
    plain = _pixels(srv, _graph(None, 21))
    styled = _pixels(srv, _graph(1.0, 21))
    zero = _pixels(srv, _graph(0.0, 21))
    assert styled != plain
    assert zero == plain
    # the LoRA never changed the cached base model: the plain graph still gives the plain image
    assert _pixels(srv, _graph(None, 21)) == plain


def test_lora_for_another_size_is_a_clear_error(lora_server, e2e_models_dir):
    srv = lora_server
    save_file({"diffusion_model.double_blocks.0.img_attn.proj.lora_A.weight": torch.zeros(4, 96),
               "diffusion_model.double_blocks.0.img_attn.proj.lora_B.weight": torch.zeros(96, 4)},
              e2e_models_dir / "loras" / "wrong_size.safetensors")
    deadline = time.monotonic() + 10
    while "wrong_size.safetensors" not in srv.models("loras"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    g = _graph(1.0, 22)
    g["10"]["inputs"]["lora_name"] = "wrong_size.safetensors"
    res = srv.run_prompt(g, timeout=120)
    assert not res.ok
    msg = res.error["exception_message"]
    assert "wrong_size.safetensors" in msg and "hidden 96" in msg and "hidden 64" in msg, msg
    assert _pixels(srv, _graph(None, 23))  # the server stays usable
