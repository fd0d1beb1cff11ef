"""Parity of klein_core's Flux2 transformer with diffusers' Flux2Transformer2DModel.

A tiny random diffusers model is saved in every layout users meet (BFL/ComfyUI file, with and
without ``model.diffusion_model.``, diffusers single file, diffusers sharded repo folder, state
dict), loaded through ``load_transformer``, and run on the same inputs: noisy tokens on a
non-square grid plus reference tokens at t=10 and t=20, per-item timesteps.
"""

from __future__ import annotations

import json

import pytest
import torch
from extras import require
from safetensors.torch import save_file
from tiny_reference import CTX, tiny_diffusers_transformer

import klein_core
from klein_core.files.loaders import load_transformer
from klein_core.models.transformer import TransformerConfig
from klein_core.pipeline.sampling import position_ids, text_position_ids

diffusers = require("diffusers")



def _tiny_diffusers(seed: int = 0):
    return tiny_diffusers_transformer(seed)


# Test-local copy of the BFL <-> diffusers table (SPEC §1.5), written independently of the loader.
def _to_bfl(sd: dict[str, torch.Tensor], n_double: int, n_single: int) -> dict[str, torch.Tensor]:
    out = {
        "img_in.weight": sd["x_embedder.weight"],
        "txt_in.weight": sd["context_embedder.weight"],
        "time_in.in_layer.weight": sd["time_guidance_embed.timestep_embedder.linear_1.weight"],
        "time_in.out_layer.weight": sd["time_guidance_embed.timestep_embedder.linear_2.weight"],
        "double_stream_modulation_img.lin.weight": sd["double_stream_modulation_img.linear.weight"],
        "double_stream_modulation_txt.lin.weight": sd["double_stream_modulation_txt.linear.weight"],
        "single_stream_modulation.lin.weight": sd["single_stream_modulation.linear.weight"],
        "final_layer.linear.weight": sd["proj_out.weight"],
    }
    scale, shift = sd["norm_out.linear.weight"].chunk(2)
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    for i in range(n_double):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out[b + "img_attn.qkv.weight"] = torch.cat([sd[d + f"attn.to_{x}.weight"] for x in "qkv"])
        out[b + "txt_attn.qkv.weight"] = torch.cat([sd[d + f"attn.add_{x}_proj.weight"] for x in "qkv"])
        out[b + "img_attn.norm.query_norm.scale"] = sd[d + "attn.norm_q.weight"]
        out[b + "img_attn.norm.key_norm.scale"] = sd[d + "attn.norm_k.weight"]
        out[b + "txt_attn.norm.query_norm.scale"] = sd[d + "attn.norm_added_q.weight"]
        out[b + "txt_attn.norm.key_norm.scale"] = sd[d + "attn.norm_added_k.weight"]
        out[b + "img_attn.proj.weight"] = sd[d + "attn.to_out.0.weight"]
        out[b + "txt_attn.proj.weight"] = sd[d + "attn.to_add_out.weight"]
        out[b + "img_mlp.0.weight"] = sd[d + "ff.linear_in.weight"]
        out[b + "img_mlp.2.weight"] = sd[d + "ff.linear_out.weight"]
        out[b + "txt_mlp.0.weight"] = sd[d + "ff_context.linear_in.weight"]
        out[b + "txt_mlp.2.weight"] = sd[d + "ff_context.linear_out.weight"]
    for i in range(n_single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out[b + "linear1.weight"] = sd[d + "attn.to_qkv_mlp_proj.weight"]
        out[b + "linear2.weight"] = sd[d + "attn.to_out.weight"]
        out[b + "norm.query_norm.scale"] = sd[d + "attn.norm_q.weight"]
        out[b + "norm.key_norm.scale"] = sd[d + "attn.norm_k.weight"]
    assert len(out) == len(sd) - 4 * n_double  # q/k/v (x2) fused into qkv (x2) per double block
    return {k: v.contiguous() for k, v in out.items()}


def _inputs(batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([position_ids(4, 6), position_ids(2, 3, t=10), position_ids(3, 2, t=20)])
    n_noisy = 24
    img = torch.randn(batch, ids.shape[0], 8, generator=g)
    txt = torch.randn(batch, 7, CTX, generator=g)
    t = torch.tensor([0.9, 0.35][:batch])
    return img, ids, txt, text_position_ids(7), t, n_noisy


@pytest.fixture(scope="module")
def reference():
    model = _tiny_diffusers()
    img, ids, txt, tids, t, n = _inputs()
    with torch.no_grad():
        out = model(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                    return_dict=False)[0]
    return model, out


@pytest.fixture(scope="module")
def layouts(reference, tmp_path_factory):
    model, _ = reference
    d = tmp_path_factory.mktemp("transformer")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    bfl = _to_bfl(sd, 2, 2)
    save_file(bfl, d / "flux-2-klein-tiny.safetensors")
    save_file({"model.diffusion_model." + k: v for k, v in bfl.items()}, d / "comfy_prefixed.safetensors")
    save_file(sd, d / "diffusion_pytorch_model.safetensors")
    model.save_pretrained(d / "repo" / "transformer", max_shard_size="20KB", safe_serialization=True)
    return {
        "bfl file": d / "flux-2-klein-tiny.safetensors",
        "comfy prefixed file": d / "comfy_prefixed.safetensors",
        "diffusers file": d / "diffusion_pytorch_model.safetensors",
        "diffusers sharded repo": d / "repo",
        "bfl state dict": bfl,
        "diffusers state dict": sd,
    }


@pytest.mark.parametrize(
    "layout",
    ["bfl file", "comfy prefixed file", "diffusers file", "diffusers sharded repo", "bfl state dict",
     "diffusers state dict"],
)
def test_fp32_parity_every_layout(reference, layouts, layout, parity):
    if layout == "diffusers sharded repo":
        assert len(list((layouts[layout] / "transformer").glob("*.safetensors"))) > 1, "repo must be sharded"
    _, ref = reference
    ours = load_transformer(layouts[layout])
    img, ids, txt, tids, t, _ = _inputs()
    with torch.no_grad():
        out = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)
    diff = parity(f"transformer fp32, {layout}", (out - ref).abs().max().item())
    assert out.shape == ref.shape
    assert diff <= 1e-4, f"{layout}: max abs diff {diff:.3e}"


def test_batched_ids_and_precomputed_rope_match(layouts, reference):
    _, ref = reference
    ours = load_transformer(layouts["bfl file"])
    img, ids, txt, tids, t, _ = _inputs()
    with torch.no_grad():
        a = ours(img=img, img_ids=ids[None].expand(2, -1, -1), txt=txt, txt_ids=tids[None].expand(2, -1, -1),
                 timesteps=t)
        b = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t, rope=ours.rope(tids, ids))
    assert (a - ref).abs().max().item() <= 1e-4
    assert torch.equal(b, ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t))


def test_bf16_close_to_fp32_reference(layouts, reference, parity):
    _, ref = reference
    ours = load_transformer(layouts["bfl file"], dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    img, ids, txt, tids, t, _ = _inputs()
    with torch.no_grad():
        out = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    parity("transformer bf16 (relative L2 vs fp32 reference)", rel)
    assert rel < 0.03, f"bf16 relative error {rel:.4f}"


def test_reference_token_order_irrelevant_given_ids(layouts):
    ours = load_transformer(layouts["bfl file"])
    img, ids, txt, tids, t, n = _inputs()
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)
        b = ours(img=img[:, perm], img_ids=ids[perm], txt=txt, txt_ids=tids, timesteps=t)
    assert (a[:, perm] - b).abs().max().item() < 1e-5


def test_config_inferred_from_shapes_for_real_sizes():
    def shapes(h, d, s, ctx):
        sh = {"img_in.weight": (h, 128), "txt_in.weight": (h, ctx),
              "double_blocks.0.img_attn.norm.query_norm.scale": (128,),
              "double_blocks.0.img_mlp.0.weight": (6 * h, h)}
        sh.update({f"double_blocks.{i}.img_attn.qkv.weight": (3 * h, h) for i in range(d)})
        sh.update({f"single_blocks.{i}.linear1.weight": (9 * h, h) for i in range(s)})
        return sh

    c4 = TransformerConfig.from_shapes(shapes(3072, 5, 20, 7680))
    c9 = TransformerConfig.from_shapes(shapes(4096, 8, 24, 12288))
    assert (c4.variant, c4.num_heads, c4.mlp_hidden, c4.axes_dim, c4.text_dim) == ("Klein 4B", 24, 9216, (32,) * 4, 7680)
    assert (c9.variant, c9.num_heads, c9.mlp_hidden, c9.text_dim) == ("Klein 9B", 32, 12288, 12288)


def test_meta_build_loads_no_random_init(layouts, monkeypatch):
    # Every parameter must come from the file: random init may only ever touch meta tensors
    # (where it costs nothing), never real memory.
    real_kaiming = torch.nn.init.kaiming_uniform_
    touched = []

    def guard(tensor, *a, **k):
        touched.append(tensor.is_meta)
        return real_kaiming(tensor, *a, **k)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", guard)
    model = load_transformer(layouts["bfl file"])
    assert touched and all(touched), "a parameter was initialised outside the meta device"
    assert not any(p.is_meta for p in model.parameters())


def test_errors_name_file_and_keys(layouts, tmp_path):
    bfl = dict(layouts["bfl state dict"])
    missing = {k: v for k, v in bfl.items() if k != "single_blocks.1.linear2.weight"}
    with pytest.raises(ValueError, match=r"single_blocks\.1\.linear2\.weight"):
        load_transformer(missing)
    wrong = dict(bfl)
    wrong["double_blocks.0.img_attn.proj.weight"] = torch.zeros(32, 31)
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"wrong\.safetensors.*double_blocks\.0\.img_attn\.proj\.weight"):
        load_transformer(tmp_path / "wrong.safetensors")
    extra = dict(bfl)
    extra["double_blocks.0.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"Unexpected 1 tensors: 'double_blocks\.0\.extra\.weight'"):
        load_transformer(extra)


def test_refuses_other_models_clearly(tmp_path):
    with pytest.raises(ValueError, match="text encoder"):
        load_transformer({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match="VAE"):
        load_transformer({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)})
    with pytest.raises(ValueError, match="FLUX.1"):
        load_transformer({"double_blocks.0.img_mod.lin.weight": torch.zeros(4, 4)})
    dev = {"single_stream_modulation.lin.weight": torch.zeros(3, 1), "img_in.weight": torch.zeros(1, 128),
           "txt_in.weight": torch.zeros(1, 15360)}
    with pytest.raises(ValueError, match=r"FLUX\.2 \[dev\]"):
        load_transformer(dev)
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04junk")
    with pytest.raises(ValueError, match="pickle"):
        load_transformer(tmp_path / "model.ckpt")


def test_refuses_quantised_files(layouts, tmp_path):
    bfl = dict(layouts["bfl state dict"])
    q = dict(bfl)
    q["img_in.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    q["img_in.weight_scale"] = torch.tensor(1.0)
    save_file(q, tmp_path / "fp8mixed.safetensors")
    with pytest.raises(ValueError, match="comfy_quant"):
        load_transformer(tmp_path / "fp8mixed.safetensors")


def test_wrong_text_width_names_the_encoder(layouts):
    ours = load_transformer(layouts["bfl file"])
    img, ids, txt, tids, t, _ = _inputs()
    with pytest.raises(ValueError, match="expects 24"):
        ours(img=img, img_ids=ids, txt=txt[..., :20], txt_ids=tids, timesteps=t)


def test_position_ids_layout():
    ids = klein_core.pipeline.sampling.position_ids(2, 3, t=10)
    assert ids.dtype == torch.long and ids.shape == (6, 4)
    assert ids.tolist() == [[10, 0, 0, 0], [10, 0, 1, 0], [10, 0, 2, 0], [10, 1, 0, 0], [10, 1, 1, 0], [10, 1, 2, 0]]
    assert text_position_ids(3).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]


def test_bfl_to_diffusers_is_the_exact_inverse(reference, layouts):
    from klein_core.files.transformer_layout import bfl_to_diffusers

    model, _ = reference
    bfl = layouts["bfl state dict"]
    ours = load_transformer(bfl)
    exported = bfl_to_diffusers(bfl, ours.config)
    theirs = model.state_dict()
    assert exported.keys() == theirs.keys()
    assert all(torch.equal(exported[k], theirs[k]) for k in theirs)
