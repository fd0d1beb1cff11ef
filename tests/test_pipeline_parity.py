"""End-to-end parity with diffusers' Flux2KleinPipeline on tiny random components.

The diffusers transformer and VAE are written to safetensors files and loaded through
klein_core's loaders; both pipelines get the same prompt embeddings and the same initial noise,
and the final (normalised, packed) latents are compared in fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image
from safetensors.torch import save_file

import klein_core
from klein_core import generate, load_transformer, load_vae
from klein_core.pipeline.sampling import compute_empirical_mu, denoise, get_schedule, make_noise, pack

diffusers = require("diffusers")

CTX = 24
LATENT_CH = 4  # tiny VAE latent channels -> 16 transformer channels after the 2x2 patchify


def _randomize(module: torch.nn.Module, scale: float = 0.2) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def components(tmp_path_factory):
    torch.manual_seed(0)
    tr = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CH, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=CTX, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    ).eval()
    _randomize(tr)
    vae = diffusers.AutoencoderKLFlux2(
        block_out_channels=(32, 64), layers_per_block=1, latent_channels=LATENT_CH, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    ).eval()
    _randomize(vae, 0.1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(4 * LATENT_CH) * 0.3)
        vae.bn.running_var.copy_(torch.rand(4 * LATENT_CH) + 0.5)
    d = tmp_path_factory.mktemp("pipe")
    save_file({k: v.contiguous() for k, v in tr.state_dict().items()}, d / "transformer.safetensors")
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, d / "vae.safetensors")
    ours_tr = load_transformer(d / "transformer.safetensors")
    ours_vae = load_vae(d / "vae.safetensors")
    return tr, vae, ours_tr, ours_vae


def _pipe(tr, vae, distilled: bool):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    return diffusers.Flux2KleinPipeline(
        scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=tr, is_distilled=distilled
    )


def _run_reference(pipe, **kw) -> torch.Tensor:
    """Run diffusers and capture its final packed, normalised latents [B, N, C]."""
    captured = {}

    def grab(p, i, t, kwargs):
        captured["latents"] = kwargs["latents"].clone()
        return {}

    with torch.no_grad():
        pipe(output_type="latent", callback_on_step_end=grab, **kw)
    return captured["latents"]


def _embeds(seed: int, n: int = 1, length: int = 12) -> torch.Tensor:
    return torch.randn(n, length, CTX, generator=torch.Generator().manual_seed(seed))


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_distilled_text_to_image(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb = _embeds(1)
    w, h = 96, 64
    noise = make_noise(42, 1, 4 * LATENT_CH, h // 4, w // 4)
    ref = _run_reference(_pipe(tr, vae, True), prompt_embeds=emb, width=w, height=h, num_inference_steps=4,
                         guidance_scale=1.0, latents=noise)
    res = generate(ours_tr, None, ours_vae, prompt_embeds=emb, width=w, height=h, seed=42, kind="distilled",
                   output="latent")
    ours = pack(res.latents)
    diff = parity("pipeline fp32, distilled t2i", (ours - ref).abs().max().item())
    assert res.steps == 4 and res.guidance == 1.0
    assert diff <= 1e-4, f"distilled t2i: max abs diff {diff:.3e}"


def test_base_cfg_with_negative_prompt_batched(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb, neg = _embeds(2), _embeds(3)
    w, h = 64, 80
    noise = make_noise(7, 2, 4 * LATENT_CH, h // 4, w // 4)
    ref = _run_reference(_pipe(tr, vae, False), prompt_embeds=emb, negative_prompt_embeds=neg, width=w, height=h,
                         num_inference_steps=5, guidance_scale=4.0, latents=noise, num_images_per_prompt=2)
    res = generate(ours_tr, None, ours_vae, prompt_embeds=emb, negative_embeds=neg, width=w, height=h, seed=7,
                   steps=5, guidance=4.0, batch_size=2, kind="base", output="latent")
    diff = parity("pipeline fp32, base CFG + negative, batch 2", (pack(res.latents) - ref).abs().max().item())
    assert diff <= 1e-4, f"base CFG: max abs diff {diff:.3e}"
    # and CFG really changed the result (guards against the negative branch being dropped)
    plain = generate(ours_tr, None, ours_vae, prompt_embeds=emb, width=w, height=h, seed=7, steps=5,
                     guidance=1.0, batch_size=2, kind="base", output="latent")
    assert (plain.latents - res.latents).abs().max().item() > 1e-2


def test_two_references_of_different_sizes(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb = _embeds(4)
    refs = [_image(80, 64, 1), _image(64, 116, 2)]  # landscape, and portrait not a multiple of 4
    # Output size follows the first reference (80x64): tokens 20x16.
    noise = make_noise(3, 1, 4 * LATENT_CH, 64 // 4, 80 // 4)
    ref = _run_reference(_pipe(tr, vae, True), image=refs, prompt_embeds=emb, num_inference_steps=3,
                         guidance_scale=1.0, latents=noise)
    res = generate(ours_tr, None, ours_vae, prompt_embeds=emb, references=refs, steps=3, seed=3, output="latent")
    assert (res.width, res.height) == (80, 64)
    assert res.reference_sizes == [(80, 64), (64, 116 // 4 * 4)]
    diff = parity("pipeline fp32, two references", (pack(res.latents) - ref).abs().max().item())
    assert diff <= 1e-4, f"two references: max abs diff {diff:.3e}"


def test_decoded_images_match_diffusers(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb = _embeds(5)
    noise = make_noise(9, 1, 4 * LATENT_CH, 16, 16)
    with torch.no_grad():
        ref = _pipe(tr, vae, True)(prompt_embeds=emb, width=64, height=64, num_inference_steps=2,
                                    guidance_scale=1.0, latents=noise, output_type="pt").images
    res = generate(ours_tr, None, ours_vae, prompt_embeds=emb, width=64, height=64, steps=2, seed=9)
    diff = parity("pipeline fp32, decoded pixels", (res.pixels - ref).abs().max().item())
    assert diff <= 1e-4, f"decoded pixels: max abs diff {diff:.3e}"
    assert res.images[0].size == (64, 64)


@pytest.mark.parametrize("steps,size", [(4, (1024, 1024)), (50, (1024, 1024)), (4, (512, 256)), (2, (64, 96)),
                                        (8, (1440, 1440)), (28, (768, 1360)), (4, (1024, 1056))])
def test_schedule_equals_diffusers_scheduler(steps, size, parity):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu as diffusers_mu

    w, h = size
    seq = (h // 16) * (w // 16)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    mu = diffusers_mu(seq, steps)  # the pipeline's own mu: never klein_core's (the reference must not move with it)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = get_schedule(steps, seq)
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
    parity(f"schedule {steps} steps at {w}x{h} vs diffusers FlowMatchEulerDiscreteScheduler",
           (ours - sched.sigmas).abs().max().item())
    assert torch.equal(ours, sched.sigmas), f"{(ours - sched.sigmas).abs().max()}"


def test_schedule_matches_published_table():
    s = get_schedule(4, 4096)
    assert compute_empirical_mu(4096, 4) == pytest.approx(2.291179894115571, abs=1e-12)
    assert torch.allclose(s * 1000, torch.tensor([1000.0, 967.3840, 908.1439, 767.2000, 0.0]), atol=1e-3)
    assert compute_empirical_mu(512, 4) == pytest.approx(1.9872746769223413, abs=1e-12)
    assert torch.allclose(get_schedule(4, 512)[:4] * 1000, torch.tensor([1000, 956.3068, 879.4545, 708.6141]),
                          atol=1e-3)
    assert compute_empirical_mu(4096, 50) == pytest.approx(2.0233511571292637, abs=1e-12)
    # above 4300 tokens mu ignores the step count
    assert compute_empirical_mu(5000, 4) == compute_empirical_mu(5000, 50)


def test_bf16_timesteps_seen_by_model_follow_reference_rounding(components, monkeypatch):
    _, _, ours_tr, _ = components
    model = ours_tr.to(torch.bfloat16)
    seen = []
    real = klein_core.models.transformer.timestep_embedding

    def spy(t, *a, **k):  # the value the time embedder receives, i.e. what the model "sees"
        seen.append(t[0].item())
        return real(t, *a, **k)

    monkeypatch.setattr(klein_core.models.transformer, "timestep_embedding", spy)
    try:
        denoise(model, torch.randn(1, 16, 64, 64), torch.randn(1, 4, CTX), get_schedule(4, 4096))
    finally:
        ours_tr.to(torch.float32)
    assert seen == [1000.0, 968.0, 908.0, 768.0]  # SPEC §4.4: bf16 pipelines see these
