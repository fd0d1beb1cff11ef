"""Dtypes and precision across the public paths (hunt).

What is probed: the dtype choices a user makes (the loaders' ``dtype=``, ``TextOptions(activations=)``,
the VAE's dtype, ``torch.set_default_dtype`` set by the user's own script) and what klein_core
promises for them: a run in any of them returns the documented dtype, matches the float32 run within
what the dtype explains, keeps what must stay float32 in float32 (the schedule, the training
timestep draws, the VAE's BatchNorm statistics, the tiled VAE's blending), keys its caches so that
one dtype's result is found by the same dtype named another way, and when fp16 overflows says what
to change, in Python and in the encoder node.

Each ``BUG:`` test fails on the code it was written against because of the defect it names; each
``Pinned:`` test holds behaviour that already works and is not tested elsewhere. Tiny random models
on the CPU (CPU torch runs float16 and bfloat16 matmuls), float32 references.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_nodes import comfy  # noqa: F401 (fixture: the nodes in ComfyUI 0.3.75's modules)

import klein_core as kc
from klein_core.memory import tiling
from klein_core.pipeline.prompts import encoder_identity, loaded_encoder_identity
from klein_core.pipeline.sampling import get_schedule, prepare_denoise
from klein_core.testing import write_tiny_model_files
from klein_core.testing.tiny import build_tiny_components, tiny_text_encoder, tiny_vae
from klein_core.train.objective import ObjectiveConfig, sample_density, sigmas_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch.set_default_dtype(dtype)`` for the block, as a user's script may set it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _latents(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The user's default dtype


def test_tiled_vae_decode_does_not_depend_on_the_default_dtype():
    """Was a bug: a float32 VAE decoding in tiles (``vae_tile=16/32/64``, or ``auto`` on a GPU short of
    memory; ``klein_core.memory.tiling.decode_tiled``) blends its tiles in the *default* dtype:
    ``_tiled`` makes its accumulator and its weight sum with ``torch.zeros(...)`` without a dtype.
    A script that calls ``torch.set_default_dtype(torch.bfloat16)`` (or float16) gets different,
    coarser pixels from the same float32 VAE and latents: 0.0104 of the [-1, 1] range here (1.3
    8-bit levels) in bf16, 1.2e-3 in fp16, where the float32 blend the docstring promises ("Blending
    is done in float32") gives the very same pixels whatever the default dtype."""
    vae = tiny_vae()
    lat = _latents((1, 128, 12, 12))
    want = tiling.decode_tiled(vae, lat, tile=8, overlap=2)  # 2 x 2 tiles sharing 2 positions
    for dtype in (torch.bfloat16, torch.float16):
        with default_dtype(dtype):
            got = tiling.decode_tiled(vae, lat, tile=8, overlap=2)
        assert got.dtype == torch.float32
        # The same float32 ops on the same inputs: any difference beyond float32 rounding of the
        # blend (|x| <= 3.4, eps 1.2e-7) comes from blending in the default dtype.
        diff = (got - want).abs().max().item()
        assert diff <= 1e-6, f"default dtype {dtype}: tiled decode differs by {diff:.3g} from the float32 blend"


def test_schedule_is_float32_whatever_the_default_dtype():
    """Was a bug: ``get_schedule`` (and ``Engine.schedule``) documents float32 sigmas ("computed in
    float32 exactly as the diffusers Klein scheduler does"; docs/api.md: "fp32 sigmas"), but under
    ``torch.set_default_dtype(torch.float64)`` it returns float64: the final 0 is ``torch.zeros(1)``
    in the default dtype, and ``torch.cat`` promotes the float32 sigmas to it."""
    want = get_schedule(4, 4096)
    with default_dtype(torch.float64):
        got = get_schedule(4, 4096)
    assert got.dtype == torch.float32, f"get_schedule returned {got.dtype} under a float64 default dtype"
    assert torch.equal(got.float(), want)


def test_training_timesteps_do_not_depend_on_the_default_dtype():
    """Was a bug: LoRA training draws each step's timestep density with ``torch.rand`` / ``torch.normal``
    in the *default* dtype (``klein_core.train.objective.sample_density``, documented "float32"; the
    trainer's noise, ``torch.randn(shape, generator=g)`` in ``Trainer._batch``, the same way). Under
    ``torch.set_default_dtype(torch.float64)`` the same seed draws other numbers (a float64 draw
    consumes the generator differently): the first training timesteps become 0.030, 0.293, 0.541
    instead of 0.504, 0.232, 0.912, so a seeded run is not reproduced; under bfloat16 they are
    rounded to bf16 (0.231 for 0.232)."""
    for scheme in ("none", "logit_normal"):
        cfg = ObjectiveConfig(weighting_scheme=scheme)
        want = sample_density(cfg, 6, torch.Generator().manual_seed(0))
        for dtype in (torch.float64, torch.bfloat16):
            with default_dtype(dtype):
                got = sample_density(cfg, 6, torch.Generator().manual_seed(0))
            assert got.dtype == torch.float32, f"{scheme}: density drawn in {got.dtype}"
            # the float32 draw and the float32 maths after it: the same numbers (1 ulp for the sigmoid)
            torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
            assert torch.equal(sigmas_for(cfg, got)[1], sigmas_for(cfg, want)[1])


def test_generation_does_not_depend_on_the_default_dtype():
    """Pinned: components built in float32, then ``torch.set_default_dtype`` float64, float16 or
    bfloat16 set by the user's script: ``generate`` (whole decode, the CPU plan) gives the float32
    default's latents and image bit for bit, latents in the model dtype."""
    tr, te, vae = build_tiny_components()

    def run():
        r = kc.generate(tr, te, vae, prompt="a red fox", seed=7, width=64, height=64, cache=None)
        return r.latents, torch.from_numpy(np.asarray(r.images[0]).copy())

    lat, img = run()
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        with default_dtype(dtype):
            got_lat, got_img = run()
        assert got_lat.dtype == torch.float32
        assert torch.equal(got_lat, lat) and torch.equal(got_img, img), f"default dtype {dtype} changed the run"


# ---------------------------------------------------------------------------------------------
# The VAE's float32 BatchNorm statistics


def test_vae_to_a_dtype_keeps_its_batchnorm_statistics_float32():
    """Was a bug: ``Flux2VAE`` documents that "the BatchNorm statistics stay float32 whatever the model
    dtype" (``load_vae(dtype=)`` keeps them so), but ``vae.to(torch.bfloat16)`` / ``.half()`` casts
    ``bn.running_mean`` / ``running_var`` like any buffer: the latents are normalised and
    de-normalised with statistics rounded to bf16 for good. The CLI's ``--demo --dtype bf16`` and the
    Ray workers' tiny models convert exactly this way. The same bf16 VAE then decodes differently
    depending on how it was made: 0.076 of the [-1, 1] range here. (FP8Linear keeps its float32
    scales through ``.to()`` with an ``_apply`` override; the VAE's BatchNorm has none.)"""
    sd = tiny_vae().state_dict()
    loaded = kc.load_vae(sd, dtype=torch.bfloat16)
    converted = kc.load_vae(sd, dtype=torch.float32).to(torch.bfloat16)
    assert loaded.bn.running_var.dtype == torch.float32  # what load_vae does
    assert converted.bn.running_var.dtype == torch.float32, "vae.to(bf16) rounded the BatchNorm statistics"
    lat = _latents((1, 128, 4, 4))
    # Both are the float32 weights rounded to bf16 once: the same model, so the same pixels.
    assert torch.equal(converted.decode(lat), loaded.decode(lat))


# ---------------------------------------------------------------------------------------------
# Cache keys and dtype names


def test_encoder_identity_reads_dtype_names_as_the_loaders_do(tmp_path):
    """Was a bug: the loaders take a dtype or its name (``load_text_encoder(path, dtype="bf16")``, docs/python.md:
    "``dtype`` is a torch dtype or its name"), and the prompt cache of docs/python.md looks prompts up
    with ``encoder_identity(path, dtype, device)``. Given the same name, ``encoder_identity`` writes
    "bf16" into the key where the loaded encoder's identity says "bfloat16", so
    ``Engine.cached_prompts(identity=...)`` never finds what that very encoder cached (the text
    encoder must always be loaded, the point of the cache is lost), silently. It should read the
    name as the loaders do (or refuse a non-dtype)."""
    paths = write_tiny_model_files(tmp_path)
    te = kc.load_text_encoder(paths["qwen_4b"], dtype="bf16")
    cache = kc.PromptCache()
    kc.Engine(None, te, None, prompt_cache=cache).encode_prompts(["a red fox"])
    assert kc.Engine(prompt_cache=cache).cached_prompts(
        ["a red fox"], identity=encoder_identity(paths["qwen_4b"], torch.bfloat16, "cpu")) is not None
    try:
        identity = encoder_identity(paths["qwen_4b"], "bf16", "cpu")
    except (TypeError, ValueError):
        return  # refusing a dtype name clearly is a fix too
    assert identity == loaded_encoder_identity(te, "cpu")
    assert kc.Engine(prompt_cache=cache).cached_prompts(["a red fox"], identity=identity) is not None


# ---------------------------------------------------------------------------------------------
# fp16 overflow: caught, and the advice fits


def _hot_text_encoder() -> kc.Qwen3TextEncoder:
    """A tiny encoder whose residual stream reaches ~9e4 (as Qwen3's massive activations do): finite
    in bf16 and fp32 (max 3.4e38), beyond fp16's 65504."""
    te = tiny_text_encoder()
    with torch.no_grad():
        for layer in te.layers:
            layer.mlp.down_proj.weight.mul_(5e4)
    return te


def test_fp16_text_encoder_overflow_is_refused_naming_fp16():
    """Pinned: an fp16 text encoder whose hidden states pass 65504 raises FloatingPointError naming
    the fp16 overflow (not a NaN conditioning, not a weight blamed), and nothing is cached; the same
    weights in bf16 encode finite embeddings beyond the fp16 range."""
    hot = _hot_text_encoder()
    bf16 = kc.Engine(None, hot.to(torch.bfloat16), None, prompt_cache=None).encode_prompts(["x"]).positive
    assert torch.isfinite(bf16).all() and bf16.abs().max() > 65504
    cache = kc.PromptCache()
    engine = kc.Engine(None, hot.to(torch.float16), None, prompt_cache=cache)
    with pytest.raises(FloatingPointError, match="The text encoder produced NaN/Inf.*fp16 overflow") as err:
        engine.encode_prompts(["x"])
    assert not isinstance(err.value, kc.NonFiniteWeights)
    assert len(cache) == 0


def test_fp16_activation_overflow_advice_names_the_activations_not_the_model():
    """Was a bug: a bf16 text encoder run with ``TextOptions(activations=torch.float16)`` whose hidden
    states pass 65504 is refused with "likely cause: fp16 overflow: load the model in bf16 or fp32",
    although the model *is* bf16 and encodes these prompts finitely in its own dtype: the fp16 comes
    from the activations option. ``Engine.encode_prompts`` passes ``overflow_cause(emb.dtype)``, which
    knows only the output dtype. The user follows the advice, nothing changes."""
    hot = _hot_text_encoder().to(torch.bfloat16)
    assert torch.isfinite(kc.Engine(None, hot, None, prompt_cache=None).encode_prompts(["x"]).positive).all()
    engine = kc.Engine(None, hot, None, prompt_cache=None, text=kc.TextOptions(activations=torch.float16))
    with pytest.raises(FloatingPointError) as err:
        engine.encode_prompts(["x"])
    msg = str(err.value)
    assert "load the model in bf16" not in msg, f"advice the bf16 model already follows: {msg}"
    assert "activations" in msg, f"the option that overflowed is not named: {msg}"
    # Was a bug too: only the Python option was named; CLI, batch and serve users set a flag
    assert "--text-precision fp32" in msg, f"the command-line remedy is not named: {msg}"


# ---------------------------------------------------------------------------------------------
# Precision the references fix


def test_fp16_transformer_sees_the_reference_fp16_timesteps():
    """Pinned: SPEC §4.4: a pipeline in fp16 tells the transformer the 1024², 4-step timesteps
    [1000, 967.5, 908, 767] (the scheduler's float32 values round-tripped through fp16), while the
    Euler steps use the exact float32 sigmas."""
    tr = build_tiny_components()[0].to(torch.float16)
    noise = _latents((1, 128, 64, 64))
    sigmas = get_schedule(4, 64 * 64)
    job = prepare_denoise(tr, noise, torch.zeros(1, 4, tr.config.context_dim), sigmas)
    seen = (job.t_model[:4].to(torch.float16) * 1000).tolist()  # as Flux2Transformer._time_vector does
    assert seen == [1000.0, 967.5, 908.0, 767.0]
    assert job.sigmas.dtype == torch.float32 and torch.equal(job.sigmas.cpu(), sigmas)
    assert job.dts.dtype == torch.float32


def test_mixed_component_dtypes_run_and_stay_within_their_precision():
    """Pinned: a bf16 text encoder, an fp16 transformer and a float32 VAE together (and given
    float64 noise): latents come back in the transformer's dtype, pixels as float32 in [0, 1], and
    the latents are within fp16 rounding of the all-float32 run: relative L2 7.5e-4 measured, a few
    steps of fp16's 4.9e-4 unit roundoff (bf16 embeddings add 3.6e-5); a transformer computing in
    bf16 instead would be 4.5e-3, above the 2e-3 bound."""
    tr, te, vae = build_tiny_components()
    noise = _latents((1, 128, 4, 4), seed=3)
    ref = kc.generate(tr, te, vae, prompt="a red fox", noise=noise, output="latent", cache=None).latents
    tr16, te_bf16 = build_tiny_components()[0].to(torch.float16), build_tiny_components()[1].to(torch.bfloat16)
    engine = kc.Engine(tr16, te_bf16, vae, prompt_cache=None)
    cond = engine.encode_prompts(["a red fox"])
    assert cond.positive.dtype == torch.bfloat16
    latents, _ = engine.denoise(cond, [], kc.Settings(), noise=noise.double())
    assert latents.dtype == torch.float16
    pixels = engine.decode(latents)
    assert pixels.dtype == torch.float32 and 0 <= pixels.min() and pixels.max() <= 1
    rel = ((latents.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-3, f"mixed bf16/fp16 run is {rel:.3g} (relative L2) from the float32 run"


def test_encoder_node_fp16_overflow_names_a_choice_the_node_has(comfy, monkeypatch):  # noqa: F811
    """Was a bug: on a GPU without bf16 (before Ampere: T4, V100, the GPUs of many free notebooks) the
    Qwen3 Layer-Concat Encoder node loads the text encoder in fp16 by itself (``encoder_dtype``),
    with no dtype input. When the encoder's hidden states pass fp16's 65504 (here: tiny weights
    scaled until they do), the node fails with the engine's advice "fp16 overflow: load the model
    in bf16 or fp32", which no input of this node can follow, while its own ``precision`` = "fp32
    activations" encodes the same file finitely (the fp16 weights cast per layer, as ComfyUI does).
    The error should name that input (or the node should pick it on such GPUs)."""
    hot = {"model." + k: v.to(torch.bfloat16).contiguous() for k, v in _hot_text_encoder().state_dict().items()}
    name = "qwen_3_4b_hot.safetensors"
    path = comfy.models / "text_encoders" / name
    save_file(hot, str(path))
    comfy.folder_paths.filename_list_cache.clear()
    monkeypatch.setattr(comfy.host, "bf16_supported", lambda device: False)  # a GPU before Ampere
    try:
        with torch.inference_mode():
            out = comfy.pack.KleinTextEncode.execute(name, "a red fox", "", "fp32 activations").args[0]
            assert torch.isfinite(out.positive).all() and out.positive.abs().max() > 65504
            with pytest.raises(FloatingPointError) as err:
                comfy.pack.KleinTextEncode.execute(name, "a red fox", "", "model dtype")
    finally:
        comfy.cache.release_all("dtype hunt done")
        path.unlink()
        comfy.folder_paths.filename_list_cache.clear()
    msg = str(err.value)
    assert "load the model in bf16 or fp32" not in msg, f"advice the node cannot follow: {msg}"
    assert "set precision to 'fp32 activations'" in msg, f"the node's own remedy is not named: {msg}"


def test_review_the_encoder_node_in_fp16_still_says_weights_are_corrupt(comfy, monkeypatch):  # noqa: F811
    """Was a bug (in the mend above, found in review): on a GPU without bf16, a text-encoder file holding
    NaN was reported with the fp16 advice ("set precision to 'fp32 activations'"), hiding the
    engine's message naming the corrupt tensor and file. Corrupt weights are said as such."""
    weights = {"model." + k: v.to(torch.bfloat16).contiguous() for k, v in _hot_text_encoder().state_dict().items()}
    bad = next(k for k in weights if k.endswith("layers.0.self_attn.q_proj.weight"))
    weights[bad][0, 0] = float("nan")
    name = "qwen_3_4b_nan.safetensors"
    path = comfy.models / "text_encoders" / name
    save_file(weights, str(path))
    comfy.folder_paths.filename_list_cache.clear()
    monkeypatch.setattr(comfy.host, "bf16_supported", lambda device: False)  # a GPU before Ampere
    try:
        with torch.inference_mode(), pytest.raises(FloatingPointError) as err:
            comfy.pack.KleinTextEncode.execute(name, "a red fox", "", "model dtype")
    finally:
        comfy.cache.release_all("dtype hunt done")
        path.unlink()
        comfy.folder_paths.filename_list_cache.clear()
    msg = str(err.value)
    assert isinstance(err.value, kc.NonFiniteWeights) and "fp32 activations" not in msg, msg
    assert "layers.0.self_attn.q_proj.weight" in msg, msg
