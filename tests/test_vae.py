"""FLUX.2 VAE parity with diffusers' ``AutoencoderKLFlux2`` + the Klein pipeline's patchify/BatchNorm.

A tiny seeded diffusers VAE (random GroupNorm affines and BatchNorm statistics, so nothing is an
identity) is written in every layout ``load_vae`` accepts; each load must reproduce the
reference encode and decode. CPU only, no network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from extras import require
from safetensors.torch import save_file
from torch import nn

from klein_core.files.loaders import load_vae
from klein_core.files.vae_layout import vae_config
from klein_core.models.vae import Flux2VAE, VAEConfig, patchify, unpatchify

diffusers = require("diffusers")
from diffusers import AutoencoderKL, AutoencoderKLFlux2  # noqa: E402
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline  # noqa: E402

TOL = 1e-4
TINY = dict(
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
    sample_size=32,
)
SMALL_DECODER = (32, 32)
IMAGE_HW = (48, 80)  # non-square, a multiple of 16


def _randomize(vae: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
        bn = getattr(vae, "bn", None)
        if bn is not None:
            bn.running_mean.copy_(0.5 * torch.randn(bn.running_mean.shape, generator=g))
            bn.running_var.copy_(0.1 + 2 * torch.rand(bn.running_var.shape, generator=g))


def _tiny(seed: int = 0, **over: object) -> AutoencoderKLFlux2:
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**{**TINY, **over}).eval()
    _randomize(vae, seed + 100)
    return vae


# ---------------------------------------------------------------------------------------------
# Reference: diffusers VAE + Flux2KleinPipeline's patchify / BN formulas.


def _bn(vae: AutoencoderKLFlux2) -> tuple[torch.Tensor, torch.Tensor]:
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


@torch.no_grad()
def ref_encode(vae: AutoencoderKLFlux2, pixels: torch.Tensor) -> torch.Tensor:
    lat = vae.encode(pixels).latent_dist.mode()
    lat = Flux2KleinPipeline._patchify_latents(lat)
    mean, std = _bn(vae)
    return (lat - mean) / std


@torch.no_grad()
def ref_decode(vae: AutoencoderKLFlux2, latents: torch.Tensor) -> torch.Tensor:
    mean, std = _bn(vae)
    lat = Flux2KleinPipeline._unpatchify_latents(latents * std + mean)
    return vae.decode(lat, return_dict=False)[0]


# ---------------------------------------------------------------------------------------------
# Test-local diffusers -> BFL conversion (written independently of klein_core's mapping).

_BFL_RENAMES = [  # (diffusers pattern, BFL replacement); applied in order, first match wins
    (r"^quant_conv\.", "encoder.quant_conv."),
    (r"^post_quant_conv\.", "decoder.post_quant_conv."),
    (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.1\.", r"\1.mid.block_2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.group_norm\.", r"\1.mid.attn_1.norm."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_q\.", r"\1.mid.attn_1.q."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_k\.", r"\1.mid.attn_1.k."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_v\.", r"\1.mid.attn_1.v."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_out\.0\.", r"\1.mid.attn_1.proj_out."),
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.UP\1.block.\2."),
    (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", r"decoder.UP\1.upsample."),
]


def to_bfl(sd: dict[str, torch.Tensor], *, comfy: bool = False) -> dict[str, torch.Tensor]:
    """diffusers state dict -> BFL names (``comfy``: quant convs at the top level, as ComfyUI)."""
    n_up = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks."))
    out = {}
    for key, value in sd.items():
        if key == "bn.num_batches_tracked":
            continue
        new = key
        for pat, rep in _BFL_RENAMES:
            if re.search(pat, key):
                new = re.sub(pat, rep, key)
                break
        new = new.replace(".conv_shortcut.", ".nin_shortcut.")
        m = re.match(r"decoder\.UP(\d+)\.", new)
        if m:  # diffusers' up_blocks.i is BFL's up.{n-1-i}
            new = f"decoder.up.{n_up - 1 - int(m.group(1))}." + new[m.end():]
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]
        if comfy and new.startswith(("encoder.quant_conv.", "decoder.post_quant_conv.")):
            new = new.split(".", 1)[1]
        out[new] = value.clone()
    return out


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def ref() -> AutoencoderKLFlux2:
    return _tiny(0)


@pytest.fixture(scope="module")
def ref_small() -> AutoencoderKLFlux2:
    return _tiny(1, decoder_block_out_channels=SMALL_DECODER)


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.rand((2, 3, *IMAGE_HW), generator=g) * 2 - 1


@pytest.fixture(scope="module")
def latents(ref: AutoencoderKLFlux2) -> torch.Tensor:
    g = torch.Generator().manual_seed(8)
    down = 2 ** (len(TINY["block_out_channels"]) - 1) * 2
    shape = (2, 4 * TINY["latent_channels"], IMAGE_HW[0] // down, IMAGE_HW[1] // down)
    return torch.randn(shape, generator=g)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, ref: AutoencoderKLFlux2,
          ref_small: AutoencoderKLFlux2) -> dict[str, object]:
    root = tmp_path_factory.mktemp("vae")
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    out: dict[str, object] = {}

    d = root / "diffusers_file"
    d.mkdir()
    save_file(sd, str(d / "diffusion_pytorch_model.safetensors"))
    out["diffusers-file"] = d / "diffusion_pytorch_model.safetensors"

    repo = root / "repo"
    ref.save_pretrained(str(repo / "vae"), safe_serialization=True)
    assert (repo / "vae" / "config.json").is_file()
    out["diffusers-repo"] = repo

    save_file(to_bfl(sd), str(root / "flux2-vae-bfl.safetensors"))
    out["bfl-file"] = root / "flux2-vae-bfl.safetensors"
    save_file(to_bfl(sd, comfy=True), str(root / "flux2-vae-comfy.safetensors"))
    out["comfy-file"] = root / "flux2-vae-comfy.safetensors"

    out["bfl-dict"] = to_bfl(sd)
    out["diffusers-dict"] = sd

    small_sd = ref_small.state_dict()
    save_file(to_bfl(small_sd), str(root / "small-decoder-bfl.safetensors"))
    out["small-bfl-file"] = root / "small-decoder-bfl.safetensors"
    save_file(dict(small_sd), str(root / "small-decoder-diffusers.safetensors"))
    out["small-diffusers-file"] = root / "small-decoder-diffusers.safetensors"
    out["root"] = root
    return out


LAYOUTS = ["diffusers-file", "diffusers-repo", "bfl-file", "comfy-file", "bfl-dict", "diffusers-dict",
           "small-bfl-file", "small-diffusers-file"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parity_every_layout(layout: str, files: dict[str, object], ref: AutoencoderKLFlux2,
                             ref_small: AutoencoderKLFlux2, pixels: torch.Tensor,
                             latents: torch.Tensor, parity) -> None:
    small = layout.startswith("small")
    reference = ref_small if small else ref
    model = load_vae(files[layout])  # type: ignore[arg-type]
    cfg = model.config
    assert cfg.block_channels == (32, 64) and cfg.num_res_blocks == 1 and cfg.z_channels == 4
    assert cfg.decoder_block_channels == (SMALL_DECODER if small else (32, 64))
    assert cfg.variant == ("FLUX.2 VAE (small decoder)" if small else "FLUX.2 VAE")
    assert cfg.latent_channels == 16 and cfg.downscale == 4
    assert model.bn.running_mean.dtype == torch.float32

    enc = model.encode(pixels)
    enc_ref = ref_encode(reference, pixels)
    assert enc.shape == enc_ref.shape == (2, 16, IMAGE_HW[0] // 4, IMAGE_HW[1] // 4)
    d_enc = parity(f"VAE fp32 encode, {layout}", _max_diff(enc, enc_ref))
    assert d_enc <= TOL, f"{layout}: encode max abs diff {d_enc:.3g}"

    dec = model.decode(latents)
    dec_ref = ref_decode(reference, latents)
    assert dec.shape == dec_ref.shape == (2, 3, *IMAGE_HW)
    d_dec = parity(f"VAE fp32 decode, {layout}", _max_diff(dec, dec_ref))
    assert d_dec <= TOL, f"{layout}: decode max abs diff {d_dec:.3g}"


def test_bf16_close_to_fp32_reference(files: dict[str, object], ref: AutoencoderKLFlux2,
                                      pixels: torch.Tensor, latents: torch.Tensor) -> None:
    model = load_vae(files["bfl-file"], dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert model.dtype == torch.bfloat16
    assert model.bn.running_mean.dtype == model.bn.running_var.dtype == torch.float32
    enc, enc_ref = model.encode(pixels), ref_encode(ref, pixels)
    dec, dec_ref = model.decode(latents), ref_decode(ref, latents)
    assert enc.dtype == dec.dtype == torch.bfloat16
    e_enc = _max_diff(enc, enc_ref) / enc_ref.abs().max().item()
    e_dec = _max_diff(dec, dec_ref) / dec_ref.abs().max().item()
    assert e_enc < 0.05, f"bf16 encode max abs diff relative to max |ref|: {e_enc:.3g}"
    assert e_dec < 0.05, f"bf16 decode max abs diff relative to max |ref|: {e_dec:.3g}"


def test_stored_dtype_is_default_and_inputs_are_cast(ref: AutoencoderKLFlux2, pixels: torch.Tensor) -> None:
    sd16 = {k: (v.half() if v.is_floating_point() else v) for k, v in to_bfl(ref.state_dict()).items()}
    model = load_vae(sd16)
    assert model.dtype == torch.float16 and model.bn.running_var.dtype == torch.float32
    model32 = load_vae(sd16, dtype=torch.float32)
    out = model32.encode(pixels.double())  # float64 input is moved to the model dtype
    assert out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Full-size configs, read from shapes only (meta tensors, no data)


def _meta_state_dict(**over: object) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        vae = AutoencoderKLFlux2(**over)
    return dict(vae.state_dict())


@pytest.mark.parametrize("small", [False, True])
def test_real_config_from_shapes(small: bool) -> None:
    over = {"decoder_block_out_channels": (96, 192, 384, 384)} if small else {}
    sd = _meta_state_dict(**over)
    for layout_sd in (sd, to_bfl(sd), to_bfl(sd, comfy=True)):
        cfg = vae_config(layout_sd)
        assert cfg.block_channels == (128, 256, 512, 512) and cfg.ch == 128
        assert cfg.decoder_ch == (96 if small else 128)
        assert cfg.num_res_blocks == 2 and cfg.z_channels == 32 and cfg.mid_attention
        assert cfg.latent_channels == 128 and cfg.downscale == 16
        assert cfg.variant == ("FLUX.2 VAE (small decoder)" if small else "FLUX.2 VAE")
    with torch.device("meta"):
        model = Flux2VAE(cfg)
    # Our module's names are exactly the BFL file's, and the sizes agree with diffusers.
    bfl = to_bfl(sd)
    assert set(model.state_dict()) == set(bfl)
    assert all(tuple(model.state_dict()[k].shape) == tuple(v.shape) for k, v in bfl.items())
    n_ours = sum(p.numel() for p in model.parameters())
    assert n_ours == sum(v.numel() for k, v in sd.items() if not k.startswith("bn."))
    if not small:
        assert round(n_ours / 1e6, 2) == 84.05


def test_no_non_persistent_buffers() -> None:
    with torch.device("meta"):
        model = Flux2VAE(VAEConfig())
    assert set(dict(model.named_buffers())) <= set(model.state_dict())


# ---------------------------------------------------------------------------------------------
# Refusals


def _flux1_like() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(32, 64), layers_per_block=1, latent_channels=16, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    return dict(vae.state_dict())


@pytest.mark.parametrize("convert", [lambda sd: sd, to_bfl], ids=["diffusers", "bfl"])
def test_refuses_flux1_vae(convert: Callable[[dict], dict]) -> None:
    with pytest.raises(ValueError, match=r"not a FLUX\.2 VAE.*FLUX\.1 / SD3 16-channel VAE: use flux2-vae"):
        load_vae(convert(_flux1_like()))


@pytest.mark.parametrize(
    ("sd", "what"),
    [
        ({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2), "img_in.weight": torch.zeros(2, 4)},
         "diffusion transformer"),
        ({"model.embed_tokens.weight": torch.zeros(8, 2),
          "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, "text encoder"),
    ],
    ids=["transformer", "text-encoder"],
)
def test_refuses_other_models(sd: dict[str, torch.Tensor], what: str) -> None:
    with pytest.raises(ValueError, match=f"not a FLUX.2 VAE.*{what}"):
        load_vae(sd)


def test_missing_tensor_names_key_and_file(files: dict[str, object], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(files["bfl-file"]))
    del sd["decoder.up.1.block.0.norm1.weight"]
    path = tmp_path / "broken.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError) as err:
        load_vae(path)
    assert str(path) in str(err.value) and "decoder.up.1.block.0.norm1.weight" in str(err.value)


def test_wrong_shape_names_key_and_file(files: dict[str, object], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(files["comfy-file"]))
    sd["encoder.mid.attn_1.q.bias"] = torch.zeros(65)
    path = tmp_path / "misshaped.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError) as err:
        load_vae(path)
    assert str(path) in str(err.value) and "encoder.mid.attn_1.q.bias" in str(err.value)


def test_duplicate_quant_conv_refused(files: dict[str, object]) -> None:
    sd = dict(files["bfl-dict"])  # type: ignore[call-overload]
    sd["quant_conv.weight"] = sd["encoder.quant_conv.weight"]
    with pytest.raises(ValueError, match=r"'(encoder\.)?quant_conv\.weight' and '(encoder\.)?quant_conv\.weight' "
                                         r"both provide 'encoder\.quant_conv\.weight'"):
        load_vae(sd)


def test_container_prefix_is_stripped(files: dict[str, object], pixels: torch.Tensor,
                                      ref: AutoencoderKLFlux2) -> None:
    sd = {f"first_stage_model.{k}": v for k, v in files["bfl-dict"].items()}  # type: ignore[union-attr]
    sd["model.diffusion_model.img_in.weight"] = torch.zeros(2, 2)
    model = load_vae(sd)
    assert _max_diff(model.encode(pixels), ref_encode(ref, pixels)) <= TOL


def test_encode_decode_input_checks(files: dict[str, object]) -> None:
    model = load_vae(files["bfl-dict"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiples of 4"):
        model.encode(torch.zeros(1, 3, 50, 80))
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        model.encode(torch.zeros(1, 4, 48, 80))
    with pytest.raises(ValueError, match="float pixels"):
        model.encode(torch.zeros(1, 3, 48, 80, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[B, 16, h, w\]"):
        model.decode(torch.zeros(1, 4, 6, 10))


def test_real_size_encode_needs_multiple_of_16() -> None:
    cfg = vae_config(_meta_state_dict())
    with torch.device("meta"):
        model = Flux2VAE(cfg)
    with pytest.raises(ValueError, match="multiples of 16"):
        model.encode(torch.zeros(1, 3, 40, 64, device="meta"))


def test_repo_root_config_is_the_diffusers_one(files: dict[str, object]) -> None:
    repo = Path(files["diffusers-repo"])  # type: ignore[arg-type]
    config = json.loads((repo / "vae" / "config.json").read_text())
    cfg = vae_config(repo)
    assert list(cfg.block_channels) == config["block_out_channels"]
    assert cfg.z_channels == config["latent_channels"] and cfg.bn_eps == config["batch_norm_eps"]


# ---------------------------------------------------------------------------------------------
# patchify / unpatchify


@pytest.mark.parametrize("shape", [(1, 4, 2, 2), (2, 32, 6, 10), (3, 5, 8, 4)])
def test_patchify_matches_pipeline_and_round_trips(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    p = patchify(x)
    assert torch.equal(p, Flux2KleinPipeline._patchify_latents(x))
    assert torch.equal(unpatchify(p), x)
    assert torch.equal(unpatchify(p), Flux2KleinPipeline._unpatchify_latents(p))
    b, c, h, w = shape
    for ci, pi, pj in [(0, 0, 0), (c - 1, 1, 0), (c // 2, 0, 1), (c - 1, 1, 1)]:
        assert torch.equal(p[:, ci * 4 + pi * 2 + pj], x[:, ci, pi::2, pj::2])


def test_patchify_refuses_odd_sizes() -> None:
    with pytest.raises(ValueError):
        patchify(torch.zeros(1, 4, 3, 4))
    with pytest.raises(ValueError):
        unpatchify(torch.zeros(1, 6, 3, 4))


@pytest.mark.parametrize("part", ["encoder", "decoder"])
def test_mid_attention_never_holds_the_scores(part: str) -> None:
    """Was a bug: the plain path's NCHW activations reached SDPA with the channels strided, so SDPA fell
    back to its math path and held the HW x HW scores twice (a 37.8 GB peak for a 2048² decode on an
    H200; on the CPU, where plain is the default, twice the attention's time). 64 x 64 latent
    positions: the scores would be 64 MiB in fp32; every allocation must stay far below."""
    from torch.profiler import ProfilerActivity, profile

    vae = Flux2VAE(VAEConfig(block_channels=(32, 32), decoder_block_channels=(32, 32), num_res_blocks=1)).eval()
    attn = getattr(vae, part).mid.attn_1
    x = torch.randn(1, 32, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = attn(x)
    largest = max(e.cpu_memory_usage for e in prof.events())
    scores = (64 * 64) ** 2 * 4
    assert largest < scores // 16, f"largest allocation {largest} bytes, the scores are {scores}"
    # the same attention as the math path's, to float rounding
    hn = attn.norm(x)
    q, k, v = (m(hn).flatten(2).transpose(1, 2).double() for m in (attn.q, attn.k, attn.v))
    ref = torch.softmax(q @ k.transpose(1, 2) / 32**0.5, -1) @ v
    ref = x.double() + attn.proj_out(ref.transpose(1, 2).reshape(1, 32, 64, 64).float()).double()
    assert (y.double() - ref).abs().max().item() < 1e-4
