"""Memory hunt on the CPU (plain) path: intermediates far larger than the computation needs, SDPA
falling back to its math path, and real peaks against the planner's estimates.

Peaks are measured with ``torch.profiler`` (``profile_memory=True``): every allocation and free of
the run, in time order, summed; so the numbers are the bytes the run itself allocates on top of the
weights, the same quantity the planner's activation formulas estimate.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from klein_core.lora import apply_loras, load_lora
from klein_core.memory.planner import MemoryRequest, ModelSizes, estimate
from klein_core.models.qwen3 import Qwen3Config, Qwen3TextEncoder
from klein_core.pipeline.sampling import denoise, position_ids, reference_tokens, text_position_ids
from klein_core.testing import tiny_transformer

SDPA_MATH = "aten::_scaled_dot_product_attention_math"


def _run_profiled(fn):
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return prof


def _peak_bytes(fn) -> int:
    """Peak of the bytes ``fn`` holds allocated at once (allocations and frees in time order)."""
    prof = _run_profiled(fn)
    mem = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                 key=lambda e: e.start_ns())
    live = peak = 0
    for e in mem:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _sdpa_allocations(fn) -> tuple[int, set[str]]:
    """The largest allocation made inside an SDPA call, and the names of the ops that ran."""
    prof = _run_profiled(fn)
    events = prof.events()
    largest = max((e.cpu_memory_usage for e in events if e.name == "aten::scaled_dot_product_attention"), default=-1)
    return largest, {e.name for e in events}


def _block_lora(model: nn.Module, prefix: str, rank: int = 4, seed: int = 0):
    """A rank-``rank`` LoRA on every Linear inside the model's block lists."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for list_name, blocks in model.named_children():
        if not isinstance(blocks, nn.ModuleList):
            continue
        for name, m in blocks.named_modules():
            if isinstance(m, nn.Linear):
                o, i = m.weight.shape
                sd[f"{prefix}{list_name}.{name}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.05
                sd[f"{prefix}{list_name}.{name}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.05
    return load_lora(sd)


def _text_encoder(heads: int = 4, kv_heads: int = 2, hidden: int = 64, inter: int = 256) -> Qwen3TextEncoder:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      intermediate_size=inter, vocab_size=1000, num_layers_in_file=27)
    return Qwen3TextEncoder(cfg).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# LoRA branches


def test_branch_lora_adds_no_output_sized_temporaries_to_the_transformer_peak():
    """Was a bug: ``LoRABranch.__call__`` (klein_core/lora/apply.py) adds a LoRA's output out of place:
    ``extra = F.linear(F.linear(x, A), B)`` is a full ``[tokens, out_features]`` tensor and ``output +
    extra`` a second one, while the module's own output is still alive. On a single block's fused
    ``linear1`` (out = 3 x hidden + 2 x mlp_hidden = 9 x hidden) that is 18 hidden maps per token of
    temporaries where the adapter needs only ``[tokens, rank]``. Measured on the tiny transformer,
    1024 + 64 tokens, fp32, rank 4: one forward peaks at 5.92 MB with the LoRA merged and 8.36 MB as a
    branch (+41 %, 8.8 hidden maps per token); with the fix below the branch peak equals the merged
    one (28.6 MB both for a 4096-token denoise, against 37.3 MB now). The planner counts only the
    branch factors (``ModelSizes.from_modules``), never these temporaries; branch mode is what GGUF
    / NVFP4 models and the LoRA node use.

    Fix (klein_core/lora/apply.py, ``LoRABranch.__call__``): when no gradient is needed (``not
    (torch.is_grad_enabled() and output.requires_grad)``, as ``_run_steps`` already does) add into
    the module's fresh output in place: ``output.view(-1, out).addmm_(F.linear(x, A).view(-1, r), B.t())``
    for the low-rank factors (and ``addmm_`` with ``dense.t()`` / ``output[..., rows] += ...`` for the
    dense and LoKr parts), so only the ``[tokens, rank]`` product is ever allocated.
    """
    model = tiny_transformer()
    ids, tids = position_ids(32, 32), text_position_ids(64)
    g = torch.Generator().manual_seed(0)
    inputs = dict(img=torch.randn(1, ids.shape[0], 128, generator=g), img_ids=ids,
                  txt=torch.randn(1, 64, model.config.context_dim, generator=g), txt_ids=tids,
                  timesteps=torch.tensor([0.5]), rope=model.rope(tids, ids))
    lora = _block_lora(model, "diffusion_model.")
    peaks = {}
    for mode in ("merge", "branch"):
        handle = apply_loras(model, [(lora, 0.8)], mode=mode)
        try:
            peaks[mode] = _peak_bytes(lambda: model(**inputs))
        finally:
            handle.remove()
    hidden_map = (ids.shape[0] + 64) * model.config.hidden_size * 4  # one [tokens, hidden] fp32 tensor
    extra = peaks["branch"] - peaks["merge"]
    assert extra <= hidden_map, (
        f"branch LoRA peak {peaks['branch']} B vs merged {peaks['merge']} B: {extra / hidden_map:.1f} hidden "
        f"maps per token of output-sized temporaries (the adapter needs [tokens, rank] only)")


def test_branch_lora_on_the_text_encoder_stays_under_the_planner_text_estimate():
    """Was a bug: the same out-of-place add in ``LoRABranch.__call__`` (klein_core/lora/apply.py) lands on
    the text encoder's peak: the planner's text formula (``text_activation_bytes``: five hidden-size
    and three intermediate-size maps, the late layers' MLP) is exceeded because a branch on
    ``mlp.up_proj`` holds its output, ``extra`` and ``output + extra`` at once while the SiLU of the gate
    is alive: four intermediate-size maps instead of three. Measured (hidden 64, intermediate 256, 27
    layers, 128 tokens, fp32, rank 4): 606,336 B merged, 737,408 B as a branch (+1.00 intermediate
    map, +22 %), against a planner estimate of 589,824 B (the branch run is 25 % above it; for Qwen3-4B
    that is +10 MB per 512-token prompt in bf16, uncounted). With the in-place add the branch peak is
    the merged one.

    Fix (klein_core/lora/apply.py, ``LoRABranch.__call__``): add into ``output`` in place with
    ``addmm_`` of the ``[tokens, rank]`` product when no gradient is needed (see the transformer test).
    """
    te = _text_encoder()
    length = 128
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, length, dtype=torch.long)
    mask[:, 96:] = 0  # right padded, as Klein's prompts
    est = estimate(MemoryRequest(text_length=length, denoise=False, decode=False),
                   ModelSizes.from_modules(text_encoder=te)).stages["text"].activations
    lora = _block_lora(te, "text_encoder.model.")
    peaks = {}
    for mode in ("merge", "branch"):
        handle = apply_loras(te, [(lora, 1.0)], mode=mode)
        try:
            peaks[mode] = _peak_bytes(lambda: te.encode(ids, mask))
        finally:
            handle.remove()
    inter_map = length * te.config.intermediate_size * 4
    extra = peaks["branch"] - peaks["merge"]
    assert extra < inter_map // 4, (
        f"text encoder with a branch LoRA peaks at {peaks['branch']} B (merged: {peaks['merge']} B, planner "
        f"estimate {est} B): {extra / inter_map:.2f} intermediate-size maps of LoRA temporaries")


# ---------------------------------------------------------------------------------------------
# SDPA on the plain path: the CPU flash kernel, never the scores


@pytest.mark.parametrize("case", ["joint", "batch_ids", "kv"])
def test_transformer_attention_takes_the_cpu_flash_kernel(case):
    """Edge case (the VAE's mid attention has this check, the transformer's joint attention had none):
    the plain path's q/k/v (views of the fused projections, RoPE applied, text and image joined, and
    in KV mode the stored reference keys joined) reach SDPA with the head dim innermost, so SDPA runs
    its CPU flash kernel and no SDPA call allocates anything near one head's L x L scores. Covered:
    one sequence with [N, 4] ids, a batch of two with per-sequence [B, N, 4] ids, and KV mode."""
    model = tiny_transformer()
    g = torch.Generator().manual_seed(0)
    b = 2 if case == "batch_ids" else 1
    ids = position_ids(24, 24)
    if case == "batch_ids":
        ids = torch.stack([ids, position_ids(24, 24, t=1)])
    tids = text_position_ids(32)
    kwargs = {}
    ref_tokens = 0
    if case == "kv":
        ref = torch.randn(1, 16 * 16, 128, generator=g)
        kwargs["kv"] = model.reference_kv(ref, position_ids(16, 16, t=10))
        ref_tokens = ref.shape[1]
    img = torch.randn(b, 24 * 24, 128, generator=g)
    txt = torch.randn(b, 32, model.config.context_dim, generator=g)
    largest, names = _sdpa_allocations(lambda: model(img=img, img_ids=ids, txt=txt, txt_ids=tids,
                                                     timesteps=torch.full((b,), 0.5), **kwargs))
    tokens = 24 * 24 + 32
    one_head_scores = b * tokens * (tokens + ref_tokens) * 4
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names and SDPA_MATH not in names
    assert 0 < largest < one_head_scores // 8, (largest, one_head_scores)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_text_encoder_masked_gqa_attention_takes_the_cpu_flash_kernel(padding):
    """Edge case (not covered): the text encoder's attention has an explicit boolean [B, 1, L, L] mask
    (causal and padding; left padding also takes the blind-row path) and grouped-query heads
    (repeated k/v). SDPA still runs its CPU flash kernel: the only L x L allocation inside an SDPA call
    is the mask converted to an additive float one ([B, 1, L, L], once, not per head); the scores
    ([B, H, L, L]) never exist."""
    te = _text_encoder(heads=8, kv_heads=2)
    length, b = 384, 2
    ids = torch.randint(0, 1000, (b, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(b, length, dtype=torch.long)
    if padding == "right":
        mask[0, 200:] = 0
    else:
        mask[1, :150] = 0
    largest, names = _sdpa_allocations(lambda: te.encode(ids, mask))
    float_mask = b * length * length * 4
    scores = te.config.num_attention_heads * float_mask
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names and SDPA_MATH not in names
    assert 0 < largest <= float_mask + float_mask // 8 < scores // 4, (largest, float_mask, scores)


# ---------------------------------------------------------------------------------------------
# Real CPU peaks against the planner


@pytest.mark.parametrize("mode", ["joint", "timestep_zero", "kv"])
def test_denoise_peak_stays_under_the_planner_estimate(mode):
    """Edge case (tests/test_planner.py checks the formulas against a meta-device trace only, which
    assumes an efficient SDPA): a real CPU denoise with CFG and two references, in each reference mode,
    allocates no more than the planner's denoise estimate (measured 0.66-0.75 of it)."""
    model = tiny_transformer()
    g = torch.Generator().manual_seed(0)
    side, text = 512, 64
    h = side // 16
    noise = torch.randn(1, 128, h, h, generator=g)
    txt = torch.randn(1, text, model.config.context_dim, generator=g)
    neg = torch.randn(1, text, model.config.context_dim, generator=g)
    refs = reference_tokens([torch.randn(1, 128, h, h, generator=g), torch.randn(1, 128, h, h, generator=g)])
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    peak = _peak_bytes(lambda: denoise(model, noise, txt, sigmas, neg_txt=neg, guidance=2.0, refs=refs,
                                       ref_mode=mode))
    req = MemoryRequest(width=side, height=side, references=((side, side),) * 2, text_length=text, cfg=True,
                        encode_text=False, decode=False, reference_kv=mode == "kv",
                        per_token_modulation=mode == "timestep_zero")
    est = estimate(req, ModelSizes.from_modules(transformer=model)).stages["denoise"].activations
    assert peak <= est, f"{mode}: measured peak {peak} B above the planner's estimate {est} B"
