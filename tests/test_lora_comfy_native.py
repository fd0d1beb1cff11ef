"""Trained LoRAs in ComfyUI names through ComfyUI 0.3.75's own LoRA code, on ComfyUI's own FLUX.2
module built with Klein's sizes (benchmarks/comfy_peer.py) and on the Klein encoder under ComfyUI's
``qwen3_4b.transformer.model`` path; and ComfyUI's LoRA loader on the bridged MODEL (Klein Model to
MODEL) against Klein LoRA Loader on the Klein Sampler."""

from __future__ import annotations

import copy
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


def _lycoris_dora(tr: torch.nn.Module, names: dict[str, str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A LyCORIS-style DoRA LoRA in ComfyUI's names: ``lora_down`` / ``lora_up`` / ``alpha`` and a
    ``dora_scale`` per module, per output row (``"out"``: ``[out, 1]``) or per input column
    (``"in"``: ``[1, in]``), near the weight's own norms as training leaves it."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, axis in names.items():
        w = tr.get_submodule(name).weight.detach().float()
        out, inp = w.shape
        key = f"diffusion_model.{name}"
        sd[f"{key}.lora_down.weight"] = torch.randn(rank, inp, generator=g) * 0.3
        sd[f"{key}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.3
        sd[f"{key}.alpha"] = torch.tensor(3.0)
        if axis:
            norms = w.norm(dim=1, keepdim=True) if axis == "out" else w.norm(dim=0, keepdim=True)
            sd[f"{key}.dora_scale"] = norms * (0.5 + torch.rand(norms.shape, generator=g))
    return sd


def test_dora_loras_match_comfyuis_own_lora_code(comfy_pack, tmp_path, parity):
    """LyCORIS DoRA (``dora_scale``) as ComfyUI 0.3.75 applies it (``load_lora`` + ``calculate_weight``,
    the patches of two LoRAs on one weight in turn): per output row and per input column, a fused
    qkv, at strengths 1 and 0.6, a plain LoRA stacked after a DoRA one; merged weights compared,
    and the branch against the merge on the model's output (a per-row scale as two vectors on the
    output, a per-column one as the module's dense change), the model's own weights untouched."""
    import comfy.lora

    import klein_core as kc

    peer = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    host = peer.import_comfy(Path(comfy_pack.folder_paths.__file__).parent, cpu=True)
    tr = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
    comfy_model = peer.build_comfy_flux2(tr, host=host)
    axes = {"double_blocks.0.img_attn.qkv": "out", "double_blocks.0.txt_mlp.0": "in", "single_blocks.0.linear1": "in",
            "single_blocks.1.linear2": "out", "img_in": "in"}
    dora_sd = _lycoris_dora(tr, axes, rank=2, seed=3)
    plain_sd = _lycoris_dora(tr, dict.fromkeys(("double_blocks.0.img_attn.qkv", "img_in"), ""), rank=3, seed=4)
    unet = torch.nn.Module()
    unet.diffusion_model = comfy_model
    unet.model_config = SimpleNamespace(unet_config={})
    key_map = comfy.lora.model_lora_keys_unet(unet, {})
    comfy_dora, comfy_plain = comfy.lora.load_lora(dora_sd, key_map), comfy.lora.load_lora(plain_sd, key_map)
    dora, plain = kc.load_lora(dora_sd), kc.load_lora(plain_sd)
    assert not dora.skipped and {p.dora for p in dora.patches} == {"comfyui"}
    for stack in ([(1.0, dora)], [(0.6, dora), (0.8, plain)]):
        ours = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
        ours.load_state_dict(tr.state_dict())
        with kc.apply_loras(ours, [(lora, s) for s, lora in stack]):
            worst = 0.0
            for name in axes:
                key = f"diffusion_model.{name}.weight"
                patches = [(s, (comfy_dora if lora is dora else comfy_plain)[key], 1.0, None, None)
                           for s, lora in stack if key in (comfy_dora if lora is dora else comfy_plain)]
                want = comfy.lora.calculate_weight(patches, tr.get_submodule(name).weight.detach().clone().float(),
                                                   key)
                got = ours.get_submodule(name).weight.detach()
                assert (want - tr.get_submodule(name).weight).abs().max() > 0.05  # the LoRA changes it
                worst = max(worst, (got - want).abs().max().item())
        parity(f"LyCORIS DoRA {[s for s, _ in stack]} merged vs ComfyUI load_lora + calculate_weight", worst)
        assert worst <= 1e-6  # measured 1.2e-7
    # a branch keeps the module's change dense: the same output as the merge
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 5, 96, generator=g)
    step = peer.klein_step
    merged, branched = (copy.deepcopy(tr) for _ in range(2))
    kc.apply_loras(merged, [(dora, 0.6), (plain, 0.8)])
    kc.apply_loras(branched, [(dora, 0.6), (plain, 0.8)], mode="branch")
    assert all(torch.equal(a, b) for a, b in zip(branched.state_dict().values(), tr.state_dict().values()))
    # a per-row scale stays low-rank (two vectors beside the factors); a per-column one is kept dense
    for name, axis in axes.items():
        module = branched.get_submodule(name)
        kept = sum(t.numel() for n, t in module.named_buffers() if n.startswith("klein_lora"))
        assert (kept < module.weight.numel() // 4) == (axis == "out"), (name, kept)
    a, b = step(merged, img, txt, 0.7), step(branched, img, txt, 0.7)
    assert (a - step(tr, img, txt, 0.7)).abs().max() > 0.05
    parity("LyCORIS DoRA: branch vs merge (model output, fp32)", (a - b).abs().max().item())
    assert torch.allclose(a, b, atol=2e-5, rtol=0)  # measured 2.0e-6


def test_lokr_with_dora_matches_comfyuis_own_lora_code(comfy_pack, parity):
    """A LyCORIS LoKr with a DoRA scale (per output row on one module, per input column on another)
    as ComfyUI 0.3.75 applies it; the branch (factored Kronecker steps, or the dense change) against
    the merge on the model's output."""
    import comfy.lora

    import klein_core as kc

    peer = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    host = peer.import_comfy(Path(comfy_pack.folder_paths.__file__).parent, cpu=True)
    tr = peer.random_transformer(peer.TINY_CONFIG, torch.device("cpu"), torch.float32)
    comfy_model = peer.build_comfy_flux2(tr, host=host)
    g = torch.Generator().manual_seed(9)
    sd: dict[str, torch.Tensor] = {}
    shapes = {"double_blocks.0.img_attn.proj": ((4, 4), (16, 16), 1), "single_blocks.1.linear2": ((4, 8), (16, 32), 0)}
    for name, (w1, w2, axis) in shapes.items():
        w = tr.get_submodule(name).weight.detach()
        assert (w1[0] * w2[0], w1[1] * w2[1]) == tuple(w.shape)
        key = f"diffusion_model.{name}"
        sd[f"{key}.lokr_w1"] = torch.randn(*w1, generator=g) * 0.5
        sd[f"{key}.lokr_w2_a"] = torch.randn(w2[0], 2, generator=g) * 0.3
        sd[f"{key}.lokr_w2_b"] = torch.randn(2, w2[1], generator=g) * 0.3
        sd[f"{key}.alpha"] = torch.tensor(3.0)
        norms = w.norm(dim=axis, keepdim=True)
        sd[f"{key}.dora_scale"] = norms * (0.5 + torch.rand(norms.shape, generator=g))
    unet = torch.nn.Module()
    unet.diffusion_model = comfy_model
    unet.model_config = SimpleNamespace(unet_config={})
    patches = comfy.lora.load_lora(sd, comfy.lora.model_lora_keys_unet(unet, {}))
    lora = kc.load_lora(sd)
    assert not lora.skipped and lora.format == "ai-toolkit/BFL LoKr with DoRA"
    merged, branched = (copy.deepcopy(tr) for _ in range(2))
    kc.apply_loras(merged, [(lora, 0.7)])
    worst = 0.0
    for name in shapes:
        key = f"diffusion_model.{name}.weight"
        want = comfy.lora.calculate_weight([(0.7, patches[key], 1.0, None, None)],
                                           tr.get_submodule(name).weight.detach().clone().float(), key)
        assert (want - tr.get_submodule(name).weight).abs().max() > 0.05
        worst = max(worst, (merged.get_submodule(name).weight - want).abs().max().item())
    parity("LyCORIS LoKr + DoRA (0.7) merged vs ComfyUI load_lora + calculate_weight", worst)
    assert worst <= 1e-6
    kc.apply_loras(branched, [(lora, 0.7)], mode="branch")
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 5, 96, generator=g)
    a, b = peer.klein_step(merged, img, txt, 0.7), peer.klein_step(branched, img, txt, 0.7)
    parity("LyCORIS LoKr + DoRA: branch vs merge (model output, fp32)", (a - b).abs().max().item())
    assert torch.allclose(a, b, atol=2e-5, rtol=0) and (a - peer.klein_step(tr, img, txt, 0.7)).abs().max() > 0.05
