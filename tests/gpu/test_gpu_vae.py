"""Tiled VAE encode and decode on the device against the untiled result, the engine's tiled plan,
and (full size) the memory tiling saves.

Tiling is not exact (each tile's GroupNorms and mid-block attention see that tile only), so as in
tests/test_vae_tiling.py the bound is on the mean error relative to the output's spread: within 15% of
its standard deviation. On CUDA the untiled bf16 result is also compared with the fp32 CPU one (the
same rounded weights): bf16 through a random VAE, within 5% relative L2 (tests/test_fast.py measures
the bf16 decoder within 5% too).
"""

from __future__ import annotations

import pytest
import torch

import klein_core as kc
from klein_core.memory.planner import MemoryPlan
from klein_core.memory.tiling import decode_tiled, encode_tiled
from klein_core.pipeline.vae_io import decode_to_pixels, encode_references

from .helpers import cpu_reference, load_small, peak_bytes, rel_l2, tag


def _smooth_pixels(h: int, w: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(1, 3, h // 16, w // 16, generator=g) * 2 - 1
    return torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)


def _mean_err(tiled: torch.Tensor, full: torch.Tensor) -> float:
    return float((tiled.float() - full.float()).abs().mean() / full.float().std())


def test_tiled_encode_and_decode(gpu, parity):
    vae = load_small(gpu)[2]
    px = _smooth_pixels(384, 512).to(gpu.device, gpu.dtype)
    with torch.no_grad():
        full = vae.encode(px)
    tiled = encode_tiled(vae, px, tile=256, overlap=64)
    assert tiled.shape == full.shape == (1, 128, 24, 32) and tiled.device.type == gpu.device.type
    err = parity(tag(gpu, "VAE tiled encode (256 px, overlap 64): mean abs / std"), _mean_err(tiled, full))
    assert 0 < err < 0.15, err
    k = 2 if gpu.cpu else 1  # the CPU mode decodes at half the size (fp32 on 2 cores)
    lat = torch.randn(1, 128, 32 // k, 48 // k, generator=torch.Generator().manual_seed(0)).to(gpu.device, gpu.dtype)
    with torch.no_grad():
        whole = vae.decode(lat)
    tiles = decode_tiled(vae, lat, tile=24 // k, overlap=8 // k)
    assert tiles.shape == whole.shape == (1, 3, 512 // k, 768 // k)
    err = parity(tag(gpu, f"VAE tiled decode ({24 // k}, overlap {8 // k}): mean abs / std"), _mean_err(tiles, whole))
    assert 0 < err < 0.15, err
    ref = cpu_reference(gpu)[2]
    with torch.no_grad():
        want_enc = ref.encode(px.float().cpu())  # px holds bf16-rounded values on CUDA: the same input
        want_dec = ref.decode(lat.float().cpu())
    rel = parity(tag(gpu, "VAE encode vs fp32 CPU, relative L2"), rel_l2(full, want_enc))
    assert rel < (0.05 if gpu.half else 1e-5), rel
    rel = parity(tag(gpu, "VAE decode vs fp32 CPU, relative L2"), rel_l2(whole, want_dec))
    assert rel < (0.05 if gpu.half else 1e-5), rel


def test_engine_with_a_tiled_plan(gpu):
    """A plan with ``vae_tile`` makes the engine encode references and decode in exactly those tiles,
    and a whole generation runs with it."""
    from .helpers import reference_images

    tr, te, vae = load_small(gpu)
    side = 2 * gpu.size
    tile = side // 32  # latent positions: 2 x 2 tiles (and more with the overlap)
    plan = MemoryPlan({"text_encoder": "resident", "transformer": "resident", "vae": "resident"}, vae_tile=tile,
                      name="test tiled")
    engine = kc.Engine(tr, te, vae, memory=plan, prompt_cache=None)
    lat = torch.randn(1, 128, side // 16, side // 16, generator=torch.Generator().manual_seed(3)).to(gpu.device)
    got = engine.decode(lat)
    assert torch.equal(got, decode_to_pixels(vae, lat, tile=tile))
    assert not torch.equal(got, decode_to_pixels(vae, lat)), "the plan's tiles were not used"
    refs = reference_images([(side, side)])
    enc = engine.encode_references(refs)
    assert torch.equal(enc[0], encode_references(vae, refs, tile=tile)[0])
    res = kc.generate(tr, te, vae, prompt="a cat", references=refs, steps=2, seed=1, cache=None, memory=plan)
    assert torch.isfinite(res.latents).all() and res.pixels.shape == (1, 3, side, side)


# ---------------------------------------------------------------------------------------------
# Full size


@pytest.mark.full_size(40)
def test_full_vae_tiled_decode_and_encode(gpu, full4b, parity):
    """The full FLUX.2 VAE at 1536x1536: tiled (32 latents = 512 px, overlap 8) against whole, and
    the peak memory of each (tiling must at least halve it)."""
    vae = full4b[2]
    lat = torch.randn(1, 128, 96, 96, generator=torch.Generator().manual_seed(0)).to(gpu.device, gpu.dtype)
    whole, peak_whole = peak_bytes(gpu.device, lambda: vae.decode(lat))
    tiled, peak_tiled = peak_bytes(gpu.device, lambda: decode_tiled(vae, lat, tile=32, overlap=8))
    err = parity(tag(gpu, "full VAE tiled decode 1536: mean abs / std"), _mean_err(tiled, whole))
    parity(tag(gpu, "full VAE decode 1536: whole peak GiB"), peak_whole / 1024**3)
    parity(tag(gpu, "full VAE decode 1536: tiled peak GiB"), peak_tiled / 1024**3)
    assert err < 0.15, err
    assert peak_tiled < 0.5 * peak_whole, (peak_tiled, peak_whole)
    px = _smooth_pixels(1536, 1536).to(gpu.device, gpu.dtype)
    with torch.no_grad():
        full, peak_full = peak_bytes(gpu.device, lambda: vae.encode(px))
    tiles, peak_tiles = peak_bytes(gpu.device, lambda: encode_tiled(vae, px, tile=512, overlap=128))
    err = parity(tag(gpu, "full VAE tiled encode 1536: mean abs / std"), _mean_err(tiles, full))
    assert err < 0.15, err
    assert peak_tiles < peak_full, (peak_tiles, peak_full)


def test_reference_pixels_made_on_the_device_are_the_hosts_bits(gpu):
    """A picture's pixels made where the VAE is (8-bit levels copied, then a table: the encoder's path
    since the twenty-eighth session) equal prepare_reference_image's on the host bit for bit, with its
    strides; a second picture of the same size gives its own pixels."""
    import numpy as np
    from PIL import Image

    from klein_core.pipeline.images import prepare_reference_image, reference_pixels

    rng = np.random.default_rng(3)
    for side in ((1500, 900), (1500, 900), (96, 64)):
        picture = Image.fromarray(rng.integers(0, 256, (side[1], side[0], 3), dtype=np.uint8))
        want = prepare_reference_image(picture)
        got = reference_pixels(picture, 16, gpu.device)
        assert got.device.type == gpu.device.type and got.dtype == torch.float32
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.cpu(), want)
