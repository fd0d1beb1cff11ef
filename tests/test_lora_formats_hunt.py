"""LoRA formats hunt: the formats users bring (A5/D5), checked against independent maths (float64),
ComfyUI 0.3.75's own LoRA code (``comfy.lora.load_lora`` + ``calculate_weight``) and PEFT's merge.

Tests whose docstring starts with "BUG:" fail on the code they were written against; the others
pin behaviour no other test covers.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from extras import require
from safetensors.torch import save_file
from tiny_reference import tiny_diffusers_transformer

from klein_core.lora import apply_loras, check_loras, load_lora, with_loras
from klein_core.testing import tiny_text_encoder, tiny_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QKV = "double_blocks.0.img_attn.qkv"  # [192, 64] on the tiny model
PROJ = "double_blocks.0.img_attn.proj"  # [64, 64]
L1 = "single_blocks.0.linear1"  # [576, 64]: q, k, v, mlp gate, mlp up
L2 = "single_blocks.0.linear2"  # [64, 256]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _rand(g: torch.Generator, *shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


# ---------------------------------------------------------------------------------------------
# Transformer names: every Flux2 diffusers linear in Kohya-style flat names (OneTrainer, Kohya, LyCORIS)


# OneTrainer's "full" diffusers-format LoRA (A5: "fails (missing layers)" in ComfyUI) adapts every
# linear; flat (underscore) module path -> (core module, q/k/v third or "swap" for norm_out).
_FLAT_DIFFUSERS = {
    "transformer_blocks_0_attn_to_q": (QKV, 0),
    "transformer_blocks_0_attn_to_k": (QKV, 1),
    "transformer_blocks_0_attn_to_v": (QKV, 2),
    "transformer_blocks_0_attn_add_k_proj": ("double_blocks.0.txt_attn.qkv", 1),
    "transformer_blocks_0_attn_to_out_0": (PROJ, None),
    "transformer_blocks_0_attn_to_add_out": ("double_blocks.0.txt_attn.proj", None),
    "transformer_blocks_0_ff_linear_in": ("double_blocks.0.img_mlp.0", None),
    "transformer_blocks_0_ff_context_linear_out": ("double_blocks.0.txt_mlp.2", None),
    "single_transformer_blocks_1_attn_to_qkv_mlp_proj": ("single_blocks.1.linear1", None),
    "single_transformer_blocks_0_attn_to_out": (L2, None),
    "x_embedder": ("img_in", None),
    "context_embedder": ("txt_in", None),
    "time_guidance_embed_timestep_embedder_linear_1": ("time_in.in_layer", None),
    "time_guidance_embed_timestep_embedder_linear_2": ("time_in.out_layer", None),
    "double_stream_modulation_img_linear": ("double_stream_modulation_img.lin", None),
    "single_stream_modulation_linear": ("single_stream_modulation.lin", None),
    "proj_out": ("final_layer.linear", None),
    "norm_out_linear": ("final_layer.adaLN_modulation.1", "swap"),
}


@pytest.mark.parametrize("prefix", ["lora_transformer_", "lora_unet_", "lycoris_"])
def test_full_diffusers_names_in_flat_form_land_on_the_right_rows(prefix):
    """OneTrainer (``lora_transformer_``), Kohya (``lora_unet_``) and SimpleTuner/LyCORIS (``lycoris_``)
    files in flat diffusers names, covering every Flux2 linear kind: bf16 factors, alpha stored as a
    ``[1]`` bf16 tensor, strength -0.7. Each split q/k/v lands on its third of the fused qkv, diffusers'
    ``norm_out`` rows are swapped to BFL's order; every key is used and the merged weights equal
    ``W + s * alpha / rank * up @ down`` computed in float64 from the stored (bf16) values."""
    g = torch.Generator().manual_seed(0)
    w = {n: t.double() for n, t in _weights(tiny_transformer()).items()}
    expected = {n: t.clone() for n, t in w.items()}
    sd: dict[str, torch.Tensor] = {}
    strength, rank, alpha = -0.7, 4, 2.0
    for path, (core, part) in _FLAT_DIFFUSERS.items():
        out, inp = w[core].shape
        if isinstance(part, int):
            out //= 3
        down = _rand(g, rank, inp).to(torch.bfloat16)
        up = _rand(g, out, rank).to(torch.bfloat16)
        sd[f"{prefix}{path}.lora_down.weight"] = down
        sd[f"{prefix}{path}.lora_up.weight"] = up
        sd[f"{prefix}{path}.alpha"] = torch.tensor([alpha], dtype=torch.bfloat16)
        d = strength * alpha / rank * (up.double() @ down.double())
        if part == "swap":
            first, second = d.chunk(2)
            d = torch.cat([second, first])
        if isinstance(part, int):
            expected[core][part * out:(part + 1) * out] += d
        else:
            expected[core] += d
    lora = load_lora(sd)
    assert not lora.skipped and len(lora.patches) == len(_FLAT_DIFFUSERS)
    model = tiny_transformer()
    apply_loras(model, [(lora, strength)])
    worst = max((model.get_submodule(n).weight.double() - expected[n]).abs().max().item() for n in w)
    assert worst < 1e-6, f"{prefix}: max abs diff {worst:.3e} against the float64 merge"


def test_keys_with_transformer_and_diffusion_model_prefixes_in_one_file_all_apply():
    """A file mixing ``transformer.`` (diffusers) and ``diffusion_model.`` (BFL) keys for different
    modules, and a ``model.diffusion_model.`` one: all three applied, none skipped."""
    g = torch.Generator().manual_seed(1)
    w = _weights(tiny_transformer())
    a1, b1 = _rand(g, 2, 64), _rand(g, 64, 2)
    a2, b2 = _rand(g, 2, 256), _rand(g, 64, 2)
    a3, b3 = _rand(g, 2, 128), _rand(g, 64, 2)
    sd = {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": a1,
          "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": b1,
          f"diffusion_model.{L2}.lora_A.weight": a2, f"diffusion_model.{L2}.lora_B.weight": b2,
          "model.diffusion_model.img_in.lora_A.weight": a3, "model.diffusion_model.img_in.lora_B.weight": b3}
    lora = load_lora(sd)
    assert not lora.skipped and len(lora.patches) == 3
    model = tiny_transformer()
    apply_loras(model, lora)
    want_qkv = w[QKV].clone()
    want_qkv[64:128] += b1 @ a1
    assert (model.get_submodule(QKV).weight - want_qkv).abs().max().item() < 1e-6
    assert (model.get_submodule(L2).weight - (w[L2] + b2 @ a2)).abs().max().item() < 1e-6
    assert (model.get_submodule("img_in").weight - (w["img_in"] + b3 @ a3)).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
def test_low_precision_lora_files_merge_and_branch_as_stored(tmp_path, dtype):
    """LoRA files stored in float8 (some trainers' "fp8 LoRAs") or fp16, alpha in the same dtype: the
    stored values are used as they are (upcast, not refused), merged and as a branch."""
    g = torch.Generator().manual_seed(2)
    a, b = _rand(g, 4, 64), _rand(g, 192, 4)
    sd = {f"diffusion_model.{QKV}.lora_down.weight": a.to(dtype), f"diffusion_model.{QKV}.lora_up.weight": b.to(dtype),
          f"diffusion_model.{QKV}.alpha": torch.tensor(2.0).to(dtype)}
    save_file(sd, tmp_path / "l.safetensors")
    lora = load_lora(tmp_path / "l.safetensors")
    w = _weights(tiny_transformer())[QKV].double()
    expected = w + (b.to(dtype).double() @ a.to(dtype).double()) * 2.0 / 4
    model = tiny_transformer()
    apply_loras(model, lora)
    assert (model.get_submodule(QKV).weight.double() - expected).abs().max().item() < 1e-6
    x = _rand(torch.Generator().manual_seed(3), 3, 64, scale=1.0)
    branch = with_loras(tiny_transformer(), lora).get_submodule(QKV)(x)
    assert (branch.double() - x.double() @ expected.T).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# LyCORIS LoKr / LoHa / DoRA against ComfyUI's own weight adapters


def _comfy_merged(sd: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], strength: float,
                  caplog) -> dict[str, torch.Tensor]:
    """ComfyUI 0.3.75's ``load_lora`` + ``calculate_weight`` on ``weights`` (core names), with the
    key map ComfyUI builds for a model whose state dict is ``diffusion_model.<core name>.weight``."""
    import comfy.lora

    to_load = {}
    for n in weights:
        to_load[f"diffusion_model.{n}"] = f"diffusion_model.{n}.weight"
        to_load["lora_unet_" + n.replace(".", "_")] = f"diffusion_model.{n}.weight"
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(sd, to_load)
    assert "not loaded" not in caplog.text, caplog.text
    out = {}
    for key, patch in patches.items():
        n = key[len("diffusion_model."):-len(".weight")]
        out[n] = comfy.lora.calculate_weight([(strength, patch, 1.0, None, None)], weights[n].clone(), key)
    return out


def test_factorised_lokr_variants_match_comfyui(comfy_pack, caplog, parity):
    """LyCORIS LoKr in its three factorised forms, alpha as a 0-d tensor: both factors decomposed with
    different ranks (w1_b rank 2, w2_b rank 3: the scale is alpha / rank of w2), w1 full with w2
    decomposed, and w1 decomposed with w2 full (alpha / rank of w1). Merged weights against ComfyUI's
    LoKrAdapter and against float64 maths, at strength 0.8; the branch against the merge."""
    g = torch.Generator().manual_seed(4)
    w = _weights(tiny_transformer())
    sd = {
        f"diffusion_model.{QKV}.lokr_w1_a": _rand(g, 4, 2), f"diffusion_model.{QKV}.lokr_w1_b": _rand(g, 2, 8),
        f"diffusion_model.{QKV}.lokr_w2_a": _rand(g, 48, 3), f"diffusion_model.{QKV}.lokr_w2_b": _rand(g, 3, 8),
        f"diffusion_model.{QKV}.alpha": torch.tensor(5.0),
        f"diffusion_model.{L1}.lokr_w1": _rand(g, 8, 8), f"diffusion_model.{L1}.lokr_w2_a": _rand(g, 72, 2),
        f"diffusion_model.{L1}.lokr_w2_b": _rand(g, 2, 8), f"diffusion_model.{L1}.alpha": torch.tensor(1.0),
        f"diffusion_model.{PROJ}.lokr_w1_a": _rand(g, 8, 2), f"diffusion_model.{PROJ}.lokr_w1_b": _rand(g, 2, 4),
        f"diffusion_model.{PROJ}.lokr_w2": _rand(g, 8, 16), f"diffusion_model.{PROJ}.alpha": torch.tensor(3.0),
    }
    s = 0.8
    t = {k: v.double() for k, v in sd.items()}

    def kron(m: str, w1: torch.Tensor, w2: torch.Tensor, scale: float) -> torch.Tensor:
        return w[m].double() + s * scale * torch.kron(w1, w2)

    p = "diffusion_model."
    independent = {
        QKV: kron(QKV, t[f"{p}{QKV}.lokr_w1_a"] @ t[f"{p}{QKV}.lokr_w1_b"],
                  t[f"{p}{QKV}.lokr_w2_a"] @ t[f"{p}{QKV}.lokr_w2_b"], 5.0 / 3),
        L1: kron(L1, t[f"{p}{L1}.lokr_w1"], t[f"{p}{L1}.lokr_w2_a"] @ t[f"{p}{L1}.lokr_w2_b"], 1.0 / 2),
        PROJ: kron(PROJ, t[f"{p}{PROJ}.lokr_w1_a"] @ t[f"{p}{PROJ}.lokr_w1_b"], t[f"{p}{PROJ}.lokr_w2"], 3.0 / 2),
    }
    comfy = _comfy_merged(sd, w, s, caplog)
    lora = load_lora(sd)
    assert not lora.skipped and lora.format == "ai-toolkit/BFL LoKr"
    model = tiny_transformer()
    apply_loras(model, [(lora, s)])
    branch = with_loras(tiny_transformer(), [(lora, s)])
    worst_comfy = worst_math = worst_branch = 0.0
    for n, want in independent.items():
        ours = model.get_submodule(n).weight
        worst_comfy = max(worst_comfy, (ours - comfy[n]).abs().max().item())
        worst_math = max(worst_math, (ours.double() - want).abs().max().item())
        x = _rand(g, 3, w[n].shape[1], scale=1.0)
        worst_branch = max(worst_branch, (branch.get_submodule(n)(x) - model.get_submodule(n)(x)).abs().max().item())
    parity("LoRA formats hunt: factorised LoKr vs ComfyUI", worst_comfy)
    assert worst_comfy < 1e-5 and worst_math < 1e-5 and worst_branch < 1e-5, (worst_comfy, worst_math, worst_branch)


def test_loha_with_dora_scale_matches_comfyui(comfy_pack, caplog, parity):
    """Kohya-named LoHa with a LyCORIS ``dora_scale`` per output row (fused qkv, linear2) and per
    input column (proj), alpha 2, strength 0.7: merged weights against ComfyUI's LoHaAdapter +
    weight_decompose; the branch against the merge on each module's output."""
    g = torch.Generator().manual_seed(5)
    w = _weights(tiny_transformer())
    sd = {}
    for n, axis in ((QKV, "out"), (PROJ, "in"), (L2, "out")):
        out, inp = w[n].shape
        k = "lora_unet_" + n.replace(".", "_")
        sd.update({f"{k}.hada_w1_a": _rand(g, out, 3), f"{k}.hada_w1_b": _rand(g, 3, inp),
                   f"{k}.hada_w2_a": _rand(g, out, 3), f"{k}.hada_w2_b": _rand(g, 3, inp),
                   f"{k}.alpha": torch.tensor(2.0)})
        norms = w[n].norm(dim=1, keepdim=True) if axis == "out" else w[n].norm(dim=0, keepdim=True)
        sd[f"{k}.dora_scale"] = norms * (0.5 + torch.rand(norms.shape, generator=g))
    s = 0.7
    comfy = _comfy_merged(sd, w, s, caplog)
    lora = load_lora(sd)
    assert not lora.skipped and {p.dora for p in lora.patches} == {"comfyui"}
    model = tiny_transformer()
    apply_loras(model, [(lora, s)])
    branch = with_loras(tiny_transformer(), [(lora, s)])
    worst = worst_branch = 0.0
    for n in comfy:
        worst = max(worst, (model.get_submodule(n).weight - comfy[n]).abs().max().item())
        assert (comfy[n] - w[n]).abs().max().item() > 0.05  # the LoRA does something
        x = _rand(g, 3, w[n].shape[1], scale=1.0)
        worst_branch = max(worst_branch, (branch.get_submodule(n)(x) - model.get_submodule(n)(x)).abs().max().item())
    parity("LoRA formats hunt: LoHa + dora_scale vs ComfyUI", worst)
    assert worst < 1e-5 and worst_branch < 1e-5, (worst, worst_branch)


# ---------------------------------------------------------------------------------------------
# diffusers / PEFT files against PEFT's own merge


def _peft_file(cfg, seed: int = 3):
    """A tiny diffusers Flux2 transformer with PEFT's adapter ``cfg`` (random factors), its adapter
    state dict under ``transformer.`` with diffusers' ``lora_adapter_metadata``, the base state dict
    and the core transformer loaded from PEFT's merged weights (the reference)."""
    require("diffusers")
    require("peft")
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict

    from klein_core.files.loaders import load_transformer

    dm = tiny_diffusers_transformer()
    base = {k: v.clone().contiguous() for k, v in dm.state_dict().items()}
    torch.manual_seed(seed)
    inject_adapter_in_model(cfg, dm)
    g = torch.Generator().manual_seed(seed)
    adapter = ("lokr_", "hada_", "lora_")
    with torch.no_grad():
        for n, p in dm.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif any(s in n for s in adapter):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    sd = {"transformer." + k: v.contiguous() for k, v in get_peft_model_state_dict(dm).items()}
    conf = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()}
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in conf.items()}, default=str)}
    for m in dm.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    merged = {k.replace(".base_layer", ""): v for k, v in dm.state_dict().items() if not any(s in k for s in adapter)}
    return sd, meta, base, load_transformer(merged)


def _worst_vs(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    return max((m.weight - ref.get_submodule(n).weight).abs().max().item()
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("case", ["r4_alpha8", "decompose_both", "patterns"])
def test_peft_lokr_with_diffusers_metadata_matches_peft_merge(case, parity):
    """PEFT LoKr (diffusers' ``lokr_w*`` layout, ``lora_adapter_metadata`` holding the LoKrConfig):
    the scale is PEFT's ``alpha / r`` per module (rank_pattern / alpha_pattern included), on split q/k/v
    and the fused single-block projection; merged weights equal PEFT's own merge."""
    peft = require("peft")
    from klein_core.files.loaders import load_transformer

    cfg = {
        "r4_alpha8": peft.LoKrConfig(r=4, alpha=8, target_modules=["to_q", "to_k", "to_qkv_mlp_proj", "linear_in"]),
        "decompose_both": peft.LoKrConfig(r=2, alpha=3, decompose_both=True,
                                          target_modules=["to_q", "to_out.0", "to_qkv_mlp_proj"]),
        "patterns": peft.LoKrConfig(r=2, alpha=3, target_modules=["to_q", "to_v"], rank_pattern={"to_v": 4},
                                    alpha_pattern={"to_v": 1}),
    }[case]
    sd, meta, base, ref = _peft_file(cfg)
    lora = load_lora(sd, metadata=meta)
    assert not lora.skipped and lora.format == "diffusers/PEFT LoKr"
    model = load_transformer(base)
    apply_loras(model, lora)
    assert _worst_vs(load_transformer(base), ref) > 0.1  # the adapter changes the weights
    worst = parity(f"LoRA formats hunt: PEFT LoKr ({case}) vs PEFT merge", _worst_vs(model, ref))
    assert worst < 1e-5


def test_peft_loha_with_diffusers_metadata_uses_alpha_over_r(parity):
    """Was a bug: a PEFT LoHa file (``hada_w*`` factors, ``lora_adapter_metadata`` holding PEFT's LoHaConfig
    with ``r=4, alpha=8``) is applied at scale 1.0 instead of PEFT's ``alpha / r`` = 2.0: the LoHa
    branch of ``_build_patch`` (klein_core/lora/read.py) reads only a ``.alpha`` key and never looks
    at the metadata, while the LoRA and LoKr branches do. The user sees the LoHa at half its strength
    (measured: 0.53 max abs diff on the merged weights against PEFT's own merge, whose change is 1.06)."""
    peft = require("peft")
    from klein_core.files.loaders import load_transformer

    sd, meta, base, ref = _peft_file(peft.LoHaConfig(r=4, alpha=8, target_modules=["to_q", "to_k", "to_qkv_mlp_proj"]))
    lora = load_lora(sd, metadata=meta)
    assert not lora.skipped and lora.format == "diffusers/PEFT LoHa"
    model = load_transformer(base)
    apply_loras(model, lora)
    worst = parity("LoRA formats hunt: PEFT LoHa (r 4, alpha 8) vs PEFT merge", _worst_vs(model, ref))
    assert worst < 1e-5, (f"PEFT LoHa merged {worst:.3e} away from PEFT's merge; patch scales "
                          f"{sorted({p.scale for p in lora.patches})}, PEFT's alpha / r = 2.0")


def test_dora_magnitude_spelled_lora_magnitude_vector_weight_is_applied(parity):
    """Was a bug: a PEFT DoRA file whose magnitudes are stored as ``<module>.lora_magnitude_vector.weight``
    (PEFT's module state-dict spelling, the one SimpleTuner / HF exports write, which OneTrainer and
    InvokeAI read as the DoRA magnitude) loads as a plain LoRA: ``split_key`` (klein_core/lora/formats.py)
    knows ``lora_magnitude_vector`` and ``lora_magnitude_vector.default.weight`` only, so the
    magnitudes are skipped as "not a LoRA tensor (unknown suffix)" and the LoRA is applied without
    them. The user gets a different model than the DoRA trained (measured: 0.52 max abs diff on
    the merged weights against PEFT's merge, whose whole change is 0.64); the same file with the
    ``lora_magnitude_vector`` spelling matches PEFT's merge (checked here first)."""
    peft = require("peft")
    from klein_core.files.loaders import load_transformer

    sd, _meta, base, ref = _peft_file(peft.LoraConfig(r=2, lora_alpha=2, use_dora=True,
                                                     target_modules=["to_k", "to_out.0"]), seed=5)
    change = _worst_vs(load_transformer(base), ref)
    control = load_transformer(base)  # PEFT's saved spelling, ".lora_magnitude_vector": applied
    apply_loras(control, load_lora(sd))
    assert _worst_vs(control, ref) < 1e-5 and change > 0.1
    spelled = {(k + ".weight" if k.endswith(".lora_magnitude_vector") else k): v for k, v in sd.items()}
    assert any(k.endswith(".lora_magnitude_vector.weight") for k in spelled)
    lora = load_lora(spelled)
    model = load_transformer(base)
    apply_loras(model, lora)
    worst = parity("LoRA formats hunt: DoRA with lora_magnitude_vector.weight vs PEFT merge", _worst_vs(model, ref))
    assert worst < 1e-5 and not lora.skipped, (
        f"{worst:.3e} from PEFT's merge (the DoRA's whole change: {change:.3e}); not applied: "
        f"{list(lora.skipped.items())[:1]}")


# ---------------------------------------------------------------------------------------------
# Text encoder names


@pytest.mark.parametrize("style", ["kohya_te1", "kohya_te", "kohya_te_no_model", "onetrainer_te1", "diffusers",
                                   "peft", "comfyui"])
def test_text_encoder_name_styles_land_on_the_same_modules(style):
    """Text-encoder LoRAs in every naming users bring (``lora_te1_model_layers_…``, ``lora_te_…``,
    without the ``model_`` part, ``text_encoder.model.…``, PEFT's ``base_model.model.model.…``,
    ComfyUI's ``text_encoders.qwen3_4b.transformer.model.…``), on q/k (GQA: k is narrower), gate and
    down projections incl. layer 26 (the last one Klein runs): all applied to the right modules,
    ``W + s * alpha / rank * up @ down``."""
    names = {
        "kohya_te1": lambda n: ("lora_te1_model_" + n.replace(".", "_"), "lora_down.weight", "lora_up.weight"),
        "kohya_te": lambda n: ("lora_te_model_" + n.replace(".", "_"), "lora_down.weight", "lora_up.weight"),
        "kohya_te_no_model": lambda n: ("lora_te_" + n.replace(".", "_"), "lora_down.weight", "lora_up.weight"),
        "onetrainer_te1": lambda n: ("lora_te1_" + n.replace(".", "_"), "lora_down.weight", "lora_up.weight"),
        "diffusers": lambda n: ("text_encoder.model." + n, "lora_A.weight", "lora_B.weight"),
        "peft": lambda n: ("base_model.model.model." + n, "lora_A.weight", "lora_B.weight"),
        "comfyui": lambda n: ("text_encoders.qwen3_4b.transformer.model." + n, "lora_A.weight", "lora_B.weight"),
    }[style]
    g = torch.Generator().manual_seed(6)
    w = _weights(tiny_text_encoder())
    expected = {n: t.clone() for n, t in w.items()}
    sd = {}
    for n in ("layers.0.self_attn.q_proj", "layers.3.self_attn.k_proj", "layers.26.mlp.down_proj",
              "layers.5.mlp.gate_proj"):
        out, inp = w[n].shape
        a, b = _rand(g, 2, inp), _rand(g, out, 2)
        path, down, up = names(n)
        sd[f"{path}.{down}"], sd[f"{path}.{up}"] = a, b
        sd[f"{path}.alpha"] = torch.tensor(1.0)
        expected[n] += 0.5 * (1.0 / 2) * (b @ a)
    lora = load_lora(sd)
    assert lora.targets == ("text_encoder",) and not lora.skipped and len(lora.patches) == 4
    model = tiny_text_encoder()
    apply_loras(model, [(lora, 0.5)])
    worst = max((model.get_submodule(n).weight - expected[n]).abs().max().item() for n in w)
    assert worst < 1e-6


# ---------------------------------------------------------------------------------------------
# Size mismatch at the real sizes (meta-device models: no weights)


def _size_cases() -> dict[str, dict[str, torch.Tensor]]:
    h = 4096  # Klein 9B
    z = torch.zeros
    return {
        "diffusers to_k": {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": z(1, h),
                           "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": z(h, 1)},
        "kohya linear2": {"lora_unet_single_blocks_0_linear2.lora_down.weight": z(1, 4 * h),
                          "lora_unet_single_blocks_0_linear2.lora_up.weight": z(h, 1)},
        "lycoris lokr to_q": {"lycoris_transformer_blocks_0_attn_to_q.lokr_w1": z(4, 4),
                              "lycoris_transformer_blocks_0_attn_to_q.lokr_w2": z(h // 4, h // 4)},
        "img_in": {"diffusion_model.img_in.lora_A.weight": z(1, 128), "diffusion_model.img_in.lora_B.weight": z(h, 1)},
        "final_layer.linear": {"diffusion_model.final_layer.linear.lora_A.weight": z(1, h),
                               "diffusion_model.final_layer.linear.lora_B.weight": z(128, 1)},
        "txt_in": {"diffusion_model.txt_in.lora_A.weight": z(1, 3 * h), "diffusion_model.txt_in.lora_B.weight": z(h, 1)},
        "time_in.in_layer": {"diffusion_model.time_in.in_layer.lora_A.weight": z(1, 256),
                             "diffusion_model.time_in.in_layer.lora_B.weight": z(h, 1)},
    }


def test_9b_lora_on_4b_is_refused_naming_both_sizes_in_every_format():
    """At the published sizes (meta-device Klein 4B transformer and Qwen3-4B encoder), a Klein 9B LoRA
    in diffusers split-q/k/v, Kohya, LyCORIS LoKr and BFL names, on embedders, output layer and
    time embedder (whose width is on the output side) is refused with the one sentence naming 9B and
    4B; an 8B text-encoder part (Kohya ``lora_te1_`` names, GQA k_proj) names Qwen3-8B and Qwen3-4B."""
    from klein_core.models.qwen3 import Qwen3TextEncoder
    from klein_core.models.transformer import Flux2Transformer
    from klein_core.models.variants import KLEIN_4B
    from klein_core.testing.fill import full_size_configs

    tcfg, ecfg, _ = full_size_configs(KLEIN_4B)
    with torch.device("meta"):
        models = (Flux2Transformer(tcfg), Qwen3TextEncoder(ecfg))
    for label, sd in _size_cases().items():
        with pytest.raises(ValueError) as exc:
            check_loras(models, load_lora(sd))
        assert re.search(r"trained for Klein 9B \(hidden 4096\); the loaded model is Klein 4B", str(exc.value)), (
            label, str(exc.value))
    te = {"lora_te1_model_layers_0_self_attn_k_proj.lora_down.weight": torch.zeros(1, 4096),
          "lora_te1_model_layers_0_self_attn_k_proj.lora_up.weight": torch.zeros(1024, 1)}
    with pytest.raises(ValueError, match=r"text-encoder part was trained for Qwen3-8B.*loaded text encoder is Qwen3-4B"):
        check_loras(models, load_lora(te))


# ---------------------------------------------------------------------------------------------
# Reporting keys that are not applied


def test_not_applied_warning_names_each_file_when_two_loras_are_stacked(tmp_path, caplog):
    """Was a bug: two LoRA files, each with a text-encoder part under the same (diffusers) key names, applied
    to the transformer alone: ``_plan`` (klein_core/lora/apply.py) collects the keys it does not
    apply in one dict keyed by key name only and logs it as ``"LoRA: 2 keys not applied ..."``. The
    warning names neither file, and the second file's keys overwrite the first's, so it reports 2
    keys where 4 (2 per file) were not applied, and ``handle.skipped`` loses one file's entries.
    The user cannot tell which LoRA's text-encoder part was dropped."""
    g = torch.Generator().manual_seed(7)
    paths = []
    for name in ("style_a.safetensors", "style_b.safetensors"):
        sd = {"diffusion_model.img_in.lora_A.weight": _rand(g, 2, 128),
              "diffusion_model.img_in.lora_B.weight": _rand(g, 64, 2),
              "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": _rand(g, 2, 32),
              "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": _rand(g, 32, 2)}
        save_file(sd, tmp_path / name)
        paths.append(tmp_path / name)
    loras = [(load_lora(p), 1.0) for p in paths]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        handle = apply_loras(tiny_transformer(), loras)
    text = caplog.text
    assert "keys not applied" in text
    missing = [p.name for p in paths if p.name not in text]
    assert not missing, f"the not-applied warning does not name {missing}: {text.strip()}"
    assert len(handle.skipped) == 4 and text.count("2 keys not applied") == 2, (
        f"4 keys (2 per file) were not applied; reported: {len(handle.skipped)} in handle.skipped, "
        f"warning: {text.strip()}")
    assert sorted(Path(k.split(": ")[0]).name for k in handle.skipped) == ["style_a.safetensors"] * 2 + [
        "style_b.safetensors"] * 2, list(handle.skipped)


def test_bias_deltas_and_unsupported_suffixes_are_reported_not_silently_dropped(caplog):
    """Keys with nothing to land on (LyCORIS ``.diff_b`` bias deltas, PEFT ``lora_B.bias``, a norm
    layer's ``w_norm``) are each listed in ``LoRA.skipped`` with a reason and
    logged by name as a warning naming the file, while the module's factors still apply."""
    g = torch.Generator().manual_seed(8)
    a, b = _rand(g, 2, 64), _rand(g, 64, 2)
    sd = {f"diffusion_model.{PROJ}.lora_A.weight": a, f"diffusion_model.{PROJ}.lora_B.weight": b,
          f"diffusion_model.{PROJ}.lora_B.bias": _rand(g, 64),
          f"diffusion_model.{PROJ}.diff_b": _rand(g, 64),
          "lycoris_transformer_blocks_0_attn_norm_q.w_norm": _rand(g, 32)}
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        lora = load_lora(sd)
    assert set(lora.skipped) == {f"diffusion_model.{PROJ}.lora_B.bias", f"diffusion_model.{PROJ}.diff_b",
                                 "lycoris_transformer_blocks_0_attn_norm_q.w_norm"}
    for key in lora.skipped:
        assert key in caplog.text
    assert "<in-memory LoRA>" in caplog.text
    model = tiny_transformer()
    w = model.get_submodule(PROJ).weight.detach().clone()
    apply_loras(model, lora)
    assert (model.get_submodule(PROJ).weight - (w + b @ a)).abs().max().item() < 1e-6
