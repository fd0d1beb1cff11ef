"""Schedule, noise, token packing, position ids and the Euler denoising loop (pure functions over tensors).

Precision follows the reference pipelines (SPEC §4.4): the schedule is float32, the Euler update
uses the exact float32 sigmas, the transformer is given ``sigma*1000`` round-tripped through the
latent dtype, and latents are re-cast to the model dtype after every step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import GenerationCancelled
from ..models.transformer import Flux2Transformer, ReferenceKV
from ..transfer import to_device

logger = logging.getLogger(__name__)

REF_TIME_OFFSET = 10  # reference i gets RoPE time 10*(i+1) (BFL scale, ComfyUI ref_index_scale)
# How reference tokens take part: "joint" = in the sequence at the current timestep (Klein 4B/9B,
# BFL and diffusers); "timestep_zero" = in the sequence, modulated as at timestep 0 (ComfyUI's
# "index_timestep_zero"); "kv" = their keys/values computed once, alone, at timestep 0, and joined
# to every step's keys (Klein 9B-KV).
REFERENCE_MODES: tuple[str, ...] = ("joint", "timestep_zero", "kv")
MAX_SEED = 2**64 - 1  # ComfyUI seeds are unsigned 64-bit

StepCallback = Callable[[int, int, torch.Tensor], "bool | None"]


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's empirical time-shift ``mu`` for ``image_seq_len`` noisy tokens and ``num_steps`` steps."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:  # large images: the 200-step line, independent of the step count
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def get_schedule(num_steps: int, image_seq_len: int) -> torch.Tensor:
    """Sigmas ``Tensor[num_steps + 1]`` (float32) from 1 down to 0 for ``image_seq_len`` noisy tokens.

    ``linspace(1, 1/N, N)`` shifted by ``e^mu / (e^mu + (1/s - 1))`` with mu from
    :func:`compute_empirical_mu`, then a final 0; computed in float32 exactly as the diffusers
    Klein scheduler does (which equals BFL's ``get_schedule``).
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"steps must be a positive integer, got {num_steps!r}")
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be positive, got {image_seq_len}")
    mu = compute_empirical_mu(image_seq_len, num_steps)
    sigmas = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).to(torch.float32)
    # A tensor numerator on purpose: torch evaluates ``scalar / tensor`` as reciprocal-then-
    # multiply, which is 1 ulp off the reference's true division for some sigmas.
    e = torch.full_like(sigmas, math.exp(mu))
    shifted = e / (e + (torch.ones_like(sigmas) / sigmas - 1))
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float32)])  # float32 whatever the default dtype


def make_noise(seed: int, batch: int, channels: int, height: int, width: int) -> torch.Tensor:
    """Starting noise ``[batch, channels, height, width]`` (latent grid), float32 on the CPU.

    Drawn in one call from a CPU generator seeded with ``seed``, exactly like ComfyUI's
    ``RandomNoise``, so a seed gives the same image on any device and in either host. torch's CPU
    generator uses the seed's low 32 bits: seeds 2^32 apart draw the same noise (in ComfyUI too).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2^64-1], got {seed}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn((batch, channels, height, width), generator=g, dtype=torch.float32, device="cpu")


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> tokens ``[B, h*w, C]`` in row-major order."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens ``[B, h*w, C]`` -> ``[B, C, h, w]``."""
    return tokens.transpose(1, 2).unflatten(2, (height, width))


def position_ids(height: int, width: int, t: int = 0) -> torch.Tensor:
    """Image token ids ``LongTensor[height*width, 4]``, rows ``(t, h, w, 0)`` in row-major order.

    ``height``/``width`` are in tokens (pixels / 16). References use t = 10, 20, ...
    """
    if height < 1 or width < 1:
        raise ValueError(f"position_ids needs a positive grid, got {height}x{width}")
    hh, ww = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.zeros(height * width, 4, dtype=torch.long)
    ids[:, 0] = t
    ids[:, 1] = hh.reshape(-1)
    ids[:, 2] = ww.reshape(-1)
    return ids


def text_position_ids(length: int) -> torch.Tensor:
    """Text token ids ``LongTensor[length, 4]``, rows ``(0, 0, 0, l)``."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids


@dataclass(frozen=True)
class ReferenceTokens:
    """Packed reference latents ``tokens [1, R, C]`` with their ids ``[R, 4]`` (t = 10, 20, ...)."""

    tokens: torch.Tensor
    ids: torch.Tensor
    sizes: tuple[tuple[int, int], ...]  # (h, w) latent grid of each reference


def reference_tokens(latents: Sequence[torch.Tensor]) -> ReferenceTokens | None:
    """Pack encoded references (each ``[1, C, h, w]``) in order, with time offsets 10, 20, ..."""
    if not latents:
        return None
    # References may come from different places (latents given on the host, images the engine
    # encoded on the device, an init image): gather them where the first one is, as one sequence.
    device = latents[0].device
    toks, ids, sizes = [], [], []
    for i, lat in enumerate(latents):
        if lat.ndim != 4 or lat.shape[0] != 1:
            raise ValueError(f"reference {i + 1}: expected latents [1, C, h, w], got {list(lat.shape)}")
        _, _, h, w = lat.shape
        toks.append(pack(to_device(lat, device))[0])
        ids.append(position_ids(h, w, t=REF_TIME_OFFSET * (i + 1)))
        sizes.append((h, w))
    return ReferenceTokens(torch.cat(toks)[None], torch.cat(ids), tuple(sizes))


@dataclass(frozen=True)
class TextPass:
    """One transformer forward per step: the text ``[copies * B, L, D]``, its ids and the RoPE tables
    of the joint [text, image] sequence (fixed for the run), and how many copies of the latents it
    takes (2 for a batched CFG forward ``[pos; neg]``)."""

    text: torch.Tensor
    txt_ids: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    copies: int


@dataclass(frozen=True)
class InpaintBlend:
    """What inpainting keeps (float32 tokens): ``clean`` image latents, the starting ``noise``, and
    ``keep`` (1 = repaint) / ``known`` (1 - keep) per token."""

    clean: torch.Tensor
    noise: torch.Tensor
    keep: torch.Tensor
    known: torch.Tensor


@dataclass(frozen=True)
class DenoiseJob:
    """Everything the Euler loop reads, prepared once by :func:`prepare_denoise`.

    ``latents``: the starting tokens ``[B, n, C]`` in the model dtype (n = h*w noisy tokens);
    ``sigmas``: float32 on the device, ``t_model`` what the model is told per step, ``dts`` the
    step sizes; ``ref_tokens`` the joint/timestep-zero reference tokens appended to every forward,
    ``kv`` the KV mode's stored keys/values.
    """

    model: Flux2Transformer
    latents: torch.Tensor
    grid: tuple[int, int]
    img_ids: torch.Tensor
    passes: tuple[TextPass, ...]
    sigmas: torch.Tensor
    t_model: torch.Tensor
    dts: torch.Tensor
    guidance: float
    ref_tokens: torch.Tensor | None = None
    kv: ReferenceKV | None = None
    zero_time: int = 0
    blend: InpaintBlend | None = None

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def cfg(self) -> bool:
        return self.passes[0].copies == 2 or len(self.passes) == 2


def _start_latents(model: Flux2Transformer, noise: torch.Tensor, sigma0: torch.Tensor,
                   image: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, InpaintBlend | None]:
    """The first step's tokens: the noise, or for image-to-image ``sigma0 * noise + (1 - sigma0) *
    image`` (diffusers' scale_noise); with a ``mask`` also what each step keeps."""
    device, dtype = model.device, model.dtype
    b = noise.shape[0]
    if image is None:
        if mask is not None:
            raise ValueError("a mask needs the image latents it keeps (image=)")
        # The same strides and rounding as casting on the host; the copy is queued (klein_core.transfer).
        return pack(to_device(noise, device)).to(dtype), None
    if image.ndim != 4 or image.shape[1:] != noise.shape[1:] or image.shape[0] not in (1, b):
        raise ValueError(f"image latents {list(image.shape)} do not match the noise {list(noise.shape)}")
    clean = pack(to_device(image, device, torch.float32)).expand(b, -1, -1)
    noise_f = pack(to_device(noise, device, torch.float32))
    s0 = to_device(sigma0, device, torch.float32)
    latents = (s0 * noise_f + (1 - s0) * clean).to(dtype)
    if mask is None:
        return latents, None
    keep = pack(to_device(mask, device, torch.float32))  # [B or 1, n, 1]: 1 = repaint
    return latents, InpaintBlend(clean, noise_f, keep, 1 - keep)  # known = 1 - keep once, not every step


def _reference_inputs(model: Flux2Transformer, refs: ReferenceTokens | None, ref_mode: str,
                      ref_kv: ReferenceKV | None, img_ids: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor | None, ReferenceKV | None, int]:
    """``(img_ids, reference tokens, stored keys/values, zero-time tokens)`` for ``ref_mode``: in
    "kv" mode the references' keys/values (computed now unless ``ref_kv`` holds them), otherwise
    their tokens after the noisy ones, with their ids."""
    if refs is None:
        return img_ids, None, None, 0
    if ref_mode == "kv":
        return img_ids, None, (ref_kv if ref_kv is not None else model.reference_kv(refs.tokens, refs.ids)), 0
    tokens = to_device(refs.tokens, model.device, model.dtype)
    zero_time = tokens.shape[1] if ref_mode == "timestep_zero" else 0
    return torch.cat([img_ids, refs.ids]), tokens, None, zero_time


def _text_passes(model: Flux2Transformer, txt: torch.Tensor, neg_txt: torch.Tensor | None, batch: int,
                 img_ids: torch.Tensor) -> tuple[TextPass, ...]:
    """The forwards of one step: the prompt alone, or with CFG the prompt and the negative prompt in
    one batched forward when their lengths match (two forwards otherwise, as ComfyUI runs them)."""
    device, dtype = model.device, model.dtype
    txt = to_device(txt, device, dtype)
    if txt.shape[0] != batch:
        raise ValueError(f"prompt batch {txt.shape[0]} does not match latent batch {batch}")
    texts = [txt]
    if neg_txt is not None:
        neg_txt = to_device(neg_txt, device, dtype)
        if neg_txt.shape[0] != batch:
            raise ValueError(f"negative prompt batch {neg_txt.shape[0]} does not match latent batch {batch}")
        texts = [torch.cat([txt, neg_txt])] if neg_txt.shape[1] == txt.shape[1] else [txt, neg_txt]
    passes = []
    for text in texts:  # ids and RoPE tables are fixed for the whole run
        txt_ids = text_position_ids(text.shape[1])
        passes.append(TextPass(text, txt_ids, model.rope(txt_ids, img_ids), text.shape[0] // batch))
    return tuple(passes)


def prepare_denoise(
    model: Flux2Transformer,
    noise: torch.Tensor,
    txt: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    neg_txt: torch.Tensor | None = None,
    guidance: float = 1.0,
    refs: ReferenceTokens | None = None,
    image: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ref_mode: str = "joint",
    ref_kv: ReferenceKV | None = None,
) -> DenoiseJob:
    """Prepare one run of :func:`run_denoise` (arguments as :func:`denoise`): the starting latents
    and the inpaint blend, the references for ``ref_mode``, the text passes and their RoPE tables,
    and the schedule on the device."""
    if ref_mode not in REFERENCE_MODES:
        raise ValueError(f"ref_mode must be one of {REFERENCE_MODES}, got {ref_mode!r}")
    b, _, h, w = noise.shape
    latents, blend = _start_latents(model, noise, sigmas[0], image, mask)
    img_ids, ref_tokens, kv, zero_time = _reference_inputs(model, refs, ref_mode, ref_kv, position_ids(h, w))
    passes = _text_passes(model, txt, neg_txt, b, img_ids)
    sig = to_device(sigmas, model.device, torch.float32)
    # What the model is told: sigma*1000 in the latent dtype, /1000 (see SPEC §4.4).
    t_model = ((sig * 1000).to(model.dtype) / 1000).to(model.dtype)
    dts = sig[1:] - sig[:-1]  # one launch for the whole run; dts[i] is a 0-dim fp32 tensor in the loop
    return DenoiseJob(model, latents, (h, w), img_ids, passes, sig, t_model, dts, guidance, ref_tokens, kv,
                      zero_time, blend)


def _velocity(job: DenoiseJob, latents: torch.Tensor, i: int) -> torch.Tensor:
    """The model's velocity for the noisy tokens at step ``i`` (CFG applied)."""
    n = latents.shape[1]
    outs = []
    for p in job.passes:
        x = latents if p.copies == 1 else torch.cat([latents] * p.copies)
        if job.ref_tokens is not None:
            x = torch.cat([x, job.ref_tokens.expand(x.shape[0], -1, -1)], dim=1)
        outs.append(job.model(img=x, img_ids=job.img_ids, txt=p.text, txt_ids=p.txt_ids,
                              timesteps=job.t_model[i].expand(x.shape[0]), rope=p.rope, kv=job.kv,
                              zero_time_tokens=job.zero_time)[:, :n])
    v = outs[0] if len(outs) == 1 else torch.cat(outs)
    if not job.cfg:
        return v
    v_pos, v_neg = v.chunk(2)
    return v_neg + job.guidance * (v_pos - v_neg)


def _keep_known(blend: InpaintBlend, latents: torch.Tensor, sigma: torch.Tensor | None) -> torch.Tensor:
    """Inpainting after a step: the known region follows the image noised to ``sigma`` (the clean
    image after the last step, ``sigma`` None); float32 out."""
    proper = blend.clean if sigma is None else sigma * blend.noise + (1 - sigma) * blend.clean
    return blend.known * proper + blend.keep * latents.float()


def run_denoise(job: DenoiseJob, callback: StepCallback | None = None) -> torch.Tensor:
    """The Euler loop over a prepared job; returns the latents ``[B, C, h, w]`` in the model dtype."""
    (h, w), total = job.grid, job.steps
    step_cache = getattr(job.model, "step_cache", None)
    if step_cache is not None:  # opt-in (klein_core.accel.step_cache): no state from an earlier run
        step_cache.start_run(total, h * w)
    try:
        return _euler_loop(job, callback)
    finally:
        # A cancelled or failed run leaves the cache's residuals on the device otherwise (a finished
        # run has released them already). A hook without finish_run keeps its own state.
        finish = getattr(step_cache, "finish_run", None)
        if finish is not None:
            finish()


def _euler_loop(job: DenoiseJob, callback: StepCallback | None) -> torch.Tensor:
    """The steps of :func:`run_denoise`; returns the latents ``[B, C, h, w]`` in the model dtype."""
    latents, (h, w), total, dtype = job.latents, job.grid, job.steps, job.model.dtype
    wants_denoised = bool(getattr(callback, "wants_denoised", False))
    for i in range(total):
        with torch.profiler.record_function("klein.step"):  # for torch.profiler; ~1 us without one
            v = _velocity(job, latents, i)
        denoised = (latents.float() - job.sigmas[i] * v.float()) if wants_denoised else None
        # dt is a 0-dim fp32 tensor, so dt*v stays in the model dtype (torch promotion), then the
        # sum is fp32 and re-cast: bit-for-bit the diffusers FlowMatchEuler step.
        latents = (latents.float() + job.dts[i] * v).to(dtype)
        if job.blend is not None:
            last = i == total - 1
            latents = _keep_known(job.blend, latents, None if last else job.sigmas[i + 1]).to(dtype)
            if denoised is not None:
                denoised = job.blend.known * job.blend.clean + job.blend.keep * denoised
        if callback is not None:
            kwargs = {"denoised": unpack(denoised, h, w)} if denoised is not None else {}
            if callback(i + 1, total, unpack(latents, h, w), **kwargs) is False:
                raise GenerationCancelled(f"cancelled after step {i + 1} of {total}")
    return unpack(latents, h, w)


def denoise(
    model: Flux2Transformer,
    noise: torch.Tensor,
    txt: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    neg_txt: torch.Tensor | None = None,
    guidance: float = 1.0,
    refs: ReferenceTokens | None = None,
    callback: StepCallback | None = None,
    image: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ref_mode: str = "joint",
    ref_kv: ReferenceKV | None = None,
) -> torch.Tensor:
    """Run the Euler sampler from ``noise`` along ``sigmas`` (:func:`prepare_denoise` + :func:`run_denoise`).

    ``noise`` ``[B, C, h, w]`` (cast to the model's dtype and device); ``txt`` ``[B, L, D]``; ``neg_txt``
    ``[B, L', D]`` turns on CFG, ``v = v_neg + guidance * (v_pos - v_neg)``. ``refs`` take part as
    ``ref_mode`` (:data:`REFERENCE_MODES`) says; in "kv" mode ``ref_kv`` may hold their keys/values from
    an earlier run. ``callback(step, total, latents)`` runs after each step (``False`` cancels with
    :class:`GenerationCancelled`; one with ``wants_denoised`` also gets ``denoised=``). Image-to-image /
    inpainting: ``image`` ``[B or 1, C, h, w]`` clean latents, ``sigmas`` already cut by the strength,
    ``mask`` ``[B or 1, 1, h, w]`` (1 = repaint, fractions blend) keeps the rest, noised to each next
    sigma. Returns ``[B, C, h, w]`` latents in the model dtype.
    """
    with torch.profiler.record_function("klein.prepare_denoise"):
        job = prepare_denoise(model, noise, txt, sigmas, neg_txt=neg_txt, guidance=guidance, refs=refs,
                              image=image, mask=mask, ref_mode=ref_mode, ref_kv=ref_kv)
    return run_denoise(job, callback)
