"""Tiled VAE decode and encode: large images in bounded memory, blended without seams.

A big latent is decoded as overlapping tiles, each an ordinary :meth:`Flux2VAE.decode` call, blended
with linear ramps across the overlaps; encoding mirrors it (pixel tiles, blended in latent space).
Any VAE with ``encode`` / ``decode`` and ``config.downscale`` works, including the small decoder.

Tiling is not exact: GroupNorms and the mid-block attention see one tile, and convolutions near a tile
edge see zero padding. The overlap and the ramps keep the difference small and smooth, with no seam
(tests/test_vae_tiling.py measures both).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# The one tile policy. A tile is given by its side in latent positions (16 px each); neighbours
# share a quarter of it. The planner tries these sides largest first; decoding that runs out of
# memory falls back through them too.
TILE_SIDES = (64, 32, 16)  # 1024, 512 and 256 px


def _count(where: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an int, checked: a TypeError naming ``name`` for a non-integer (``2.5``, ``"64"``,
    ``True``), a ValueError for one below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be at least {minimum}, got {value}.")
    return int(value)


def _tile_and_overlap(where: str, tile: object, overlap: object, unit: str) -> tuple[int, int]:
    tile, overlap = _count(where, "tile", tile, 1), _count(where, "overlap", overlap, 0)
    if tile <= overlap:
        raise ValueError(f"{where}: tile ({tile} {unit}) must be larger than overlap ({overlap} {unit}).")
    return tile, overlap


def _tensor(where: str, name: str, value: object, layout: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor {layout}, got {type(value).__name__}.")
    if value.ndim != 4 or 0 in value.shape:
        raise ValueError(f"{where}: {name} must be a non-empty tensor {layout}, got shape {list(value.shape)}.")
    return value


def tile_overlap(tile: int) -> int:
    """Latent positions shared by neighbouring tiles of side ``tile`` (16, 8, 4)."""
    return _count("tile_overlap", "tile", tile, 1) // 4


DECODE_TILE = TILE_SIDES[0]
DECODE_OVERLAP = tile_overlap(DECODE_TILE)
ENCODE_TILE = 16 * DECODE_TILE  # pixels per tile side
ENCODE_OVERLAP = 16 * DECODE_OVERLAP


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Start offsets of tiles of length ``tile`` covering ``[0, size)``, neighbours sharing at
    least ``overlap``; evenly spread, the first at 0 and the last ending at ``size``."""
    size = _count("tile_starts", "size", size, 1)
    tile, overlap = _tile_and_overlap("tile_starts", tile, overlap, "positions")
    if size <= tile:
        return [0]
    n = math.ceil((size - overlap) / (tile - overlap))
    return [round(k * (size - tile) / (n - 1)) for k in range(n)]


def _axis_weights(starts: list[int], tile: int, size: int, scale: int) -> list[torch.Tensor]:
    """1-D blend weights (output units) of each tile: a linear ramp over the overlap with each
    neighbour, 1 elsewhere; a ramp-up and the neighbour's ramp-down over the same span sum to 1."""
    spans = [(s * scale, min(s + tile, size) * scale) for s in starts]
    out = []
    for k, (a, b) in enumerate(spans):
        x = torch.arange(a, b, dtype=torch.float32) + 0.5
        w = torch.ones(b - a, dtype=torch.float32)  # float32 whatever the default dtype (as every tensor here)
        if k > 0 and spans[k - 1][1] > a:
            w = torch.minimum(w, ((x - a) / (spans[k - 1][1] - a)).clamp(0, 1))
        if k + 1 < len(spans) and spans[k + 1][0] < b:
            nxt = spans[k + 1][0]
            w = torch.minimum(w, ((b - x) / (b - nxt)).clamp(0, 1))
        out.append(w)
    return out


def _tiled(
    fn: Callable[[int, int, int, int], torch.Tensor],
    h: int,
    w: int,
    tile: int,
    overlap: int,
    scale: int,
) -> torch.Tensor:
    """Blend ``fn(y0, x0, th, tw)`` over overlapping tiles of an ``h x w`` grid.

    ``fn`` returns the result for grid rows ``y0:y0+th`` and columns ``x0:x0+tw`` as
    ``[B, C, th*scale, tw*scale]``. Blending is done in float32; the result has ``fn``'s dtype.
    """
    ys, xs = tile_starts(h, tile, overlap), tile_starts(w, tile, overlap)
    if len(ys) == 1 and len(xs) == 1:
        return fn(0, 0, h, w)
    wy = _axis_weights(ys, tile, h, scale)
    wx = _axis_weights(xs, tile, w, scale)
    acc: torch.Tensor | None = None
    norm = torch.zeros(h * scale, w * scale, dtype=torch.float32)
    for i, y0 in enumerate(ys):
        for j, x0 in enumerate(xs):
            th, tw = min(tile, h - y0), min(tile, w - x0)
            part = fn(y0, x0, th, tw)
            if acc is None:
                acc = torch.zeros(part.shape[0], part.shape[1], h * scale, w * scale, device=part.device,
                                  dtype=torch.float32)
                norm = norm.to(part.device)
                out_dtype = part.dtype
            weight = (wy[i][:, None] * wx[j][None, :]).to(part.device)
            oy, ox = y0 * scale, x0 * scale
            acc[..., oy : oy + th * scale, ox : ox + tw * scale] += part.float() * weight
            norm[oy : oy + th * scale, ox : ox + tw * scale] += weight
    assert acc is not None
    return (acc / norm).to(out_dtype)


@torch.no_grad()
def decode_tiled(
    vae, latents: torch.Tensor, *, tile: int = DECODE_TILE, overlap: int = DECODE_OVERLAP
) -> torch.Tensor:
    """Decode ``latents [B, 128, h, w]`` tile by tile: the same result as ``vae.decode`` up to the
    tiling error, ``[B, 3, 16h, 16w]`` in [-1, 1] in the VAE dtype.

    ``tile`` and ``overlap`` are in latent positions (x16 pixels). Peak activation memory is that
    of decoding one ``tile x tile`` latent. A latent no larger than one tile is decoded directly.
    """
    tile, overlap = _tile_and_overlap("decode_tiled", tile, overlap, "latent positions")
    _tensor("decode_tiled", "latents", latents, "[B, C, h, w]")
    h, w = latents.shape[-2:]
    logger.debug("tiled decode of %s latents: tile %d, overlap %d", list(latents.shape), tile, overlap)

    def run(y0: int, x0: int, th: int, tw: int) -> torch.Tensor:
        return vae.decode(latents[..., y0 : y0 + th, x0 : x0 + tw])

    return _tiled(run, h, w, tile, overlap, vae.config.downscale)


@torch.no_grad()
def encode_tiled(
    vae, pixels: torch.Tensor, *, tile: int = ENCODE_TILE, overlap: int = ENCODE_OVERLAP
) -> torch.Tensor:
    """Encode ``pixels [B, 3, H, W]`` (in [-1, 1], H and W multiples of 16) tile by tile:
    ``[B, 128, H/16, W/16]`` normalised latents, like ``vae.encode`` up to the tiling error.

    ``tile`` and ``overlap`` are in pixels and must be multiples of ``vae.config.downscale`` (16),
    so every tile starts on the latent grid; blending happens in latent space.
    """
    d = vae.config.downscale
    tile, overlap = _tile_and_overlap("encode_tiled", tile, overlap, "pixels")
    if tile % d or overlap % d:
        raise ValueError(f"encode_tiled: tile ({tile}) and overlap ({overlap}) must be multiples of {d} pixels")
    _tensor("encode_tiled", "pixels", pixels, "[B, 3, H, W]")
    if pixels.shape[-2] % d or pixels.shape[-1] % d:
        raise ValueError(f"encode_tiled expects pixels [B, 3, H, W] with H, W multiples of {d}, "
                         f"got {list(pixels.shape)}")

    def run(y0: int, x0: int, th: int, tw: int) -> torch.Tensor:
        return vae.encode(pixels[..., y0 * d : (y0 + th) * d, x0 * d : (x0 + tw) * d])

    return _tiled(run, pixels.shape[-2] // d, pixels.shape[-1] // d, tile // d, overlap // d, 1)


def decode_tile(tile: int | None, h: int, w: int) -> int | None:
    """The tile side :func:`decode` of ``h x w`` latents at ``tile`` really runs in: None when it
    decodes them whole (no tile asked, or the latents fit one tile)."""
    return None if tile is None or max(h, w) <= tile else tile


def decode(vae, latents: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """Decode whole (``tile`` None) or in tiles of ``tile`` latent positions, with the policy's overlap."""
    if tile is None:
        return vae.decode(latents)
    _count("tiling.decode", "tile", tile, 1)
    return decode_tiled(vae, latents, tile=tile, overlap=tile_overlap(tile))


def encode(vae, pixels: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """Encode whole (``tile`` None) or in tiles of ``tile`` latent positions (16x that in pixels)."""
    if tile is None:
        return vae.encode(pixels)
    _count("tiling.encode", "tile", tile, 1)
    return encode_tiled(vae, pixels, tile=16 * tile, overlap=16 * tile_overlap(tile))


__all__ = ["DECODE_OVERLAP", "DECODE_TILE", "ENCODE_OVERLAP", "ENCODE_TILE", "TILE_SIDES", "decode",
           "decode_tile", "decode_tiled", "encode", "encode_tiled", "tile_overlap", "tile_starts"]
