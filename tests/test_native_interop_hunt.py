"""Hunt: the pack's objects inside ComfyUI 0.3.75's own core nodes (native interop), in-process on the
CPU with the tiny random models of tests/test_native_model.py (fp32 unless a test says otherwise).

Tests whose docstring begins "Was a bug:" failed on the code before their fix; the others pin
documented interop promises no other test checked.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
from test_native_model import (  # noqa: F401
    M4B,
    M4B_BASE,
    PACK,
    Q4B,
    SEED,
    STEPS,
    TOL,
    VAE,
    H,
    W,
    _bridge,
    _core,
    _diff,
    _encode,
    _klein,
    _load,
    _native_cond,
    _refs,
    host,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRIMMED = "512, padding trimmed (approximate)"


def _encoder_outputs(h, prompt="a red fox in the snow", negative="", max_tokens="512"):
    """Qwen3 Layer-Concat Encoder's three outputs: KLEIN_COND, positive and negative CONDITIONING."""
    with torch.inference_mode():
        return h.pack.KleinTextEncode.execute(Q4B, prompt, negative, "model dtype", max_tokens).args


def _loaded(h, weight_dtype: str, name=M4B, kind="auto"):
    with torch.inference_mode():
        return h.pack.KleinModelLoader.execute(name, VAE, weight_dtype, kind).args[0]


def _core_batch(h, native_model, positive, negative=None, cfg=1.0, batch=1) -> torch.Tensor:
    """SamplerCustomAdvanced(RandomNoise, Basic/CFGGuider, euler, Flux2Scheduler) on an
    EmptyFlux2LatentImage of ``batch`` images."""
    cs = h.cs
    with torch.inference_mode():
        guider = (cs.BasicGuider.execute(native_model, positive) if negative is None else
                  cs.CFGGuider.execute(native_model, positive, negative, cfg)).args[0]
        latent = h.flux.EmptyFlux2LatentImage.execute(W, H, batch).args[0]
        out = cs.SamplerCustomAdvanced.execute(cs.RandomNoise.execute(SEED).args[0], guider,
                                               cs.KSamplerSelect.execute("euler").args[0],
                                               h.flux.Flux2Scheduler.execute(STEPS, W, H).args[0], latent)
    return out.args[0]["samples"]


# ----- bugs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["distilled", "base_cfg"])
def test_trimmed_conditioning_through_klein_model_to_model_equals_the_klein_sampler(host, case):  # noqa: F811
    """Was a bug: the encoder's max_tokens "512, padding trimmed" gives 64-token embeddings; through Klein
    Model to MODEL (encoder positive/negative -> BasicGuider/CFGGuider -> SamplerCustomAdvanced, euler,
    Flux2Scheduler) ComfyUI's ``model_base.Flux2.extra_conds`` pads them back to 512 tokens, with 448
    zero rows put *in front of* the prompt, and the Klein transformer runs on that. The user gets
    neither the trimmed speed nor the Klein Sampler's image: max abs 0.025 (distilled) / 0.042 (base,
    CFG 2.5) apart, about what trimming itself changes (0.023 against the 512-token prompt), where
    docs/comfyui.md promises the bridged MODEL equals the Klein Sampler within 1.3e-6. (The Klein
    Sampler given those 448 zero rows in front gives the bridged result within 6e-7.) Whole prompts
    and 512-token prompts are not padded, and match (below). Cause: ``host.native_flux2_model`` wraps
    the adapter in ``comfy.model_base.Flux2``, whose extra_conds pads any context under 512 tokens."""
    base = case == "base_cfg"
    model = _loaded(host, "fp32", M4B_BASE if base else M4B, "base" if base else "auto")
    cond, positive, negative = _encoder_outputs(host, "a red fox", "blurry" if base else "", TRIMMED)
    assert cond.positive.shape[1] == 64  # trimmed: fewer than 512 tokens
    kw = {"guidance": 2.5} if base else {}
    ours = _klein(host, model, cond, **kw)
    native = _bridge(host, model)
    seen: list[int] = []
    forward = native.model.diffusion_model._forward
    native.model.diffusion_model._forward = lambda x, t, context, *a, **k: (  # what the adapter receives
        seen.append(context.shape[1]), forward(x, t, context, *a, **k))[1]
    theirs = _core(host, native, positive, negative if base else None, cfg=2.5)
    diff = _diff(ours, theirs)
    assert diff <= TOL, (f"bridged MODEL vs Klein Sampler with trimmed prompts: max abs {diff:.3g}; the adapter "
                         f"got contexts of {sorted(set(seen))} tokens for a {cond.positive.shape[1]}-token prompt")


def test_unload_models_leaves_one_copy_of_the_transformer_for_both_paths(host):  # noqa: F811
    """Was a bug: a graph with Klein Model to MODEL (-> SamplerCustomAdvanced) and a Klein Sampler on the
    same loader. "Unload models" (POST /free with unload_models; ComfyUI keeps its node-output cache)
    runs the pack's hook, which drops its transformer; but the bridged MODEL in ComfyUI's cache still
    holds that transformer's weights (its module view shares them). The next queue (a new seed) makes
    the Klein Sampler load the file again, and from then on the two paths each hold a full copy of the
    weights (0 of the bridged MODEL's parameters are the Klein Sampler's): twice the transformer in
    memory, where docs/comfyui.md says Unload models / POST /free releases the models and the pack
    keeps one transformer (tests/test_nodes.py checks the pack's own outputs never pin a released
    transformer; Klein Model to MODEL's output does). Cause: ``native_model.bridge`` binds the view to
    the transformer of the moment for the MODEL's lifetime; ``cache.release_all`` cannot reach it.
    Now the pack's cache keeps a weak reference to what it releases and takes the transformer back
    while the bridged MODEL holds it: one copy, no second read."""
    from klein_core.memory.placement import module_bytes

    cache = importlib.import_module(f"{PACK}.cache")
    model = _loaded(host, "fp32")
    cond, positive, _ = _encoder_outputs(host)
    native = _bridge(host, model)  # held by ComfyUI's output cache across queues
    _core(host, native, positive)
    loads = cache.loads["transformer"]
    host.mm.unload_all_models()  # what POST /free {"unload_models": true} runs
    gc.collect()
    _klein(host, model, cond)  # the next queue: the Klein Sampler runs again
    # The transformer the bridged MODEL still holds is taken back, not read from the file beside it.
    assert cache.loads["transformer"] == loads
    current = model.ref.get()
    assert current is native.model.diffusion_model.source_model
    bridged = dict(native.model.diffusion_model.named_parameters())
    shared = sum(bridged[k] is p for k, p in current.named_parameters())
    pinned = module_bytes(native.model.diffusion_model)
    assert shared == len(bridged), (f"after Unload models the bridged MODEL still holds its own {pinned} bytes of "
                                    f"weights: {shared} of {len(bridged)} parameters shared with the Klein "
                                    f"Sampler's reloaded transformer ({module_bytes(current)} bytes)")


def test_unload_models_takes_back_the_base_of_a_lorad_bridged_model(host, tmp_path):  # noqa: F811
    """Review of the fix above: Klein LoRA Loader -> Klein Model to MODEL bridged the LoRA copy, which
    does not hold its base model; after Unload models the base was freed and read again from its file
    while the bridged MODEL still held the shared tensors. The bridged MODEL now holds the base, and
    the cache takes that back."""
    import dataclasses

    from train_files import nonzero_lora

    import klein_core as kc
    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    cache = importlib.import_module(f"{PACK}.cache")
    lora_mod = importlib.import_module(f"{PACK}.lora")
    model = _loaded(host, "fp32")
    base = model.ref.get()
    lora = kc.load_lora(save_lora(tmp_path / "l.safetensors", nonzero_lora(base, preset("style", rank=2)),
                                  fmt="comfyui"))
    lorad = dataclasses.replace(model, ref=lora_mod.LoRAModelRef(model.ref, [(lora, 1.0)]))
    native = _bridge(host, lorad)
    assert native.model.diffusion_model.source_model is base
    del base
    loads = cache.loads["transformer"]
    host.mm.unload_all_models()
    gc.collect()
    assert model.ref.get() is native.model.diffusion_model.source_model  # taken back
    assert cache.loads["transformer"] == loads


def test_a_batched_conditioning_is_refused_or_gives_batch_size_images(host):  # noqa: F811
    """Was a bug: the Klein Sampler says a native conditioning must be "one CONDITIONING entry [1, tokens,
    width]" (``sampler._native_entry``'s docstring and refusal text), but it checks only ndim == 3: a
    CONDITIONING whose tensor holds 2 prompts ``[2, 512, D]`` (a batch-prompt node's output) is taken,
    and klein_core treats its rows as prompts, each with ``batch_size`` images: batch_size 2 gives 4
    latents (1 gives 2, 3 gives 6), where the widget says "Images per run" and ComfyUI's own samplers
    with the same conditioning on a 2-image latent give 2 (one per prompt). Cause: ``_native_entry``
    does not check ``value[0][0].shape[0] == 1``."""
    model = _loaded(host, "fp32")
    fox = _encode(host, "a red fox").positive
    car = _encode(host, "a blue car").positive
    batched = [[torch.cat([fox, car]), {"pooled_output": None}]]
    try:
        out = _klein(host, model, batched, batch_size=2)
    except ValueError as exc:  # refused, by input name: fine
        assert "Klein Sampler: conditioning" in str(exc), exc
        return
    assert out.shape[0] == 2, f"batch_size 2 with a 2-row conditioning gave {out.shape[0]} latents"


# ----- promises pinned ------------------------------------------------------------------------------


def test_batch_of_two_with_reference_latents_and_cfg_equals_the_klein_sampler(host, parity):  # noqa: F811
    """docs/comfyui.md: the bridged MODEL equals the Klein Sampler (fp32, euler); the tests only ran
    batch 1. Base model, CFG 2.5, two ReferenceLatent references on positive and negative, an
    EmptyFlux2LatentImage of 2: ComfyUI batches cond and uncond (4 rows) with each batch-1 reference
    repeated, and RandomNoise draws the noise for the whole batch, as the Klein Sampler's batch_size 2.
    Measured 1.7e-6."""
    model = _loaded(host, "fp32", M4B_BASE, "base")
    _, vae = _load(host)
    cond = _encode(host, negative="blurry")
    refs = _refs(host, vae)
    lats = [r.latent for r in refs.items]
    ours = _klein(host, model, cond, references=refs, batch_size=2, guidance=2.5)
    theirs = _core_batch(host, _bridge(host, model), _native_cond(host, cond.positive, lats),
                         _native_cond(host, cond.negative, lats), cfg=2.5, batch=2)
    assert ours.shape == (2, 128, H // 16, W // 16) and _diff(ours[0], ours[1]) > 0.1  # two different images
    diff = parity("native MODEL vs Klein Sampler (batch 2, 2 references, CFG 2.5, fp32)", _diff(ours, theirs))
    assert diff <= TOL, diff


def test_whole_prompt_longer_than_512_with_cfg_equals_the_klein_sampler(host, parity):  # noqa: F811
    """max_tokens "whole prompt" (ComfyUI's own text: nothing cut) gives a 733-token prompt and a
    512-token negative: ComfyUI cannot batch them and runs two passes, at their own lengths, as the
    Klein Sampler does; the bridged MODEL's CFG equals it. Measured 1.4e-6."""
    model = _loaded(host, "fp32", M4B_BASE, "base")
    long = "a red fox jumping over a lazy brown dog in the snow " * 60
    cond, positive, negative = _encoder_outputs(host, long, "blurry", "whole prompt")
    assert cond.positive.shape[1] > 512 and cond.negative.shape[1] == 512
    ours = _klein(host, model, cond, guidance=2.5)
    theirs = _core(host, _bridge(host, model), positive, negative, cfg=2.5)
    diff = parity("native MODEL vs Klein Sampler (whole prompt > 512 tokens, CFG, fp32)", _diff(ours, theirs))
    assert diff <= TOL, diff


@pytest.mark.parametrize("weight_dtype", ["fp8", "q8"])
def test_a_lora_branch_and_a_plain_branch_share_one_bridged_model(host, tmp_path, weight_dtype):  # noqa: F811
    """One Klein Model to MODEL feeding both a LoraLoaderModelOnly branch and a plain branch (ComfyUI
    clones share the model object, so it patches and unpatches the same view): on fp8 blocks (a
    re-quantised scale while patched) and GGUF q8 blocks (patches applied per call) the plain branch
    after the LoRA branch gives exactly its first result, the LoRA branch again its own, and the
    Klein Sampler on the same KLEIN_MODEL is untouched."""
    import comfy.sd
    from safetensors.torch import load_file
    from train_files import nonzero_lora

    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    path = save_lora(tmp_path / "branch.safetensors",
                     nonzero_lora(_loaded(host, "fp32").ref.get(), preset("full", rank=2)), fmt="comfyui")
    model = _loaded(host, weight_dtype)
    cond = _encode(host)
    positive = _native_cond(host, cond.positive)
    klein_before = _klein(host, model, cond)
    native = _bridge(host, model)
    plain = _core(host, native, positive)
    with torch.inference_mode():
        lora_branch, _ = comfy.sd.load_lora_for_models(native, None, load_file(str(path)), 1.0, 0)
    with_lora = _core(host, lora_branch, positive)
    assert _diff(plain, with_lora) > 1e-2  # the LoRA applies
    assert torch.equal(_core(host, native, positive), plain)
    assert torch.equal(_core(host, lora_branch, positive), with_lora)
    assert torch.equal(_klein(host, model, cond), klein_before)
