"""Regression tests for bugs found in the trainer's LoRA writer (klein_core/train/save.py).

Kohya names: a LoRA saved with ``fmt="kohya"`` used underscored diffusers paths
(``lora_unet_transformer_blocks_0_attn_to_q``), which neither diffusers' Flux2 Kohya reader nor
ComfyUI's LoRA key map knows: diffusers loaded no key of it and ComfyUI logged "lora key not loaded"
for every one. The references here are diffusers' and ComfyUI 0.3.75's own loaders.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from script_module import load_script
from tiny_reference import CTX, tiny_diffusers_transformer
from train_files import nonzero_lora

from klein_core.files.loaders import load_transformer
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.train.adapters import AdapterConfig, LoRASet, TargetGroup, preset
from klein_core.train.save import save_lora

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]


def _mixed_lora(model) -> LoRASet:
    """The "full" preset's four groups with distinct ranks and alphas (scales 0.5, 1, 5/3, 1), B random."""
    groups = preset("full").groups
    cfg = AdapterConfig(tuple(TargetGroup(g.name, g.pattern, r, a)
                              for g, r, a in zip(groups, (6, 4, 3, 2), (3.0, None, 5.0, None))))
    return nonzero_lora(model, cfg, up_seed=0, scale=0.3)


def test_kohya_file_loads_in_diffusers_with_the_trained_effect(tmp_path):
    """diffusers' Flux2 pipeline reads the Kohya file (its own Kohya converter + PEFT) and its
    transformer then computes what the LoRA hooks computed in training (mixed ranks and alphas)."""
    dm = tiny_diffusers_transformer(0)
    ours = load_transformer({k: v.contiguous() for k, v in dm.state_dict().items()})
    lora = _mixed_lora(ours)
    gi = torch.Generator().manual_seed(1)
    ids, tids = position_ids(3, 4), text_position_ids(5)
    img, txt, t = torch.randn(1, ids.shape[0], 8, generator=gi), torch.randn(1, 5, CTX, generator=gi), torch.tensor([0.7])
    with torch.no_grad():
        plain = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)
        lora.attach(ours)
        want = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)
    assert (want - plain).abs().max().item() > 0.1  # the LoRA changes the output visibly
    path = save_lora(tmp_path / "k.safetensors", lora, fmt="kohya")
    sd = diffusers.Flux2KleinPipeline.lora_state_dict(str(path))
    # every adapted diffusers module (2 double blocks x 12, 2 single x 2) gets its A and B
    assert len(sd) == 2 * (2 * 12 + 2 * 2), sorted(sd)[:6]
    dm.load_lora_adapter(sd, prefix="transformer", adapter_name="kohya")
    with torch.no_grad():
        got = dm(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                 return_dict=False)[0]
    assert (got - want).abs().max().item() <= 1e-4


def test_kohya_file_loads_in_comfyuis_own_lora_code(comfy_pack, tmp_path, caplog):
    """ComfyUI 0.3.75's key map + ``load_lora`` use every transformer key of the Kohya file, and
    ``calculate_weight`` gives each weight plus the trained delta (rank and alpha per module)."""
    import comfy.lora

    peer = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    host = peer.import_comfy(Path(comfy_pack.folder_paths.__file__).parent, cpu=True)
    tr = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
    comfy_model = peer.build_comfy_flux2(tr, host=host)
    lora = _mixed_lora(tr)
    sd = load_file(str(save_lora(tmp_path / "k.safetensors", lora, fmt="kohya")))
    unet = torch.nn.Module()
    unet.diffusion_model = comfy_model
    unet.model_config = SimpleNamespace(unet_config={})
    key_map = comfy.lora.model_lora_keys_unet(unet, {})
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(sd, key_map)
    assert "not loaded" not in caplog.text, caplog.text[:500]
    want = {f"diffusion_model.{n}.weight": (comfy_model.get_submodule(n).weight, lora.layer(n).delta())
            for n in lora.names()}
    assert set(patches) == set(want)
    for key, (weight, delta) in want.items():
        merged = comfy.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)], weight.detach().clone().float(),
                                             key)
        assert (merged - (weight.float() + delta)).abs().max().item() <= 1e-5, key


def test_text_encoder_alpha_survives_diffusers_names(tmp_path):
    """A text-encoder LoRA with alpha != rank saved in diffusers names: its keys carry no alpha, so
    the file's ``lora_adapter_metadata`` must hold a ``text_encoder.`` PEFT config (as diffusers'
    ``save_lora_weights`` writes it). PEFT, configured from that metadata and given the file's
    tensors, gives each linear the trained delta; ``klein_core.load_lora`` uses the same scale. Before
    the fix only the transformer's config was written and the text-encoder part loaded at scale 1."""
    import json

    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    from klein_core.lora import load_lora
    from klein_core.testing import tiny_text_encoder
    from klein_core.train.adapters import text_encoder_preset

    peer = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    tr = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
    te = tiny_text_encoder()
    lora = LoRASet(tr, preset("style", rank=2), seed=1)
    text_lora = LoRASet(te, text_encoder_preset(rank=2, alpha=6.0), seed=2)  # scale 3
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in [*lora.layers.values(), *text_lora.layers.values()]:
            layer.up.copy_(torch.randn(layer.up.shape, generator=g))
    path = save_lora(tmp_path / "d.safetensors", lora, fmt="diffusers", text_lora=text_lora)

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    te_cfg = {k[len("text_encoder."):]: v for k, v in meta.items() if k.startswith("text_encoder.")}
    assert te_cfg, "no text-encoder PEFT config in the metadata"
    holder = torch.nn.Module()  # transformers' layout: the decoder layers under "model."
    holder.model = tiny_text_encoder()
    holder = inject_adapter_in_model(LoraConfig(**te_cfg), holder)
    sd = load_file(str(path))
    te_sd = {k[len("text_encoder."):]: v for k, v in sd.items() if k.startswith("text_encoder.")}
    result = set_peft_model_state_dict(holder, te_sd)
    assert not getattr(result, "unexpected_keys", [])
    peft_layers = {n[len("model."):]: m for n, m in holder.named_modules() if isinstance(m, LoraLayer)}
    assert set(peft_layers) == set(text_lora.names())
    for name, m in peft_layers.items():
        want = text_lora.layer(name).delta()
        assert (m.get_delta_weight("default").float() - want).abs().max().item() <= 1e-5, name

    loaded = load_lora(path)
    te_scales = {round(p.scale, 6) for p in loaded.patches if p.component == "text_encoder"}
    assert te_scales == {3.0}
