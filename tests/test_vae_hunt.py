"""Bug hunt in the FLUX.2 VAE path: Flux2VAE encode/decode against diffusers at the real 16x
geometry, tiled encode/decode blending, the fast VAE options on the CPU, the engine's VAE stages
(out-of-memory retry, odd inputs) and the Flux2 VAE Encode node's IMAGE handling.

Tests whose docstring starts with "BUG:" fail on the code they were written against; the others pin
behaviour no other test checks. Tiny models only, one torch thread.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from extras import require
from test_nodes import _load, comfy  # noqa: F401 (fixtures)

import klein_core as kc
from klein_core import testing as demo
from klein_core.accel import apply_speed, disable_fast_vae, enable_fast_vae
from klein_core.files.loaders import load_vae
from klein_core.memory import tiling

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _PositionWise:
    """A 'VAE' with the real 16 px geometry whose decode/encode act on each latent position alone
    (nearest upsampling / 16x16 average pooling), so tiling is exact for it: any difference between
    a tiled and a whole result is a blending or offset error, not the tiling approximation."""

    config = SimpleNamespace(downscale=16)

    def decode(self, lat: torch.Tensor) -> torch.Tensor:
        return lat[:, :3].repeat_interleave(16, -2).repeat_interleave(16, -1)

    def encode(self, px: torch.Tensor) -> torch.Tensor:
        pooled = F.avg_pool2d(px, 16)
        return torch.cat([pooled * (k + 1) for k in range(43)], dim=1)[:, :128]


@pytest.fixture(scope="module")
def diffusers_pair():
    """A seeded diffusers ``AutoencoderKLFlux2`` with the real geometry (4 levels: 16 px per latent
    position, 32 latent channels -> 128 after patchify), random GroupNorm affines and BN statistics,
    and klein_core's load of its state dict."""
    require("diffusers")
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(3)
    ref = AutoencoderKLFlux2(
        block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=32, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=True, sample_size=32,
    ).eval()
    g = _gen(103)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
        ref.bn.running_mean.copy_(0.5 * torch.randn(ref.bn.running_mean.shape, generator=g))
        ref.bn.running_var.copy_(0.1 + 2 * torch.rand(ref.bn.running_var.shape, generator=g))
    ours = load_vae({k: v.clone() for k, v in ref.state_dict().items()})
    return ref, ours


def _ref_encode(ref, pixels: torch.Tensor) -> torch.Tensor:
    """diffusers' Flux2KleinPipeline encode: VAE mode, _patchify_latents, BN normalise."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    with torch.no_grad():
        lat = ref.encode(pixels).latent_dist.mode()
        lat = Flux2KleinPipeline._patchify_latents(lat)
        mean = ref.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
        return (lat - mean) / std


def _ref_decode(ref, latents: torch.Tensor) -> torch.Tensor:
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    with torch.no_grad():
        mean = ref.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
        lat = Flux2KleinPipeline._unpatchify_latents(latents * std + mean)
        return ref.decode(lat, return_dict=False)[0]


# ---------------------------------------------------------------------------------------------
# Flux2VAE against diffusers (independent reference)


def test_real_geometry_parity_batch_non_square_and_input_dtypes(diffusers_pair):
    """Pins encode/decode against diffusers at the real 16 px / 128-channel geometry, batch 2,
    non-square (48x80 px, 3x5 latents), and that fp16 / float64 inputs are cast, not refused or
    silently run in their own dtype (the result is the fp32 model's dtype)."""
    ref, ours = diffusers_pair
    px = torch.rand(2, 3, 48, 80, generator=_gen(0)) * 2 - 1
    want = _ref_encode(ref, px)
    got = ours.encode(px)
    assert got.shape == (2, 128, 3, 5) and got.dtype == torch.float32
    assert (got - want).abs().max() < 1e-4
    assert (ours.encode(px.double()) - want).abs().max() < 1e-4
    # each image of a batch is encoded on its own statistics (GroupNorm is per image)
    assert (ours.encode(px[1:]) - want[1:]).abs().max() < 1e-4

    lat = torch.randn(2, 128, 3, 5, generator=_gen(1))
    want = _ref_decode(ref, lat)
    got = ours.decode(lat)
    assert got.shape == (2, 3, 48, 80) and got.dtype == torch.float32
    assert (got - want).abs().max() < 1e-4
    half = ours.decode(lat.half())
    assert half.dtype == torch.float32
    assert (half - _ref_decode(ref, lat.half().float())).abs().max() < 1e-4


def test_encode_refuses_sizes_not_multiple_of_16_by_name(diffusers_pair):
    """Pins: a 50x64 image is refused with a message naming the size and the fix, not silently
    cropped (which would shift the content against the latent grid)."""
    _, ours = diffusers_pair
    with pytest.raises(ValueError, match=r"multiples of 16, got 50x64 \(H x W\); crop or resize"):
        ours.encode(torch.zeros(1, 3, 50, 64))
    with pytest.raises(ValueError, match=r"expects float pixels"):
        ours.encode(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# Tiling


@pytest.mark.parametrize("h,w,tile", [(5, 7, 2), (17, 9, 4), (20, 33, 16), (33, 20, 8), (13, 13, 5)])
def test_tiled_blend_is_exact_for_a_position_wise_vae(h, w, tile):
    """Pins the reassembly in tiling.decode / tiling.encode: for a VAE that maps each latent
    position on its own, tiles (several per axis, sizes not a multiple of the tile, tile sides 2 to
    16 with the policy's overlap tile // 4, none at 2, batch 2) must give the whole result exactly.
    A tile read or written at a wrong offset, an edge tile of the wrong size, or a zero blend
    weight (NaN) fails here; the shape of the ramps is not tested (any positive weights normalise
    to the same result for such a VAE; tests/test_vae_tiling.py checks the seams)."""
    vae = _PositionWise()
    lat = torch.randn(2, 128, h, w, generator=_gen(h * 100 + w))
    assert (tiling.decode(vae, lat, tile) - vae.decode(lat)).abs().max() < 1e-5
    px = torch.randn(2, 3, 16 * h, 16 * w, generator=_gen(h + w))
    assert (tiling.encode(vae, px, tile) - vae.encode(px)).abs().max() < 1e-5


def test_tiled_decode_keeps_batch_images_apart_and_the_decoder_dtype():
    """Pins: a tiled decode of a batch equals the tiled decode of each image alone (no mixing of
    batch entries through the blend), and keeps the decoder's dtype (bf16 decoder -> bf16 out)."""
    vae = demo.tiny_vae(seed=4)
    lat = torch.randn(2, 128, 6, 9, generator=_gen(5))
    both = tiling.decode(vae, lat, 4)
    for i in range(2):
        assert (both[i : i + 1] - tiling.decode(vae, lat[i : i + 1], 4)).abs().max() < 1e-5
    vae.set_decode_format(dtype=torch.bfloat16)
    try:
        out = tiling.decode(vae, lat, 4)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 96, 144)
    finally:
        vae.set_decode_format(dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Fast VAE on the CPU


def test_fast_speed_is_exactly_plain_on_the_cpu_and_channels_last_is_close():
    """Pins docs/speed.md / accel.speed: speed "fast" on the CPU is exactly the plain path (encode
    and decode bit-equal), channels-last decode differs only by rounding, and disable_fast_vae
    restores a plain fp32 decoder after a bf16 fast decode."""
    vae = demo.tiny_vae(seed=6)
    lat = torch.randn(1, 128, 3, 5, generator=_gen(6))
    px = torch.rand(1, 3, 48, 80, generator=_gen(7)) * 2 - 1
    plain_dec, plain_enc = vae.decode(lat), vae.encode(px)
    apply_speed(None, vae, "fast")
    assert torch.equal(vae.decode(lat), plain_dec) and torch.equal(vae.encode(px), plain_enc)
    enable_fast_vae(vae, compile=False, channels_last=True)
    cl = vae.decode(lat)
    assert cl.is_contiguous(memory_format=torch.channels_last)
    assert (cl - plain_dec).abs().max() < 1e-4
    assert (tiling.decode(vae, lat, 2) - tiling.decode(demo.tiny_vae(seed=6), lat, 2)).abs().max() < 1e-4
    enable_fast_vae(vae, compile=False, dtype=torch.bfloat16)
    assert vae.decode(lat).dtype == torch.bfloat16
    disable_fast_vae(vae)
    assert vae.decoder_dtype == torch.float32 and not vae.decode_channels_last
    assert (vae.decode(lat) - plain_dec).abs().max() < 0.1  # weights stay bf16-rounded (documented)


# ---------------------------------------------------------------------------------------------
# Engine VAE stages


def test_out_of_memory_retry_does_not_rerun_the_same_whole_decode(caplog):
    """Was a bug: Engine.decode's out-of-memory fallback (Engine._decode_one) tries the tile sides
    TILE_SIDES = (64, 32, 16) in turn, but a tile side >= the latent's larger side is no tiling at
    all (tiling.decode_tile says None: tiling.decode runs the whole vae.decode again). So a decode
    that ran out of memory is retried *identically* before any real tiling happens: a 20x20 latent
    (320 px) is decoded whole three times (whole, "tiles of 64", "tiles of 32"), a 1024x1024 image
    (64 latents) twice; each repeat fails the same way on the GPU, and the log says "retrying in
    tiles of 64 latents" when nothing was tiled. Fix: skip sides where
    ``tiling.decode_tile(t, h, w) is None`` when building the fallback list."""
    vae = demo.tiny_vae(seed=8)
    engine = kc.Engine(vae=vae, vae_tile=None)
    lat = torch.randn(1, 128, 20, 20, generator=_gen(8))
    real = vae.decode
    whole = []

    def decode(part):
        if part.shape[-2:] == lat.shape[-2:]:
            whole.append(1)
        if max(part.shape[-2:]) > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(part)

    vae.decode = decode
    try:
        with caplog.at_level(logging.WARNING):
            out = engine.decode(lat)
    finally:
        del vae.decode
    assert out.shape == (1, 3, 320, 320)
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(whole) == 1, (f"the whole 20x20 decode ran {len(whole)} times (identical retries); "
                             f"warnings: {retries}")


def test_empty_batch_errors_name_the_input():
    """Was a bug: Engine.decode of an empty batch of latents ``[0, 128, 4, 4]`` (and Engine.encode_pixels
    of ``[0, 3, 64, 64]``) fails deep inside with torch's own "torch.cat(): expected a non-empty list
    of Tensors" (engine.py: ``torch.cat(frames)`` / ``torch.cat(latents)`` after a loop that ran
    zero times), naming neither the input nor what is wrong with it; every other bad input to these
    stages gets a message naming it ("the latents to decode contains NaN...", "VAE encode needs
    height and width..."). Fix: refuse ``shape[0] == 0`` up front ("the latents to decode are an
    empty batch")."""
    engine = kc.Engine(vae=demo.tiny_vae(seed=9))
    for call, what in ((lambda: engine.decode(torch.zeros(0, 128, 4, 4)), "latents"),
                       (lambda: engine.encode_pixels(torch.zeros(0, 3, 64, 64)), "pixels")):
        with pytest.raises(ValueError) as info:
            call()
        assert what in str(info.value) and "torch.cat" not in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# Flux2 VAE Encode node: IMAGE layout, alpha, grey, centre crop


def test_encode_node_alpha_grey_and_centre_crop(comfy):  # noqa: F811
    """Pins the node's IMAGE handling against the engine on hand-made pixels: an RGBA image encodes
    as its RGB, a 1-channel grey image as the grey repeated to RGB, and a 70x100 image as its
    centred 64x96 crop (rows 3..66, columns 2..97, like ComfyUI's VAE Encode), batch of 2 kept."""
    _, kvae = _load(comfy)
    vae = kvae.ref.get()
    rgb = torch.rand(2, 70, 100, 3, generator=_gen(10))
    alpha = torch.rand(2, 70, 100, 1, generator=_gen(11))

    def node(pixels):
        with torch.inference_mode():
            return comfy.pack.KleinVAEEncode.execute(pixels, kvae).args[0]["samples"]

    def direct(pixels):
        with torch.inference_mode():
            return vae.encode(pixels.permute(0, 3, 1, 2).float() * 2 - 1).float()

    want = direct(rgb[:, 3:67, 2:98])
    got = node(rgb)
    assert got.shape == (2, 128, 4, 6)
    assert (got - want).abs().max() < 1e-4
    assert torch.equal(node(torch.cat([rgb, alpha], -1)), got)
    grey = rgb[..., :1]
    assert (node(grey) - direct(grey[:, 3:67, 2:98].expand(-1, -1, -1, 3))).abs().max() < 1e-4
