"""Trained LoRAs in ComfyUI names through ComfyUI 0.3.75's own LoRA code, on ComfyUI's own FLUX.2
module built with Klein's sizes (benchmarks/comfy_peer.py) and on the Klein encoder under ComfyUI's
``qwen3_4b.transformer.model`` path; and ComfyUI's LoRA loader on the bridged MODEL (Klein Model to
MODEL) against Klein LoRA Loader on the Klein Sampler."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from script_module import load_script

from klein_core.testing import tiny_text_encoder
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.save import save_lora

REPO = Path(__file__).resolve().parents[1]


def _random_up(*loras: LoRASet, seed: int = 4) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in loras:
            for layer in lora.layers.values():
                layer.up.copy_(torch.randn(layer.up.shape, generator=g))


def test_lora_in_comfyui_names_loads_in_comfyuis_own_lora_code(comfy_pack, tmp_path, caplog, parity):
    """Every key of a LoRA saved with ``fmt="comfyui"`` (transformer and text-encoder parts) is used by
    ComfyUI's key maps and ``load_lora``, and ``calculate_weight`` (as ModelPatcher calls it, strength
    1) gives each weight plus the trained delta (a fused qkv's q/k/v pairs as one block-diagonal pair)."""
    import comfy.lora

    peer = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    host = peer.import_comfy(Path(comfy_pack.folder_paths.__file__).parent, cpu=True)  # the loaded ComfyUI
    tr = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
    comfy_model = peer.build_comfy_flux2(tr, host=host)
    lora = LoRASet(tr, preset("full", rank=2, alpha=3.0), seed=1)
    te = tiny_text_encoder()
    text_lora = LoRASet(te, text_encoder_preset(rank=2), seed=2)
    _random_up(lora, text_lora)
    sd = load_file(str(save_lora(tmp_path / "c.safetensors", lora, fmt="comfyui", text_lora=text_lora)))

    unet = torch.nn.Module()
    unet.diffusion_model = comfy_model
    unet.model_config = SimpleNamespace(unet_config={})
    clip = torch.nn.Module()  # ComfyUI's Klein encoder: <name>.transformer.model.layers... (SD1ClipModel)
    clip.qwen3_4b = torch.nn.Module()
    clip.qwen3_4b.transformer = torch.nn.Module()
    clip.qwen3_4b.transformer.model = te
    key_map = comfy.lora.model_lora_keys_unet(unet, {})
    key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(sd, key_map)
    assert "not loaded" not in caplog.text, caplog.text
    want = {f"diffusion_model.{n}.weight": (comfy_model.get_submodule(n).weight, lora.layer(n).delta())
            for n in lora.names()}
    want.update({f"qwen3_4b.transformer.model.{n}.weight": (te.get_submodule(n).weight, text_lora.layer(n).delta())
                 for n in text_lora.names()})
    assert set(patches) == set(want)
    worst = 0.0
    for key, (weight, delta) in want.items():
        merged = comfy.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)], weight.detach().clone().float(),
                                             key)
        worst = max(worst, (merged - (weight.float() + delta)).abs().max().item())
    parity("trained LoRA (comfyui names) through ComfyUI's load_lora + calculate_weight vs the trained delta",
           worst)
    assert worst <= 1e-5
