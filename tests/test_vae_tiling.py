"""Tiled VAE decode/encode against the untiled result on tiny random VAEs (real 16x geometry).

Tiling cannot be exact: each tile's GroupNorms and mid-block attention see only that tile. The
tests measure the difference (recorded in the end-of-run table) and check that the blend leaves no
seam: the tiling error must not jump where tiles meet, while a hard cut between tiles does.
"""

from __future__ import annotations

import pytest
import torch

import klein_core.memory.tiling as vt
from klein_core import testing as demo
from klein_core.memory.tiling import decode_tiled, encode_tiled, tile_starts
from klein_core.models.vae import Flux2VAE, VAEConfig

TILE, OVERLAP = 24, 8  # latent positions; the test latent needs 2 x 3 tiles


class _Memo:
    """A VAE whose decode remembers tiles by position, so two blends of one tiling decode once."""

    def __init__(self, vae):
        self.vae, self.config, self.cache = vae, vae.config, {}

    def decode(self, part):
        key = (part.data_ptr(), tuple(part.shape))  # a tile is a view: its offset names it
        if key not in self.cache:
            self.cache[key] = self.vae.decode(part)
        return self.cache[key]


@pytest.fixture(scope="module")
def decoded():
    vae = demo.tiny_vae(seed=0)
    lat = torch.randn(1, 128, 32, 48, generator=torch.Generator().manual_seed(0))
    memo = _Memo(vae)
    return memo, lat, vae.decode(lat), decode_tiled(memo, lat, tile=TILE, overlap=OVERLAP)


def test_tile_starts_cover_with_overlap():
    for size, tile, overlap in [(48, 32, 8), (64, 32, 8), (100, 32, 8), (33, 32, 8), (32, 32, 8), (7, 32, 8)]:
        starts = tile_starts(size, tile, overlap)
        assert starts[0] == 0
        assert starts == [0] if size <= tile else starts[-1] + tile == size
        for a, b in zip(starts, starts[1:]):
            assert a + tile - b >= overlap and b > a
    with pytest.raises(ValueError, match="larger than overlap"):
        tile_starts(64, 8, 8)


def test_tiled_decode_close_to_untiled(decoded, parity):
    memo, lat, full, tiled = decoded
    assert tiled.shape == full.shape == (1, 3, 512, 768) and tiled.dtype == full.dtype
    err = (tiled - full).abs()
    std = float(full.std())
    parity(f"VAE tiled decode (tile 24, overlap 8) max abs, output std {std:.2f}", float(err.max()))
    parity("VAE tiled decode (tile 24, overlap 8) mean abs", float(err.mean()))
    # Tiny random VAE, output std ~0.35: the error is mostly per-tile GroupNorm statistics.
    assert float(err.mean()) < 0.1 * float(full.std()) and float(err.max()) < 0.6
    small = lat[..., :20, :24].clone()  # fits one tile: decoded directly, exact
    assert torch.equal(decode_tiled(memo.vae, small, tile=TILE, overlap=OVERLAP), memo.vae.decode(small))


def test_decode_tile_says_when_a_tiled_decode_is_whole(decoded):
    """tiling.decode_tile (what GenerationResult.decode_tiles records) is None exactly where
    tiling.decode at that tile gives the whole decode's bytes."""
    memo, lat, _, _ = decoded
    for h, w, tile in ((16, 16, 16), (16, 12, 16), (32, 48, 48), (16, 20, 16), (32, 48, 32)):
        part = lat[..., :h, :w].clone()
        whole = torch.equal(vt.decode(memo.vae, part, tile), memo.vae.decode(part))
        assert (vt.decode_tile(tile, h, w) is None) == whole, (h, w, tile)
        assert vt.decode_tile(tile, h, w) in (None, tile)
    assert vt.decode_tile(None, 64, 64) is None


def _jumps(err: torch.Tensor, cols: list[int]) -> float:
    """Largest step of the error's column profile (signed mean over rows and channels, which
    averages per-pixel noise away) at ``cols``, over the 99th percentile of its steps on all
    columns: below 1 means the tile boundaries look like any other column."""
    profile = err.mean(dim=(0, 1, 2))
    step = (profile[1:] - profile[:-1]).abs()
    return float(step[cols].max() / step.quantile(0.99))


def test_blend_shows_no_seam(decoded, monkeypatch, parity):
    memo, lat, full, tiled = decoded
    w = lat.shape[-1]
    starts = tile_starts(w, TILE, OVERLAP)
    # Where a linear blend has its kinks: every tile start and end inside the image.
    kinks = sorted({s * 16 - 1 for s in starts[1:]} | {(s + TILE) * 16 - 1 for s in starts[:-1]})
    cuts = [(s + TILE + n) // 2 * 16 - 1 for s, n in zip(starts, starts[1:])]

    def hard_cut(starts, tile, size, scale):  # each pixel from one tile, cut mid-overlap
        out = []
        for k, s in enumerate(starts):
            lo = s if k == 0 else (starts[k - 1] + tile + s) // 2
            hi = min(s + tile, size) if k == len(starts) - 1 else (s + tile + starts[k + 1]) // 2
            wk = torch.zeros((min(s + tile, size) - s) * scale)
            wk[(lo - s) * scale : (hi - s) * scale] = 1
            out.append(wk)
        return out

    monkeypatch.setattr(vt, "_axis_weights", hard_cut)
    cut = decode_tiled(memo, lat, tile=TILE, overlap=OVERLAP)  # same tiles, decoded once
    blended = max(_jumps(tiled - full, kinks), _jumps(tiled - full, cuts))
    hard = _jumps(cut - full, cuts)
    parity("VAE tiled decode seam jump, linear blend (1 = no seam)", blended)
    parity("VAE tiled decode seam jump, hard cut (for contrast)", hard)
    assert blended < 1.2 and hard > 1.4, (blended, hard)


def test_tiled_encode_close_to_untiled(parity):
    vae = demo.tiny_vae(seed=1)
    g = torch.Generator().manual_seed(1)
    # Smooth random pixels (upsampled noise), a little more image-like than white noise.
    px = torch.nn.functional.interpolate(torch.rand(1, 3, 24, 32, generator=g) * 2 - 1, size=(384, 512),
                                         mode="bilinear", align_corners=False)
    full = vae.encode(px)
    tiled = encode_tiled(vae, px, tile=256, overlap=64)
    assert tiled.shape == full.shape == (1, 128, 24, 32)
    err = (tiled - full).abs()
    std = float(full.std())
    parity(f"VAE tiled encode (tile 256 px, overlap 64) max abs, latent std {std:.2f}", float(err.max()))
    parity("VAE tiled encode (tile 256 px, overlap 64) mean abs", float(err.mean()))
    assert float(err.mean()) < 0.15 * float(full.std())
    with pytest.raises(ValueError, match="multiples of 16"):
        encode_tiled(vae, px, tile=250, overlap=64)


def test_small_decoder_variant(parity):
    torch.manual_seed(5)
    cfg = VAEConfig(block_channels=(64,) * 4, decoder_block_channels=(32,) * 4, num_res_blocks=1)
    vae = Flux2VAE(cfg).eval()
    assert vae.config.variant == "FLUX.2 VAE (small decoder)"
    lat = torch.randn(1, 128, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = vae.decode(lat)
    tiled = decode_tiled(vae, lat, tile=TILE, overlap=OVERLAP)
    assert tiled.shape == full.shape == (1, 3, 512, 512)
    rel = float((tiled - full).abs().mean()) / float(full.std())
    parity("VAE (small decoder) tiled decode mean abs / output std", rel)
    assert rel < 0.15
