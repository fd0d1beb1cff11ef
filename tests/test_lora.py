"""LoRA support: every format users meet, checked against reference tools and independent maths.

A tiny random diffusers ``Flux2Transformer2DModel`` is the base. Where a reference tool reads the
format (diffusers + PEFT for diffusers/PEFT, ai-toolkit, Kohya and LyCORIS LoKr files; transformers
+ PEFT for text-encoder LoRAs) its output with the adapter is the reference. Every format is also
checked against an independent expectation: the test's own delta added to a copy of the base
state dict, loaded through ``load_transformer``. Then: mismatch messages, key reporting, strength,
stacking, exact removal, branch mode, the non-mutating copy, the CLI flag and the node.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from extras import require
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_reference import CTX, tiny_diffusers_transformer
from torch import nn

from klein_core import cli
from klein_core.errors import WeightFormatError
from klein_core.files.loaders import load_text_encoder, load_transformer
from klein_core.lora import AppliedLoRAs, LoRA, apply_loras, check_loras, load_lora, with_loras
from klein_core.models.transformer import Flux2Transformer, TransformerConfig
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.testing import TINY_4B, TINY_9B, tiny_text_encoder, tiny_transformer

diffusers = require("diffusers")
require("peft")
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32, tiny model: observed diffs are ~1e-6


# ---------------------------------------------------------------------------------------------
# Base model, inputs and the independent expectation


def _tiny_diffusers(seed: int = 0):
    return tiny_diffusers_transformer(seed)


@dataclass
class Base:
    dm: nn.Module  # diffusers model
    dsd: dict[str, torch.Tensor]  # its state dict (diffusers names)
    bsd: dict[str, torch.Tensor]  # the same weights in the core's (BFL) names
    shapes: dict[str, tuple[int, int]]  # core linear name -> (out, in)
    inputs: tuple
    out: torch.Tensor  # core output without LoRA

    def ours(self, dtype: torch.dtype | None = None) -> Flux2Transformer:
        return load_transformer(self.dsd, dtype=dtype)

    def run(self, model: nn.Module) -> torch.Tensor:
        img, ids, txt, tids, t = self.inputs
        with torch.no_grad():
            return model(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)

    def run_diffusers(self, model: nn.Module) -> torch.Tensor:
        img, ids, txt, tids, t = self.inputs
        with torch.no_grad():
            return model(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                         return_dict=False)[0]

    def expected(self, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
        """Output of the base weights plus ``deltas`` (core module name -> [out, in])."""
        sd = {k: v.clone() for k, v in self.bsd.items()}
        for name, d in deltas.items():
            sd[name + ".weight"] += d
        return self.run(load_transformer(sd))


@pytest.fixture(scope="module")
def base() -> Base:
    dm = _tiny_diffusers()
    dsd = {k: v.contiguous() for k, v in dm.state_dict().items()}
    ours = load_transformer(dsd)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    inputs = (torch.randn(2, ids.shape[0], 8, generator=g), ids, torch.randn(2, 5, CTX, generator=g),
              text_position_ids(5), torch.tensor([0.8, 0.3]))
    shapes = {n: tuple(m.weight.shape) for n, m in ours.named_modules() if isinstance(m, nn.Linear)}
    b = Base(dm, dsd, {k: v.clone() for k, v in ours.state_dict().items()}, shapes, inputs, torch.empty(0))
    b.out = b.run(ours)
    return b


def _factors(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(rank, i, generator=g) * 0.3, torch.randn(o, rank, generator=g) * 0.3)
            for n, (o, i) in shapes.items()}


def _lora_deltas(factors, scale: float) -> dict[str, torch.Tensor]:
    return {n: scale * (b @ a) for n, (a, b) in factors.items()}


def _check(parity, name: str, out: torch.Tensor, ref: torch.Tensor, base_out: torch.Tensor) -> float:
    assert (ref - base_out).abs().max().item() > 0.05, "the LoRA must change the output for the test to mean anything"
    return _assert_close(parity, name, out, ref)


def _assert_close(parity, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> float:
    diff = parity(f"LoRA fp32, {name}", (out - ref).abs().max().item())
    assert diff <= tol, f"{name}: max abs diff {diff:.3e}"
    return diff


def _apply_file(base: Base, path: Path, strength: float = 1.0) -> tuple[LoRA, torch.Tensor]:
    lora = load_lora(path)
    model = base.ours()
    apply_loras(model, [(lora, strength)])
    return lora, base.run(model)


def _diffusers_with(base: Base, path: Path) -> torch.Tensor:
    """Reference: diffusers converts the file (Flux2 Klein pipeline) and PEFT injects it."""
    sd, meta = diffusers.Flux2KleinPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    dm = copy.deepcopy(base.dm)
    dm.load_lora_adapter(sd, prefix="transformer", adapter_name="ref", metadata=meta)
    return base.run_diffusers(dm)


# ---------------------------------------------------------------------------------------------
# Formats


def test_diffusers_peft_format_matches_diffusers(base, tmp_path, parity):
    dm = copy.deepcopy(base.dm)
    linears = [n for n, m in dm.named_modules() if isinstance(m, nn.Linear)]
    # Every linear (norm_out.linear checks the final layer's half swap), a rank and an alpha pattern.
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=linears, init_lora_weights=False,
                     rank_pattern={"^single_transformer_blocks.1.attn.to_out": 2}, alpha_pattern={"to_k": 3})
    dm.add_adapter(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in dm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref = base.run_diffusers(dm)
    diffusers.Flux2KleinPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(dm),
        transformer_lora_adapter_metadata=cfg.to_dict())
    lora, out = _apply_file(base, tmp_path / "pytorch_lora_weights.safetensors")
    assert lora.format == "diffusers/PEFT LoRA" and lora.targets == ("transformer",)
    assert not lora.skipped and lora.rank == 4
    assert lora.ranks["transformer:single_blocks.1.linear2"] == 2
    assert lora.ranks["transformer:double_blocks.0.img_attn.qkv[2/3]"] == 4
    _check(parity, "diffusers/PEFT vs diffusers+PEFT", out, ref, base.out)
    # PEFT's own merge computes W + scale * B @ A in float32 like the loader: the same weights.
    for m in dm.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    _assert_close(parity, "diffusers/PEFT vs diffusers+PEFT merged", out, base.run_diffusers(dm), tol=1e-6)


def _peft_dora_file(base: Base, tmp_path: Path, seed: int = 6) -> tuple[Path, nn.Module]:
    """A diffusers/PEFT DoRA LoRA on every linear (random factors and magnitudes), and the diffusers
    model carrying it unmerged."""
    dm = copy.deepcopy(base.dm)
    linears = [n for n, m in dm.named_modules() if isinstance(m, nn.Linear)]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=linears, init_lora_weights=False, use_dora=True)
    torch.manual_seed(seed)  # PEFT draws its first factors, and the magnitudes' norms of them, from the global RNG
    dm.add_adapter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in dm.named_parameters():
            if "lora_magnitude_vector" in n:  # PEFT starts it at the weight's row norms: move it off them
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    sd = get_peft_model_state_dict(dm)
    assert any(k.endswith("lora_magnitude_vector") for k in sd)
    diffusers.Flux2KleinPipeline.save_lora_weights(tmp_path, transformer_lora_layers=sd,
                                                   transformer_lora_adapter_metadata=cfg.to_dict())
    return tmp_path / "pytorch_lora_weights.safetensors", dm


@pytest.mark.parametrize("mode", ["merge", "branch"])
def test_peft_dora_matches_diffusers(base, tmp_path, parity, mode):
    """PEFT's DoRA (``lora_magnitude_vector``): every row of each weight rescaled to its magnitude,
    the final layer's magnitude halves swapped like its rows; merged, or as a branch that scales
    the output rows (no dense copy of any weight)."""
    path, dm = _peft_dora_file(base, tmp_path)
    ref = base.run_diffusers(dm)
    lora = load_lora(path)
    assert not lora.skipped and {p.dora for p in lora.patches} == {"peft"}
    model = base.ours()
    apply_loras(model, [lora], mode=mode)
    out = base.run(model)
    _check(parity, f"PEFT DoRA ({mode}) vs diffusers+PEFT", out, ref, base.out)
    if mode == "branch":
        kept = sum(t.numel() for n, t in model.named_buffers() if ".klein_lora" in n)
        assert 0 < kept < sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) // 4
    # the magnitudes matter: the same factors without them give another output
    with safe_open(str(path), "pt") as f:
        plain = load_lora({k: f.get_tensor(k) for k in f.keys() if "magnitude" not in k},  # noqa: SIM118
                          metadata=f.metadata())
    model = base.ours()
    apply_loras(model, [plain])
    assert (base.run(model) - ref).abs().max().item() > 0.05


def test_dora_magnitudes_of_the_wrong_shape_are_refused_by_key():
    def one(extra: dict[str, torch.Tensor], name: str = "img_in", out: int = 64, inp: int = 128):
        key = f"diffusion_model.{name}"
        return {f"{key}.lora_A.weight": torch.zeros(2, inp), f"{key}.lora_B.weight": torch.zeros(out, 2),
                **{f"{key}.{k}": v for k, v in extra.items()}}

    lora = load_lora(one({"dora_scale": torch.ones(64, 1)}))
    assert lora.format == "ai-toolkit/BFL DoRA" and lora.patches[0].dora == "comfyui"
    assert load_lora(one({"dora_scale": torch.ones(1, 128)})).patches[0].dora == "comfyui"
    with pytest.raises(ValueError, match=r"'diffusion_model\.img_in\.dora_scale' has shape \[64\]; a DoRA scale of "
                                         r"this \[64, 128\] module is \[64, 1\] .* or \[1, 128\]"):
        load_lora(one({"dora_scale": torch.ones(64)}))
    with pytest.raises(ValueError, match=r"lora_magnitude_vector' is a PEFT DoRA magnitude with shape \[1, 128\]"):
        load_lora(one({"lora_magnitude_vector": torch.ones(1, 128)}))
    with pytest.raises(ValueError, match="both a dora_scale and a lora_magnitude_vector"):
        load_lora(one({"dora_scale": torch.ones(64, 1), "lora_magnitude_vector": torch.ones(64)}))
    with pytest.raises(ValueError, match="DoRA magnitude on a full weight delta"):
        load_lora({"diffusion_model.img_in.diff": torch.zeros(64, 128), "diffusion_model.img_in.dora_scale":
                   torch.ones(64, 1)})


def test_diffusers_format_without_metadata_uses_alpha_equal_rank(base, tmp_path, parity):
    # Only to_v of one block, no lora_adapter_metadata: scale 1, rows [2D, 3D) of the fused qkv.
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 32, generator=g), torch.randn(32, 3, generator=g)
    sd = {"transformer.transformer_blocks.1.attn.to_v.lora_A.weight": a,
          "transformer.transformer_blocks.1.attn.to_v.lora_B.weight": b}
    save_file(sd, tmp_path / "v_only.safetensors")
    _, out = _apply_file(base, tmp_path / "v_only.safetensors")
    delta = torch.zeros(96, 32)
    delta[64:96] = b @ a
    _check(parity, "diffusers to_v only, no metadata", out, base.expected({"double_blocks.1.img_attn.qkv": delta}),
           base.out)


def _lora_state_dict(factors, style: str, alpha: float | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for name, (a, b) in factors.items():
        if style == "ai-toolkit":
            path, down, up = f"diffusion_model.{name}", "lora_A.weight", "lora_B.weight"
        elif style == "peft":
            path, down, up = f"base_model.model.{name}", "lora_A.weight", "lora_B.weight"
        else:  # kohya
            path, down, up = "lora_unet_" + name.replace(".", "_"), "lora_down.weight", "lora_up.weight"
        out[f"{path}.{down}"], out[f"{path}.{up}"] = a.contiguous(), b.contiguous()
        if alpha is not None:
            out[f"{path}.alpha"] = torch.tensor(alpha)
    return out


@pytest.mark.parametrize("style", ["ai-toolkit", "kohya", "peft"])
def test_bfl_name_formats_every_linear(base, tmp_path, style, parity):
    # Every linear of the core, including the modulation linears and the final layer (BFL order).
    f = _factors(base.shapes, 4, seed=7)
    alpha = 2.0 if style != "peft" else None
    save_file(_lora_state_dict(f, style, alpha), tmp_path / "lora.safetensors")
    lora, out = _apply_file(base, tmp_path / "lora.safetensors", strength=0.8)
    assert not lora.skipped and len(lora.patches) == len(base.shapes)
    assert {"ai-toolkit": "ai-toolkit/BFL LoRA", "kohya": "Kohya LoRA", "peft": "PEFT LoRA"}[style] == lora.format
    scale = 0.8 * (alpha / 4 if alpha else 1.0)
    _check(parity, f"{style} (every linear) vs independent", out, base.expected(_lora_deltas(f, scale)), base.out)


@pytest.mark.parametrize("style", ["ai-toolkit", "kohya"])
def test_bfl_name_formats_match_diffusers(base, tmp_path, style, parity):
    # The modules diffusers' Flux2 converters read (its ai-toolkit path rejects .alpha keys and
    # puts the final adaLN on the wrong halves; its Kohya path reads no modulation linears).
    names = [n for n in base.shapes if "modulation" not in n and "adaLN" not in n]
    if style == "ai-toolkit":
        names += ["double_stream_modulation_img.lin", "single_stream_modulation.lin"]
    f = _factors({n: base.shapes[n] for n in names}, 3, seed=8)
    save_file(_lora_state_dict(f, style, 1.5 if style == "kohya" else None), tmp_path / "lora.safetensors")
    _, out = _apply_file(base, tmp_path / "lora.safetensors")
    _check(parity, f"{style} vs diffusers+PEFT", out, _diffusers_with(base, tmp_path / "lora.safetensors"), base.out)


def _lokr(w1_shape, w2_shape, rank, g, decompose_w2=True):
    t = {"lokr_w1": torch.randn(*w1_shape, generator=g) * 0.5}
    if decompose_w2:
        t["lokr_w2_a"] = torch.randn(w2_shape[0], rank, generator=g) * 0.5
        t["lokr_w2_b"] = torch.randn(rank, w2_shape[1], generator=g) * 0.5
    else:
        t["lokr_w2"] = torch.randn(*w2_shape, generator=g) * 0.5
    return t


def _lokr_delta(t, alpha=None):
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    scale = alpha / t["lokr_w2_b"].shape[0] if alpha is not None and "lokr_w2_b" in t else 1.0
    return torch.kron(t["lokr_w1"], w2) * scale


def test_lycoris_lokr_diffusers_names(base, tmp_path, parity):
    g = torch.Generator().manual_seed(9)
    # LyCORIS over a diffusers model: split q/k/v, fused single-block projections. The left factors
    # are all 4x4 so that PEFT (the reference) finds one decompose_factor for the whole file.
    mods = {
        "transformer_blocks_0_attn_to_q": ("double_blocks.0.img_attn.qkv", 0, (4, 4), (8, 8)),
        "transformer_blocks_0_attn_to_v": ("double_blocks.0.img_attn.qkv", 2, (4, 4), (8, 8)),
        "transformer_blocks_1_ff_linear_in": ("double_blocks.1.img_mlp.0", None, (4, 4), (48, 8)),
        "single_transformer_blocks_0_attn_to_qkv_mlp_proj": ("single_blocks.0.linear1", None, (4, 4), (72, 8)),
    }
    sd, deltas = {}, {}
    for path, (core, part, s1, s2) in mods.items():
        t = _lokr(s1, s2, 2, g)
        sd.update({f"lycoris_{path}.{k}": v for k, v in t.items()})
        sd[f"lycoris_{path}.alpha"] = torch.tensor(1.0)
        d = _lokr_delta(t, alpha=1.0)
        full = deltas.setdefault(core, torch.zeros(base.shapes[core]))
        if part is None:
            full += d
        else:
            full[part * 32:(part + 1) * 32] += d
    save_file(sd, tmp_path / "lokr.safetensors")
    lora, out = _apply_file(base, tmp_path / "lokr.safetensors")
    assert lora.format == "LyCORIS LoKr" and not lora.skipped
    _check(parity, "LyCORIS LoKr (diffusers names) vs independent", out, base.expected(deltas), base.out)
    _assert_close(parity, "LyCORIS LoKr (diffusers names) vs diffusers+PEFT", out,
                  _diffusers_with(base, tmp_path / "lokr.safetensors"))


def test_ai_toolkit_lokr_fused_qkv(base, tmp_path, parity):
    g = torch.Generator().manual_seed(10)
    t_qkv = _lokr((4, 4), (24, 8), 0, g, decompose_w2=False)  # full factors: alpha is ignored
    t_l2 = _lokr((4, 4), (8, 32), 0, g, decompose_w2=False)
    sd = {f"diffusion_model.double_blocks.1.txt_attn.qkv.{k}": v for k, v in t_qkv.items()}
    sd.update({f"diffusion_model.single_blocks.1.linear2.{k}": v for k, v in t_l2.items()})
    sd["diffusion_model.double_blocks.1.txt_attn.qkv.alpha"] = torch.tensor(7.0)
    save_file(sd, tmp_path / "lokr.safetensors")
    lora, out = _apply_file(base, tmp_path / "lokr.safetensors")
    assert lora.format == "ai-toolkit/BFL LoKr" and lora.rank is None
    expected = base.expected({"double_blocks.1.txt_attn.qkv": _lokr_delta(t_qkv),
                              "single_blocks.1.linear2": _lokr_delta(t_l2)})
    _check(parity, "ai-toolkit LoKr (fused qkv) vs independent", out, expected, base.out)
    sd.pop("diffusion_model.double_blocks.1.txt_attn.qkv.alpha")  # diffusers' converter wants no stray keys
    save_file(sd, tmp_path / "lokr_noalpha.safetensors")
    _assert_close(parity, "ai-toolkit LoKr (fused qkv) vs diffusers+PEFT", out,
                  _diffusers_with(base, tmp_path / "lokr_noalpha.safetensors"))


def test_kohya_loha_and_full_diff(base, tmp_path, parity):
    g = torch.Generator().manual_seed(11)
    sd, deltas = {}, {}
    for name, alpha in (("double_blocks.0.img_attn.qkv", 2.0), ("single_blocks.1.linear2", None)):
        o, i = base.shapes[name]
        t = {"hada_w1_a": torch.randn(o, 4, generator=g), "hada_w1_b": torch.randn(4, i, generator=g),
             "hada_w2_a": torch.randn(o, 4, generator=g), "hada_w2_b": torch.randn(4, i, generator=g)}
        path = "lora_unet_" + name.replace(".", "_")
        sd.update({f"{path}.{k}": v * 0.3 for k, v in t.items()})
        if alpha is not None:
            sd[f"{path}.alpha"] = torch.tensor(alpha)
        w = {k: v * 0.3 for k, v in t.items()}
        deltas[name] = (w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"]) * (
            alpha / 4 if alpha else 1.0)
    diff = torch.randn(base.shapes["img_in"], generator=g) * 0.1  # LyCORIS "full" module
    sd["lora_unet_img_in.diff"] = diff
    deltas["img_in"] = diff
    save_file(sd, tmp_path / "loha.safetensors")
    lora, out = _apply_file(base, tmp_path / "loha.safetensors", strength=-0.7)
    assert lora.format == "Kohya LoHa + Kohya full-delta" and not lora.skipped
    _check(parity, "Kohya LoHa + full diff vs independent", out,
           base.expected({k: -0.7 * v for k, v in deltas.items()}), base.out)


def test_final_layer_conventions(base, tmp_path, parity):
    # The same delta written in BFL names (BFL row order) and in diffusers names (halves swapped)
    # must give the same model.
    f = _factors({"final_layer.adaLN_modulation.1": base.shapes["final_layer.adaLN_modulation.1"]}, 2, seed=12)
    (a, b), = f.values()
    save_file(_lora_state_dict(f, "ai-toolkit"), tmp_path / "bfl.safetensors")
    lo, hi = b.chunk(2)
    save_file({"transformer.norm_out.linear.lora_A.weight": a,
               "transformer.norm_out.linear.lora_B.weight": torch.cat([hi, lo])}, tmp_path / "diffusers.safetensors")
    expected = base.expected({"final_layer.adaLN_modulation.1": b @ a})
    for name in ("bfl", "diffusers"):
        _, out = _apply_file(base, tmp_path / f"{name}.safetensors")
        _check(parity, f"final layer, {name} names", out, expected, base.out)

def test_final_layer_dora_scale_follows_its_rows(base, tmp_path, parity):
    """A per-row dora_scale ([out, 1]) written in diffusers names is in diffusers' row order (scale,
    shift), like the LoRA's rows: it is swapped with them, so BFL and diffusers names give one model,
    the independently computed ComfyUI rule (norm of W's rows before the delta). ComfyUI 0.3.75
    swaps only the delta (weight_decompose's ``function``) and applies the scale unswapped; the
    reference here is the other half's magnitude on each half, which this test tells apart."""
    name = "final_layer.adaLN_modulation.1"
    f = _factors({name: base.shapes[name]}, 2, seed=14)
    (a, b), = f.values()
    w = base.bsd[name + ".weight"]
    g = torch.Generator().manual_seed(15)
    norms = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    scale = norms * (0.5 + torch.rand(norms.shape, generator=g))  # BFL row order
    bfl = _lora_state_dict(f, "ai-toolkit")
    bfl[f"diffusion_model.{name}.dora_scale"] = scale
    save_file(bfl, tmp_path / "bfl_dora.safetensors")
    lo, hi = b.chunk(2)
    s_lo, s_hi = scale.chunk(2)
    save_file({"transformer.norm_out.linear.lora_A.weight": a,
               "transformer.norm_out.linear.lora_B.weight": torch.cat([hi, lo]),
               "transformer.norm_out.linear.dora_scale": torch.cat([s_hi, s_lo])},
              tmp_path / "diffusers_dora.safetensors")
    delta = b @ a
    rows = scale / (norms + torch.finfo(torch.float32).eps) * (w + delta)
    expected = base.expected({name: rows - w})
    unswapped = base.expected({name: torch.cat([s_hi, s_lo]) / (norms + torch.finfo(torch.float32).eps)
                                     * (w + delta) - w})
    assert (expected - unswapped).abs().max().item() > 0.05  # the two rules differ on this model
    for file in ("bfl_dora", "diffusers_dora"):
        lora, out = _apply_file(base, tmp_path / f"{file}.safetensors")
        assert lora.patches[0].dora == "comfyui"
        _check(parity, f"final layer DoRA scale, {file} names", out, expected, base.out)


# ---------------------------------------------------------------------------------------------
# Text encoder


def _tiny_qwen(layers: int = 30):
    transformers = require("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=500, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6, initializer_range=0.1,
        attn_implementation="sdpa",
    )
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _peft_qwen(cfg: LoraConfig, seed: int):
    """A tiny Qwen3 with ``cfg`` injected by PEFT and random adapter weights (DoRA magnitudes moved
    off the norms PEFT starts them at). Returns ``(base state dict, ids, mask, reference, PEFT state
    dict)``; the reference is transformers + PEFT's layers 9, 18 and 27 concatenated. 30 layers:
    transformers' last hidden state comes after the final norm, and layer 27 must not be the last."""
    hf = _tiny_qwen()
    base_sd = {k: v.clone() for k, v in hf.state_dict().items()}
    torch.manual_seed(seed)  # PEFT draws its first factors (a DoRA magnitude's norms of them) from the global RNG
    inject_adapter_in_model(cfg, hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ids = torch.randint(1, 500, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        hs = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i] for i in (9, 18, 27)], dim=-1)  # SPEC §2.3, not klein_core's OUTPUT_LAYERS
    return base_sd, ids, mask, ref, get_peft_model_state_dict(hf)  # "model.layers.N.self_attn.q_proj.lora_A.weight"


def test_text_encoder_lora_peft_and_kohya(tmp_path, parity):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base_sd, ids, mask, ref, peft_sd = _peft_qwen(LoraConfig(r=4, lora_alpha=6, target_modules=targets,
                                                             init_lora_weights=False), seed=13)
    meta = {"lora_adapter_metadata": json.dumps({f"text_encoder.{k}": v for k, v in
                                                 {"r": 4, "lora_alpha": 6, "peft_type": "LORA"}.items()})}
    save_file({f"text_encoder.{k}": v.contiguous() for k, v in peft_sd.items()}, tmp_path / "te.safetensors",
              metadata=meta)
    kohya = {}
    for k, v in peft_sd.items():
        path, _, suffix = k.partition(".lora_")
        kpath = "lora_te_" + path.replace(".", "_")
        kohya[f"{kpath}.lora_{'down' if suffix.startswith('A') else 'up'}.weight"] = v.contiguous()
        kohya[f"{kpath}.alpha"] = torch.tensor(6.0)
    save_file(kohya, tmp_path / "te_kohya.safetensors")

    base_te = load_text_encoder(base_sd)
    plain = base_te.encode(ids, mask)
    for name in ("te", "te_kohya"):
        lora = load_lora(tmp_path / f"{name}.safetensors")
        assert lora.targets == ("text_encoder",)
        # Layers 27-29 exist in the file but never reach Klein's output: reported, not errors.
        ignored = [k for k, r in lora.skipped.items() if "layer not used by Klein" in r]
        assert len(ignored) == len(lora.skipped) == 3 * 7 * (3 if name == "te_kohya" else 2)
        te = load_text_encoder(base_sd)
        with apply_loras(te, lora) as handle:
            out = te.encode(ids, mask)
            assert len(handle.modules) == 27 * 7
        assert torch.equal(te.encode(ids, mask), plain)  # removed again
        assert (ref - plain).abs().max().item() > 0.05
        _assert_close(parity, f"text encoder {'PEFT' if name == 'te' else 'Kohya'} vs transformers+PEFT", out, ref)


def test_text_encoder_peft_dora_matches_transformers_peft(tmp_path, parity):
    """A PEFT DoRA LoRA on the Qwen3 encoder (its magnitudes moved off their initial norms): merged
    and as a branch, against transformers + PEFT running the adapter."""
    base_sd, ids, mask, ref, peft_sd = _peft_qwen(LoraConfig(
        r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, use_dora=True),
        seed=17)
    assert any(k.endswith("lora_magnitude_vector") for k in peft_sd)
    meta = {"lora_adapter_metadata": json.dumps({"text_encoder.r": 4, "text_encoder.lora_alpha": 6,
                                                 "text_encoder.peft_type": "LORA", "text_encoder.use_dora": True})}
    save_file({f"text_encoder.{k}": v.contiguous() for k, v in peft_sd.items()}, tmp_path / "te_dora.safetensors",
              metadata=meta)
    lora = load_lora(tmp_path / "te_dora.safetensors")
    assert lora.format == "PEFT DoRA (text encoder)"
    assert len(lora.skipped) == 3 * 3 * 3 and all("layer not used by Klein" in r for r in lora.skipped.values())
    plain = load_text_encoder(base_sd).encode(ids, mask)
    assert (ref - plain).abs().max().item() > 0.05
    for mode in ("merge", "branch"):
        te = load_text_encoder(base_sd)
        with apply_loras(te, lora, mode=mode):
            out = te.encode(ids, mask)
        _assert_close(parity, f"text encoder PEFT DoRA ({mode}) vs transformers+PEFT", out, ref)


def test_text_encoder_size_mismatch():
    te4 = tiny_text_encoder(TINY_4B)
    w = tiny_text_encoder(TINY_9B).layers[0].self_attn.q_proj.weight
    lora = load_lora({"text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, w.shape[1]),
                      "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(w.shape[0], 2)})
    with pytest.raises(ValueError, match=r"text-encoder part was trained for another Qwen3 text encoder \(hidden 48\); "
                                         r"the loaded text encoder is Qwen3 \(hidden 32\)"):
        apply_loras(te4, lora)


# ---------------------------------------------------------------------------------------------
# Mismatches and reporting


def _one_module_lora(shape: tuple[int, int], name: str = "double_blocks.0.img_attn.qkv", rank: int = 2):
    return {f"diffusion_model.{name}.lora_A.weight": torch.zeros(rank, shape[1]),
            f"diffusion_model.{name}.lora_B.weight": torch.zeros(shape[0], rank)}


def test_9b_lora_on_4b_names_both_sizes(tmp_path):
    cfg4 = TransformerConfig(hidden_size=3072, num_heads=24, depth=5, depth_single=20, context_dim=7680, mlp_hidden=9216)
    with torch.device("meta"):  # real sizes, no memory
        klein4b = Flux2Transformer(cfg4)
    save_file(_one_module_lora((3 * 4096, 4096)), tmp_path / "klein9b_lora.safetensors")
    lora = load_lora(tmp_path / "klein9b_lora.safetensors")
    msg = r"klein9b_lora\.safetensors: this LoRA was trained for Klein 9B \(hidden 4096\); the loaded model is Klein 4B \(hidden 3072\)"
    with pytest.raises(ValueError, match=msg):
        check_loras(klein4b, lora)
    # The tiny families: TINY_9B's width on a TINY_4B model.
    tiny4 = tiny_transformer(TINY_4B)
    big = tiny_transformer(TINY_9B).double_blocks[0].img_attn.qkv.weight.shape
    lora = load_lora(_one_module_lora(tuple(big)))
    with pytest.raises(ValueError, match=r"trained for a Flux2 transformer \(hidden 96\); the loaded model is "
                                         r"Flux2 \(hidden 64, 1\+2 blocks\)"):
        apply_loras(tiny4, lora)


def test_block_the_model_lacks_is_refused():
    tiny4 = tiny_transformer(TINY_4B)  # one double block
    lora = load_lora(_one_module_lora((192, 64), name="double_blocks.1.img_attn.proj"))
    with pytest.raises(ValueError, match=r"adapts double_blocks\.1\.img_attn\.proj, which the loaded .* does not have"):
        apply_loras(tiny4, lora)


def test_flux1_lora_is_named(tmp_path):
    bfl = _one_module_lora((3072 * 6, 3072), name="double_blocks.0.img_mod.lin")
    bfl.update(_one_module_lora((3 * 3072, 3072)))
    save_file(bfl, tmp_path / "flux1_bfl.safetensors")
    with pytest.raises(ValueError, match=r"flux1_bfl\.safetensors: this is a FLUX\.1 LoRA; it does not apply to "
                                         r"FLUX\.2 Klein"):
        load_lora(tmp_path / "flux1_bfl.safetensors")
    dif = {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 3072),
           "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 2)}
    with pytest.raises(ValueError, match="this is a FLUX.1 LoRA"):
        load_lora(dif)
    kohya = {"lora_unet_double_blocks_18_img_attn_proj.lora_down.weight": torch.zeros(2, 3072),
             "lora_unet_double_blocks_18_img_attn_proj.lora_up.weight": torch.zeros(3072, 2)}
    with pytest.raises(ValueError, match="this is a FLUX.1 LoRA"):
        load_lora(kohya)


def test_unknown_and_unused_keys_reported_by_name(base, caplog):
    sd = _lora_state_dict(_factors({"img_in": base.shapes["img_in"]}, 2, seed=14), "ai-toolkit")
    sd["diffusion_model.double_blocks.0.img_attn.foo.lora_A.weight"] = torch.zeros(2, 32)
    sd["diffusion_model.double_blocks.0.img_attn.foo.lora_B.weight"] = torch.zeros(32, 2)
    sd["diffusion_model.img_in.lora_A.bias"] = torch.ones(2)
    sd["diffusion_model.txt_in.lora_A.weight"] = torch.zeros(2, CTX)  # its B is missing
    sd["text_encoder.model.layers.30.mlp.up_proj.lora_A.weight"] = torch.zeros(2, 32)
    sd["text_encoder.model.layers.30.mlp.up_proj.lora_B.weight"] = torch.zeros(48, 2)
    sd["guidance_in.in_layer.lora_A.weight"] = torch.zeros(2, 256)
    sd["guidance_in.in_layer.lora_B.weight"] = torch.zeros(32, 2)
    sd["some_model_tensor.weight"] = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="klein_core.lora"):
        lora = load_lora(sd)
    s = lora.skipped
    assert "no FLUX.2 Klein module" in s["diffusion_model.double_blocks.0.img_attn.foo.lora_A.weight"]
    assert "bias terms are not supported" in s["diffusion_model.img_in.lora_A.bias"]
    assert "incomplete" in s["diffusion_model.txt_in.lora_A.weight"]
    assert s["text_encoder.model.layers.30.mlp.up_proj.lora_B.weight"].startswith("ignored: layer not used by Klein")
    assert "guidance embedder" in s["guidance_in.in_layer.lora_A.weight"]
    assert "not a LoRA tensor" in s["some_model_tensor.weight"]
    assert len(s) == len(sd) - 2 and [p.module for p in lora.patches] == ["img_in"]
    assert "9 keys not applied" in caplog.text
    assert all(f"'{k}'" in caplog.text for k in s), "every key is named in the warning"
    # A text-encoder part with no text encoder given is reported on the handle.
    te_lora = load_lora({"text_encoder.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 32),
                         "text_encoder.model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(64, 2)})
    handle = apply_loras(base.ours(), [lora, te_lora])
    # (two LoRAs in one call: each key under its LoRA's name, as two files often share key names)
    key = f"{te_lora.name}: text_encoder.model.layers.0.mlp.up_proj.lora_A.weight"
    assert "no text encoder was given" in handle.skipped[key]


def test_not_a_lora_and_pickles_refused(base, tmp_path):
    with pytest.raises(ValueError, match="not a LoRA"):
        load_lora({k: v for k, v in list(base.bsd.items())[:4]})
    save_file(_one_module_lora((4, 4), name="input_blocks.0.proj"), tmp_path / "sdxl.safetensors")
    with pytest.raises(ValueError, match=r"sdxl\.safetensors: none of its 2 LoRA keys adapts a FLUX\.2 Klein module"):
        load_lora(tmp_path / "sdxl.safetensors")
    (tmp_path / "lora.pt").write_bytes(b"\x80\x04junk")
    with pytest.raises(WeightFormatError, match="pickle"):
        load_lora(tmp_path / "lora.pt")
    with pytest.raises(FileNotFoundError):
        load_lora(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------------------------------------
# Strength, stacking, removal, branch mode, copies


@pytest.fixture(scope="module")
def two_loras(base):
    fa = _factors({n: s for n, s in base.shapes.items() if "double_blocks" in n}, 4, seed=20)
    fb = _factors({n: s for n, s in base.shapes.items() if "single_blocks" in n or "img_attn" in n}, 3, seed=21)
    return (load_lora(_lora_state_dict(fa, "ai-toolkit")), fa), (load_lora(_lora_state_dict(fb, "kohya", alpha=1.5)), fb)


def test_strength_zero_is_no_lora_exactly(base, two_loras):
    (la, _), _ = two_loras
    for mode in ("merge", "branch"):
        model = base.ours(dtype=torch.bfloat16)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        handle = apply_loras(model, [(la, 0.0)], mode=mode)
        assert handle.modules == []
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert torch.equal(base.run(model), base.run(base.ours(dtype=torch.bfloat16)))


def test_stacking_order_and_sum_of_deltas(base, two_loras, parity):
    (la, fa), (lb, fb) = two_loras
    m1, m2, m3 = base.ours(), base.ours(), base.ours()
    apply_loras(m1, [(la, 0.7)])
    apply_loras(m1, [(lb, -1.2)])
    apply_loras(m2, [(lb, -1.2)])
    apply_loras(m2, [(la, 0.7)])
    apply_loras(m3, [(la, 0.7), (lb, -1.2)])
    deltas = _lora_deltas(fa, 0.7)
    for n, d in _lora_deltas(fb, -1.2 * 1.5 / 3).items():
        deltas[n] = deltas.get(n, 0) + d
    expected = base.expected(deltas)
    o1, o2, o3 = base.run(m1), base.run(m2), base.run(m3)
    _assert_close(parity, "stack A then B vs B then A (merge)", o1, o2, tol=1e-5)
    _check(parity, "stack of two vs sum of deltas", o3, expected, base.out)


def test_unmerge_restores_weights_bit_exactly(base, two_loras):
    (la, _), (lb, _) = two_loras
    model = base.ours(dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ha = apply_loras(model, [(la, 1.3)])
    hb = apply_loras(model, [(lb, 0.9)])
    assert not torch.equal(model.double_blocks[0].img_attn.qkv.weight, before["double_blocks.0.img_attn.qkv.weight"])
    with pytest.raises(ValueError, match="reverse order"):
        ha.remove()  # B changed the same weights afterwards
    hb.remove()
    ha.remove()
    ha.remove()  # idempotent
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not ha.active and "removed" in repr(ha)


def test_branch_mode_equals_merge_and_removes_cleanly(base, two_loras, parity):
    (la, _), (lb, _) = two_loras
    merged, branched = base.ours(), base.ours()
    apply_loras(merged, [(la, 0.6), (lb, 1.1)])
    before = {k: v.clone() for k, v in branched.state_dict().items()}
    ha = apply_loras(branched, [(la, 0.6)], mode="branch")
    hb = apply_loras(branched, [(lb, 1.1)], mode="branch")
    assert isinstance(ha, AppliedLoRAs) and all(torch.equal(before[k], v) for k, v in branched.state_dict().items())
    _assert_close(parity, "branch vs merge", base.run(branched), base.run(merged), tol=1e-5)
    ha.remove()  # branch handles come off in any order
    hb.remove()
    assert torch.equal(base.run(branched), base.out)


def test_branch_mode_lokr_loha_equal_merge(base, parity):
    # LoKr stays factored in branch mode (q/k/v parts, fused qkv, the swapped final layer); LoHa is dense.
    g = torch.Generator().manual_seed(22)
    sd = {}
    for path, s1, s2 in (("lycoris_transformer_blocks_0_attn_to_k", (4, 4), (8, 8)),
                         ("diffusion_model.double_blocks.1.txt_attn.qkv", (4, 4), (24, 8)),
                         ("transformer.norm_out.linear", (4, 4), (16, 8))):
        sd.update({f"{path}.{k}": v for k, v in _lokr(s1, s2, 2, g).items()})
        sd[f"{path}.alpha"] = torch.tensor(1.0)
    o, i = base.shapes["single_blocks.0.linear1"]
    for k, shape in (("hada_w1_a", (o, 2)), ("hada_w1_b", (2, i)), ("hada_w2_a", (o, 2)), ("hada_w2_b", (2, i))):
        sd[f"lora_unet_single_blocks_0_linear1.{k}"] = torch.randn(*shape, generator=g) * 0.4
    lora = load_lora(sd)
    assert sorted(p.kind for p in lora.patches) == ["loha", "lokr", "lokr", "lokr"]
    merged, branched = base.ours(), base.ours()
    apply_loras(merged, [(lora, 0.9)])
    apply_loras(branched, [(lora, 0.9)], mode="branch")
    _check(parity, "branch vs merge (LoKr + LoHa)", base.run(branched), base.run(merged), base.out)


def test_with_loras_copy_leaves_input_untouched(base, two_loras, parity):
    (la, _), (lb, _) = two_loras
    model = base.ours()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    once = with_loras(model, [(la, 0.6)])
    twice = with_loras(once, [(lb, 1.1)])
    merged = base.ours()
    apply_loras(merged, [(la, 0.6), (lb, 1.1)])
    _assert_close(parity, "with_loras chain vs merge", base.run(twice), base.run(merged), tol=1e-5)
    assert torch.equal(base.run(model), base.out)  # the input and its weights are unchanged
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert twice.double_blocks[0].img_attn.qkv.weight is model.double_blocks[0].img_attn.qkv.weight  # shared
    assert twice.img_in is model.img_in  # untouched modules are the same objects
    assert with_loras(model, [(la, 0.0)]) is model


def test_float8_weights_not_supported_yet(base, two_loras):
    (la, _), _ = two_loras
    model = base.ours()
    lin = model.double_blocks[0].img_attn.qkv
    lin.weight = nn.Parameter(lin.weight.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(NotImplementedError, match="float8"):
        apply_loras(model, la)


# ---------------------------------------------------------------------------------------------
# CLI and node


def test_cli_lora_flag(tmp_path, capsys):
    demo = tiny_transformer(TINY_4B)  # --demo builds these weights (seed 0)
    shapes = {n: tuple(m.weight.shape) for n, m in demo.named_modules() if isinstance(m, nn.Linear)}
    save_file(_lora_state_dict(_factors(shapes, 2, seed=30), "kohya", alpha=1.0), tmp_path / "demo_lora.safetensors")
    big = tiny_transformer(TINY_9B).double_blocks[0].img_attn.qkv.weight.shape
    save_file(_one_module_lora(tuple(big)), tmp_path / "big.safetensors")
    args = ["--demo", "--prompt", "x", "--width", "64", "--height", "64", "--steps", "1", "-q"]
    assert cli.lora_arg("C:\\loras\\a.safetensors") == (Path("C:\\loras\\a.safetensors"), 1.0)
    assert cli.lora_arg("a.safetensors:-0.5") == (Path("a.safetensors"), -0.5)
    rc = cli.main([*args, "--out", str(tmp_path / "a.png"), "--lora", f"{tmp_path / 'demo_lora.safetensors'}:0.5"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads(Image.open(tmp_path / "a.png").text["parameters"])["loras"] == ["demo_lora.safetensors:0.5"]
    rc = cli.main([*args, "--out", str(tmp_path / "b.png"), "--lora", str(tmp_path / "big.safetensors")])
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("--demo")]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("error: ") and "trained for" in errors[0], errors


@pytest.fixture(scope="module")
def pack_lora(comfy_pack):
    """``nodes/lora.py`` as ``klein_pack_nodes.lora`` inside the host, plus ComfyUI's ``folder_paths``."""
    return importlib.import_module("klein_pack_nodes.lora"), comfy_pack.folder_paths


@dataclass(frozen=True)
class _HeldModel:  # a KLEIN_MODEL that holds its transformer
    transformer: nn.Module
    kind: str = "distilled"


class _Ref:  # a lazy model handle, like the pack's cache.ModelRef
    name = "tiny.safetensors"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def get(self) -> nn.Module:
        return self.model


@dataclass(frozen=True)
class _RefModel:
    ref: object
    kind: str
    config: TransformerConfig

    @property
    def name(self) -> str:
        return self.ref.name


def test_lora_loader_node(base, two_loras, pack_lora, tmp_path, monkeypatch, parity):
    node_mod, folder_paths = pack_lora
    (_, fa), (_, fb) = two_loras
    loras = tmp_path / "loras"
    loras.mkdir()
    save_file(_lora_state_dict(fa, "ai-toolkit"), loras / "a.safetensors")
    save_file(_lora_state_dict(fb, "kohya", alpha=1.5), loras / "b.safetensors")
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras", ([str(loras)], {".safetensors"}))
    folder_paths.filename_list_cache.clear()
    node = node_mod.KleinLoraLoader
    schema = node.define_schema()
    assert (schema.node_id, schema.display_name, schema.category) == ("KleinLoraLoader", "Klein LoRA Loader", "Klein")
    assert schema.inputs[1].options == ["a.safetensors", "b.safetensors"]

    merged = base.ours()
    apply_loras(merged, [(load_lora(loras / "a.safetensors"), 0.6), (load_lora(loras / "b.safetensors"), 1.1)])
    expected = base.run(merged)
    for wrapper in (_HeldModel(base.ours()), _RefModel(_Ref(base.ours()), "distilled", base.ours().config)):
        first = node.execute(model=wrapper, lora_name="a.safetensors", strength=0.6).result[0]
        second = node.execute(model=first, lora_name="b.safetensors", strength=1.1).result[0]
        get = (lambda w: w.transformer) if isinstance(wrapper, _HeldModel) else (lambda w: w.ref.get())
        assert torch.equal(base.run(get(wrapper)), base.out)  # the input model is unchanged
        assert second.kind == "distilled"
        _assert_close(parity, f"node chain ({type(wrapper).__name__}) vs merge", base.run(get(second)), expected,
                      tol=1e-5)
    big = _RefModel(_Ref(base.ours()), "distilled", tiny_transformer(TINY_9B).config)
    with pytest.raises(ValueError, match=r"Klein LoRA Loader: .*a\.safetensors: this LoRA was trained for"):
        node.execute(model=big, lora_name="a.safetensors", strength=1.0)
    assert os.path.isfile(folder_paths.get_full_path("loras", "a.safetensors"))


def test_lora_ref_does_not_pin_a_model_it_leaves_unchanged(pack_lora):
    """A LoRA with nothing for the transformer (text encoder only): get() gives the model itself,
    and the handle's per-model cache must not keep it alive once its owner lets go (POST /free)."""
    import gc
    import weakref

    node_mod, _ = pack_lora
    te_only = load_lora({"text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 96),
                         "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(96, 4)})
    holder = _Ref(tiny_transformer())
    handle = node_mod.LoRAModelRef(holder, [(te_only, 1.0)])
    assert handle.get() is holder.model
    alive = weakref.ref(holder.model)
    holder.model = None  # the pack's cache releases the transformer
    gc.collect()
    assert alive() is None, "the LoRA handle pins a model it did not patch"


def test_merge_into_fp8_weights_recomputes_the_scale(tmp_path, parity):
    from klein_core.quant.fp8 import FP8Linear, dequantize
    from klein_core.testing import tiny_transformer

    torch.manual_seed(5)
    sd = {k: v.contiguous() for k, v in tiny_transformer().state_dict().items()}
    save_file(sd, tmp_path / "base.safetensors")
    names = {"double_blocks.0.img_attn.proj": (64, 64), "single_blocks.1.linear1": (576, 64)}
    lora_sd = {}
    for name, (out_f, in_f) in names.items():
        lora_sd[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(4, in_f) * 0.3
        lora_sd[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(out_f, 4) * 0.3
    save_file(lora_sd, tmp_path / "lora.safetensors")
    lora = load_lora(tmp_path / "lora.safetensors")

    q = load_transformer(tmp_path / "base.safetensors", quantize="fp8")
    mods = dict(q.named_modules())
    assert all(isinstance(mods[n], FP8Linear) for n in names)
    before = {n: (mods[n].weight.detach().clone(), mods[n].weight_scale.clone()) for n in names}
    handle = apply_loras(q, [(lora, 0.7)])
    for name in names:
        m, (w0, s0) = mods[name], before[name]
        expect = dequantize(w0, s0) + 0.7 * lora_sd[f"diffusion_model.{name}.lora_B.weight"] @ lora_sd[
            f"diffusion_model.{name}.lora_A.weight"]
        got = dequantize(m.weight, m.weight_scale)
        assert not torch.equal(m.weight_scale, s0)  # the scale was recomputed for the merged weight
        assert m.weight.dtype == torch.float8_e4m3fn
        # e4m3 keeps 3 mantissa bits: every element within half a step of its value
        bound = expect.abs() * 2**-4 + m.weight_scale * 2**-9
        assert bool(((got - expect).abs() <= bound + 1e-7).all())
        parity(f"LoRA fp8 merge, {name}, max abs vs exact float merge", (got - expect).abs().max().item())
    x = torch.randn(1, 24, 128)
    ids = position_ids(4, 6)
    txt, tids = torch.randn(1, 5, 96), text_position_ids(5)
    with torch.no_grad():
        merged_out = q(img=x, img_ids=ids, txt=txt, txt_ids=tids, timesteps=torch.tensor([0.5]))
    handle.remove()
    for name in names:  # bit-exact restore of the fp8 bytes and the scale
        m, (w0, s0) = mods[name], before[name]
        assert torch.equal(m.weight.view(torch.uint8), w0.view(torch.uint8)) and torch.equal(m.weight_scale, s0)
    branch = apply_loras(q, [(lora, 0.7)], mode="branch")
    with torch.no_grad():
        branch_out = q(img=x, img_ids=ids, txt=txt, txt_ids=tids, timesteps=torch.tensor([0.5]))
    branch.remove()
    with torch.no_grad():
        base_out = q(img=x, img_ids=ids, txt=txt, txt_ids=tids, timesteps=torch.tensor([0.5]))
    effect = ((merged_out - base_out).norm() / base_out.norm()).item()
    rel = ((branch_out - merged_out).norm() / merged_out.norm()).item()
    parity("LoRA fp8: branch vs merge output, relative L2", rel)
    # measured 1.6e-3, with a LoRA that moves the output 4.7%: a LoRA that did nothing would fail
    assert rel < min(4e-3, effect / 4), (rel, effect)


def test_dora_on_fp8_weights_rescales_the_dequantized_weight(tmp_path, parity):
    """DoRA on FP8Linear layers: the magnitude rescales the weight as it computes (float8 times its
    scale), merged and re-quantised, or kept dense as a branch; both against the same LoRA merged
    into a float model holding those dequantised weights."""
    from klein_core.quant.fp8 import dequantize
    from klein_core.testing import tiny_transformer

    torch.manual_seed(6)
    sd = {k: v.contiguous() for k, v in tiny_transformer().state_dict().items()}
    save_file(sd, tmp_path / "base.safetensors")
    q = load_transformer(tmp_path / "base.safetensors", quantize="fp8")
    mods = dict(q.named_modules())
    g = torch.Generator().manual_seed(7)
    lora_sd = {}
    for name, axis in (("double_blocks.0.img_attn.proj", 1), ("single_blocks.1.linear1", 0)):
        w = dequantize(mods[name].weight, mods[name].weight_scale)
        out_f, in_f = w.shape
        key = f"diffusion_model.{name}"
        lora_sd[f"{key}.lora_A.weight"] = torch.randn(4, in_f, generator=g) * 0.3
        lora_sd[f"{key}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.3
        norms = w.norm(dim=axis, keepdim=True)
        lora_sd[f"{key}.dora_scale"] = norms * (0.5 + torch.rand(norms.shape, generator=g))
    lora = load_lora(lora_sd)
    exact = load_transformer(tmp_path / "base.safetensors")
    with torch.no_grad():
        for name, m in exact.named_modules():
            if name in mods and hasattr(mods[name], "weight_scale"):
                m.weight.copy_(dequantize(mods[name].weight, mods[name].weight_scale))
    ids, tids = position_ids(4, 6), text_position_ids(5)
    x, txt = torch.randn(1, 24, 128, generator=g), torch.randn(1, 5, 96, generator=g)

    def run(model):
        with torch.no_grad():
            return model(img=x, img_ids=ids, txt=txt, txt_ids=tids, timesteps=torch.tensor([0.5]))

    base_out = run(exact)
    apply_loras(exact, [(lora, 0.7)])
    want = run(exact)
    with apply_loras(q, [(lora, 0.7)]):
        for name in ("double_blocks.0.img_attn.proj", "single_blocks.1.linear1"):
            got = dequantize(mods[name].weight, mods[name].weight_scale)
            expect = exact.get_submodule(name).weight
            bound = expect.abs() * 2**-4 + mods[name].weight_scale * 2**-9  # half an e4m3 step
            assert bool(((got - expect).abs() <= bound + 1e-7).all())
        merged_rel = ((run(q) - want).norm() / want.norm()).item()
    with apply_loras(q, [(lora, 0.7)], mode="branch"):
        branch = run(q)
    branch_rel = ((branch - want).norm() / want.norm()).item()
    effect = ((want - base_out).norm() / base_out.norm()).item()
    parity("DoRA fp8 merge vs float merge of the dequantised weights, output relative L2", merged_rel)
    parity("DoRA fp8 branch vs float merge of the dequantised weights, output relative L2", branch_rel)
    # measured 6.3e-5 and 5.4e-4; a branch or merge that dropped the magnitudes would be off by the effect
    assert branch_rel < min(5e-4, effect / 4) and merged_rel < min(3e-3, effect / 2), (branch_rel, merged_rel, effect)
