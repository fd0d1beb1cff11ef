"""The public Python API (``import klein_core as kc``) as a newcomer calls it: plausible but wrong
arguments (devices, numpy scalars, components in the wrong order, stage inputs of the wrong kind,
prompt caches, tensors that require grad, reference tensors outside [-1, 1]), and what one engine
reused across calls and the caller's own objects look like afterwards.

Tests whose docstring starts with "Was a bug:" exposed a defect (they failed before the fix); "Pinned:"
tests hold correct behaviour not tested elsewhere. Tiny random models, CPU only, one torch thread.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from PIL import Image

import klein_core as kc
from klein_core.pipeline.inputs import InitLatents
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.testing import build_tiny_components, tiny_text_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"width": 64, "height": 64, "steps": 1, "output": "latent", "cache": None}


@pytest.fixture(scope="module")
def tiny():
    """(transformer, text encoder, VAE): tiny, random, float32 on the CPU. Never changed by a test."""
    return build_tiny_components(seed=0)


@pytest.fixture(scope="module")
def picture():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8))


def _error_of(call):
    """The exception ``call()`` raises, or None if it returns."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test judges which kind it is
        return exc
    return None


def _assert_clear(exc: BaseException | None, *words: str) -> None:
    """``exc`` is a TypeError / ValueError whose message holds one of ``words`` (case-insensitive)."""
    assert exc is not None, "the call was accepted"
    assert isinstance(exc, (TypeError, ValueError)), (
        f"a {type(exc).__name__} from deep inside instead of a clear error: {exc}")
    text = str(exc).lower()
    assert any(w.lower() in text for w in words), f"the message names none of {words}: {exc}"


# ---------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize("device", ["cuda", "gpu"])
@pytest.mark.parametrize("component", [0, 1, 2], ids=["load_transformer", "load_text_encoder", "load_vae"])
def test_loaders_check_the_device_as_the_engine_does(tiny, component, device):
    """Was a bug: ``kc.load_vae(source, device="cuda")`` (the README's Python example, run on the CPU-only
    torch its Quick start installs) raises torch's ``AssertionError: Torch not compiled with CUDA
    enabled``, and a mistyped ``device="gpu"`` a torch ``RuntimeError`` ("Expected one of cpu, cuda,
    ipu, xpu, ..."), from ``files/materialize.py`` (``torch.device(device)`` and the first copy). The
    same strings given to ``kc.Engine(device=...)`` get one ValueError that names the device and the
    fix (``pipeline.request.as_device``: "needs CUDA ... Install a CUDA build of torch ... or use
    device 'cpu'"). README: "Bad input gets one clear error naming the file or input and what to
    do". Expected: the loaders check ``device`` with ``as_device`` too, before reading anything."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here: 'cuda' is a valid device")
    _assert_clear(_error_of(lambda: kc.Engine(device=device)), device)  # what the engine says
    loader = (kc.load_transformer, kc.load_text_encoder, kc.load_vae)[component]
    state = tiny[component].state_dict()  # a state dict: the same path as a file, without writing one
    _assert_clear(_error_of(lambda: loader(state, device=device)), f"'{device}'", f"device {device}")


# ---------------------------------------------------------------------------------------------
# generate / Engine: what they are given


def test_negative_embeds_without_prompt_embeds_are_not_dropped_silently(tiny):
    """Was a bug: ``kc.generate(tr, te, vae, prompt="a fox", negative_embeds=E, kind="base", guidance=4)``
    runs CFG with the *encoded empty negative prompt* and ignores ``E`` without a word: the latents
    are bit-identical to a run without ``negative_embeds``. ``generate`` builds a ``Conditioning``
    only ``if prompt_embeds is not None`` (pipeline/engine.py, ``generate``), so ``negative_embeds``
    alone is dropped. The docstring documents "prompt_embeds / negative_embeds: [P, L, text_dim]
    embeddings instead of prompts" and api.md pairs ``negative`` embeddings with CFG. Expected: the
    given negative embedding is used (with the encoded prompt), or refused naming
    ``negative_embeds`` ("needs prompt_embeds"); never silently replaced."""
    base = {**SMALL, "prompt": "a fox", "kind": "base", "guidance": 4.0, "steps": 2}
    plain = kc.generate(*tiny, **base).latents
    negative = torch.randn(1, 512, 96, generator=torch.Generator().manual_seed(0)) * 3
    exc = _error_of(lambda: kc.generate(*tiny, negative_embeds=negative, **base))
    # The fix chose refusal: exactly that, naming the argument and what it needs.
    _assert_clear(exc, "negative_embeds")
    assert "prompt_embeds" in str(exc)
    with_both = kc.generate(*tiny, prompt_embeds=kc.Engine(*tiny, prompt_cache=None).encode_prompts(["a fox"]).positive,
                            negative_embeds=negative, **{k: v for k, v in base.items() if k != "prompt"}).latents
    assert not torch.equal(with_both, plain), "negative_embeds were ignored: the same latents as without them"


COMPONENT_MISTAKES = {
    # the text encoder first (its name comes first in the file table of the README)
    "text encoder, transformer, vae": lambda tr, te, vae: kc.generate(te, tr, vae, prompt="a", **SMALL),
    # the VAE second, as in "model, vae, clip" of other APIs
    "transformer, vae, text encoder": lambda tr, te, vae: kc.generate(tr, vae, te, prompt="a", **SMALL),
    # file names instead of loaded models (README: kc.load_transformer("flux-2-klein-4b.safetensors"...))
    "file names": lambda tr, te, vae: kc.Engine("flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors",
                                                "flux2-vae.safetensors"),
}


@pytest.mark.parametrize("case", list(COMPONENT_MISTAKES))
def test_components_of_the_wrong_kind_are_refused_by_name(tiny, case):
    """Was a bug: ``kc.generate(text_encoder, transformer, vae, ...)`` raises ``AttributeError: 'Qwen3Config'
    object has no attribute 'context_dim'``; ``kc.generate(transformer, vae, text_encoder)``
    ``AttributeError: 'VAEConfig' object has no attribute 'text_dim'``; ``kc.Engine("flux-2-klein-4b
    .safetensors", ...)`` (paths instead of loaded models) ``AttributeError: 'str' object has no
    attribute 'config'``, all from ``pipeline/inputs.py:27-32`` (``check_compatible`` reads
    ``.config.context_dim`` / ``.text_dim`` / ``.latent_channels`` of whatever it got). Expected: a
    TypeError naming the argument and what it takes (``transformer must be a Flux2Transformer
    (kc.load_transformer), got Qwen3TextEncoder``), as README's "Bad input gets one clear error naming
    the ... input and what to do" promises; ``Engine.__init__`` checks ``kind``, ``memory``, ``text``
    this way already."""
    exc = _error_of(lambda: COMPONENT_MISTAKES[case](*tiny))
    _assert_clear(exc, "transformer", "text_encoder", "text encoder", "vae")


STAGE_MISTAKES = {
    # the embeddings tensor instead of the Conditioning encode_prompts returned
    "denoise(cond.positive)": lambda e, cond, pic: e.denoise(cond.positive, [], kc.Settings(64, 64, 1)),
    # pictures instead of encoded references (stage 2 skipped)
    "denoise(references=[PIL])": lambda e, cond, pic: e.denoise(cond, [pic], kc.Settings(64, 64, 1)),
    # settings as a dict, or in a request
    "denoise(settings=dict)": lambda e, cond, pic: e.denoise(cond, [], {"width": 64, "height": 64, "steps": 1}),
    "GenerationRequest(settings=dict)": lambda e, cond, pic: e.generate(
        kc.GenerationRequest("a fox", settings={"width": 64, "height": 64, "steps": 1})),
    # a picture to encode_pixels, numpy latents to decode
    "encode_pixels(PIL)": lambda e, cond, pic: e.encode_pixels(pic),
    "decode(numpy)": lambda e, cond, pic: e.decode(np.zeros((1, 128, 4, 4), np.float32)),
}


@pytest.mark.parametrize("case", list(STAGE_MISTAKES))
def test_stage_inputs_of_the_wrong_kind_are_refused_by_name(tiny, picture, case):
    """Was a bug: the stage methods of ``Engine`` given an input of the wrong kind fail with an
    AttributeError from inside instead of naming the input: ``engine.denoise(cond.positive, ...)``
    -> "'builtin_function_or_method' object has no attribute 'shape'" (``Tensor.positive`` is
    torch.positive; pipeline/inputs.py:91); ``denoise(cond, [PIL image])`` -> "'Image' object has no
    attribute 'shape'" (pipeline/vae_io.py:81); ``denoise(cond, [], {...})`` and
    ``GenerationRequest(settings={...})`` (accepted by the request, which checks ``conditioning`` and
    ``init`` by type but not ``settings``) -> "'dict' object has no attribute 'steps'"
    (pipeline/request.py:237); ``encode_pixels(PIL image)`` -> "'Image' object has no attribute
    'ndim'" (engine.py:331); ``decode(numpy array)`` -> "'numpy.ndarray' object has no attribute
    'is_floating_point'" (checks.py:44). Expected: a TypeError naming the argument and what it takes
    (e.g. "references must be encoded latents [1, 128, h, w]: encode pictures with
    Engine.encode_references"), as ``Engine.generate`` already does for a request that is not a
    ``GenerationRequest``."""
    engine = kc.Engine(*tiny, prompt_cache=None)
    cond = engine.encode_prompts(["a fox"])
    exc = _error_of(lambda: STAGE_MISTAKES[case](engine, cond, picture))
    _assert_clear(exc, "conditioning", "reference", "settings", "pixels", "latents")


NUMPY_SCALARS = {  # argument -> (numpy value, the same Python value, extra arguments)
    "seed": (np.int64(7), 7, {}),  # np.random.default_rng().integers(...) gives these
    "steps": (np.int64(2), 2, {}),
    "width": (np.int64(80), 80, {}),
    "batch_size": (np.int64(2), 2, {}),
    "guidance": (np.float32(3.0), 3.0, {"kind": "base"}),
}


@pytest.mark.parametrize("name", list(NUMPY_SCALARS))
def test_numpy_scalars_work_or_are_refused_saying_so(tiny, name):
    """Was a bug: numpy scalars for whole-number and number settings (what a sweep over ``np.arange`` or
    ``rng.integers`` gives) are refused with messages that deny what the value is:
    ``steps=np.int64(2)`` -> "steps must be an integer from 1 to 10000, got np.int64(2)";
    ``width=np.int64(80)`` -> "width must be an integer number of pixels"; ``batch_size`` -> "must be a
    positive integer"; ``guidance=np.float32(3.0)`` -> "guidance must be a number"; ``seed=np.int64(7)``
    -> "seed must be an int, got int64" (pipeline/request.py ``resolve`` / ``check_size`` test
    ``isinstance(v, int)`` and ``(int, float)``). np.float64 guidance is accepted (a float subclass),
    np.float32 is not. Expected: integral numpy values taken as the ints they are (``operator.index``)
    and real ones as floats, giving the same result as the Python number; or, at the least, a
    message that says numpy scalars are not taken and to convert (``int(x)``)."""
    value, same, extra = NUMPY_SCALARS[name]
    args = {**SMALL, "prompt": "a fox", **extra}
    exc = _error_of(lambda: kc.generate(*tiny, **{**args, name: value}))
    assert exc is None, f"the numpy value was refused: {exc}"  # the fix takes them
    want = kc.generate(*tiny, **{**args, name: same}).latents
    assert torch.equal(kc.generate(*tiny, **{**args, name: value}).latents, want)


# ---------------------------------------------------------------------------------------------
# Prompt caches


def test_a_numpy_strength_is_taken_as_the_float_it_is(tiny):
    """Was left last review: ``generate(image=..., strength=np.float32(0.5))`` was refused ("must be a
    number") while every other setting takes numpy numbers; now it runs as ``strength=0.5``."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    kw = {**SMALL, "prompt": "a fox", "steps": 4, "image": image}
    want = kc.generate(*tiny, strength=0.5, **kw).latents
    assert torch.equal(kc.generate(*tiny, strength=np.float32(0.5), **kw).latents, want)


def test_a_disk_prompt_cache_given_as_cache_works_or_is_refused_by_name(tiny, tmp_path):
    """Was a bug: ``kc.generate(tr, te, vae, prompt="a fox", cache=kc.DiskPromptCache(folder))`` (the docs
    show ``DiskPromptCache`` beside ``cache=``) fails with ``AttributeError: 'DiskPromptCache' object
    has no attribute 'cached'`` from pipeline/engine.py:290, after the request was planned. Expected:
    a ``DiskPromptCache`` is wrapped (``PromptCache(disk=...)``), or refused at once with a TypeError
    naming ``cache`` and the fix ("use kc.PromptCache(disk=kc.DiskPromptCache(...))")."""
    exc = _error_of(lambda: kc.generate(*tiny, prompt="a fox", **{**SMALL, "cache": kc.DiskPromptCache(tmp_path)}))
    assert exc is None, f"{type(exc).__name__}: {exc}"  # taken: kept behind an in-memory cache
    _assert_clear(_error_of(lambda: kc.Engine(*tiny, prompt_cache={})), "prompt_cache")  # anything else: named


def test_a_folder_name_as_the_disk_cache_is_refused_or_used(tiny, tmp_path):
    """Was a bug: ``kc.PromptCache(disk="~/.cache/klein-prompts")`` (a folder name where a
    ``DiskPromptCache`` is meant) is accepted, and the first prompt of an encoder loaded from a file
    fails with ``AttributeError: 'str' object has no attribute 'get'`` (pipeline/prompts.py:451,
    ``self.disk.get``). Expected: ``PromptCache.__init__`` checks ``disk`` (TypeError naming ``disk``
    and ``DiskPromptCache``), or takes a folder name as ``DiskPromptCache(folder)``. An encoder loaded
    from a file is stood for by the tiny one with a ``source`` on disk (the identity the cache keys by)."""
    folder = tmp_path / "prompts"
    _assert_clear(_error_of(lambda: kc.PromptCache(disk=42)), "disk")  # not a folder: named
    weights = tmp_path / "qwen_3_4b.safetensors"
    weights.write_bytes(b"stands for the encoder's file: only its name, size and time are read")
    te = copy.copy(tiny[1])  # the same weights; only the attribute below is its own
    te.source = str(weights)
    engine = kc.Engine(text_encoder=te, prompt_cache=kc.PromptCache(disk=str(folder)))
    exc = _error_of(lambda: engine.encode_prompts(["a fox"]))
    assert exc is None, f"{type(exc).__name__}: {exc}"
    assert any(folder.iterdir()), "the folder given as the disk cache holds no entry"


def test_the_prompt_cache_does_not_serve_embeddings_of_weights_changed_in_place(tiny):
    """Was a bug: an encoder whose weights are replaced in place (``te.load_state_dict(other)``: a fine-tuned
    checkpoint swapped in, weights edited between runs) keeps getting the embeddings its *old*
    weights made: the prompt cache keys an in-memory encoder by ``(id(encoder), dtype, device)``
    (pipeline/prompts.py ``_in_memory``) and one loaded from a file by the file's stat, never by the
    weights. ``generate`` uses the shared cache by default, so the images silently stay those of the
    old text encoder. The transformer's reference key/value cache follows exactly this
    (``reference_kv.weights_state``: "a reload or in-place change misses"), and PromptCache's own
    docstring promises "a freed or reloaded encoder never serves stale embeddings". Expected: the
    embeddings of the weights as they are now (key entries on ``weights_state(encoder)``)."""
    te = copy.deepcopy(tiny[1])
    engine = kc.Engine(text_encoder=te, prompt_cache=kc.PromptCache())
    before = engine.encode_prompts(["a fox"]).positive
    te.load_state_dict(tiny_text_encoder(seed=5).state_dict())
    now = kc.Engine(text_encoder=te, prompt_cache=None).encode_prompts(["a fox"]).positive
    assert not torch.equal(now, before)  # the new weights do give other embeddings
    assert torch.equal(engine.encode_prompts(["a fox"]).positive, now), "the old weights' embeddings were served"


def test_an_in_memory_encoder_placed_anew_each_run_still_hits_the_prompt_cache(tiny, monkeypatch):
    """With the fix above (entries keyed by the weights' token): a stage that places the encoder on
    the device gives it new tensors every run (memory "swap", or "auto" on a small card), so a token
    taken inside the stage never matched the last run's and the cache never hit. The engine takes it
    before the stage, as the reference KV cache does. A stage that clones every weight stands in for
    the copy to the GPU."""
    te = copy.deepcopy(tiny[1])
    engine = kc.Engine(text_encoder=te, prompt_cache=kc.PromptCache())
    real_stage = kc.Engine._stage

    @contextlib.contextmanager
    def copying_stage(self, component, plan):
        with real_stage(self, component, plan) as placed:
            homes = [(p, p.data) for p in placed.parameters()]
            for p, data in homes:
                p.data = data.clone()  # new tensors, as the copies a placement makes
            try:
                yield placed
            finally:
                for p, data in homes:
                    p.data = data

    monkeypatch.setattr(kc.Engine, "_stage", copying_stage)
    first = engine.encode_prompts(["a fox"]).positive
    misses = engine.prompt_cache.misses
    assert torch.equal(engine.encode_prompts(["a fox"]).positive, first)
    assert engine.prompt_cache.misses == misses, "the second run missed the cache"


def test_prompts_without_a_text_encoder_are_refused_naming_it(tiny):
    """Review of the fix above: an engine without a text encoder, asked for prompts no cache holds,
    says the stage needs a text encoder (the weights' token was first asked of None: an
    AttributeError)."""
    with pytest.raises(ValueError, match="needs a text encoder"):
        kc.Engine(tiny[0], None, tiny[2]).encode_prompts(["a fox never encoded"])


# ---------------------------------------------------------------------------------------------
# Tensors the caller gives


@pytest.mark.parametrize("given", ["prompt_embeds", "noise"])
def test_generation_builds_no_autograd_graph_from_inputs_that_require_grad(tiny, given):
    """Was a bug: ``kc.generate(..., prompt_embeds=E)`` with ``E.requires_grad`` (embeddings from the
    caller's own module, or noise made as a leaf with ``requires_grad=True``) runs the whole sampler
    with autograd recording: ``result.latents.requires_grad`` is True and the result keeps every
    step's activations alive (52 MB saved for backward at 256x256, 4 steps, on the *tiny* model; GBs
    on the real one, none of it in the memory plan). The VAE stages run under ``torch.no_grad``
    (memory/tiling.py, models/vae.py) but ``Engine.denoise`` / ``sampling.denoise`` do not.
    Expected: inference without a graph (``torch.no_grad`` around the denoise stage, as diffusers'
    pipelines decorate ``__call__``)."""
    kw = {**SMALL, "steps": 2}
    if given == "prompt_embeds":
        kw["prompt_embeds"] = torch.randn(1, 512, 96, requires_grad=True)
    else:
        kw.update(prompt="a fox", noise=torch.randn(1, 128, 4, 4, requires_grad=True))
    result = kc.generate(*tiny, **kw)
    assert not result.latents.requires_grad, f"the latents carry an autograd graph ({result.latents.grad_fn})"


def test_a_reference_tensor_in_0_to_255_is_not_encoded_silently(tiny):
    """Was a bug: a reference tensor ``[1, 3, H, W]`` holding 8-bit values as floats (0..255: the usual
    ``torch.from_numpy(np.asarray(img)).permute(2, 0, 1)[None].float()``) is VAE-encoded as if it were
    in [-1, 1] and the edit runs on garbage, without a word. api.md / ``GenerationRequest`` document
    reference tensors "in [-1, 1]" and ``vae_io.encode_references`` checks their shape, size and
    finiteness but not their range; masks outside 0..1 are refused "naming the range" (README).
    Expected: a ValueError naming ``reference 1`` and the range found (values far outside [-1, 1])."""
    pixels = torch.full((1, 3, 64, 64), 200.0)
    exc = _error_of(lambda: kc.generate(*tiny, prompt="a fox", references=[pixels], **SMALL))
    assert exc is not None, "a reference with values up to 200 was encoded as if in [-1, 1]"
    _assert_clear(exc, "reference 1")


def test_review_comfyui_images_over_1_are_encoded_and_resolved_settings_are_a_request(tiny):
    """Review of the fixes above: pixels a little past [-1, 1] (ComfyUI images over 1 from HDR loaders,
    2.5 after ``* 2 - 1``) are encoded, as ComfyUI's own VAE Encode takes them; 0..255 is still refused.
    ``GenerationRequest`` takes ``Resolved`` settings as before."""
    engine = kc.Engine(*tiny, prompt_cache=None)
    assert engine.encode_pixels(torch.full((1, 3, 64, 64), 2.5)).shape == (1, 128, 4, 4)
    _assert_clear(_error_of(lambda: engine.encode_pixels(torch.full((1, 3, 64, 64), 200.0))), "pixels")
    run = engine.check_inputs(engine.encode_prompts(["a fox"]), [], kc.Settings(64, 64, 1))
    assert kc.GenerationRequest("a fox", settings=run).settings is run


def test_a_uint8_reference_tensor_is_refused_naming_which_reference(tiny, picture):
    """Was a bug: ``references=[picture, uint8_tensor]`` is refused with "VAE encode expects float pixels in
    [-1, 1], got dtype torch.uint8." (models/vae.py:386), which does not say which reference;
    the same argument's shape, size and NaN errors all start "reference 2: ..."
    (pipeline/vae_io.py ``encode_references``). README: errors name the input. Expected: "reference 2:
    ..." (check the dtype in ``encode_references`` with the shape)."""
    pixels = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    exc = _error_of(lambda: kc.generate(*tiny, prompt="a fox", references=[picture, pixels], **SMALL))
    _assert_clear(exc, "reference 2")


# ---------------------------------------------------------------------------------------------
# Pinned


def test_one_engine_reused_across_requests_equals_fresh_engines(tiny, picture):
    """Pinned: one ``Engine`` (with its prompt cache and reference key/value cache) run through
    requests of other sizes, prompt counts, batch sizes, references and reference modes gives, for
    each, the latents and pixels of a fresh engine without caches: no state carries over."""
    small = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    requests = [
        kc.GenerationRequest("a fox", settings=kc.Settings(64, 64, 2, seed=1)),
        kc.GenerationRequest(("a cat", "a dog on a long walk"), settings=kc.Settings(96, 64, 1, seed=2, batch_size=2)),
        kc.GenerationRequest("edit it", references=(small, picture), settings=kc.Settings(steps=1, seed=3),
                             ref_mode="timestep_zero"),
        kc.GenerationRequest("edit it", references=(picture,), settings=kc.Settings(steps=1, seed=3), ref_mode="kv"),
        kc.GenerationRequest("a fox", settings=kc.Settings(64, 64, 1, seed=1)),
    ]
    engine = kc.Engine(*tiny, prompt_cache=kc.PromptCache(), kv_cache=ReferenceKVCache())
    for i, request in enumerate(requests):
        shared = engine.generate(request)
        fresh = kc.Engine(*tiny, prompt_cache=None, kv_cache=None).generate(request)
        assert torch.equal(shared.latents, fresh.latents), f"request {i}"
        assert torch.equal(shared.pixels, fresh.pixels), f"request {i}"


def test_generation_changes_nothing_the_caller_passed(tiny):
    """Pinned: ``generate`` and the stage methods leave every tensor, list and picture they are given
    as it was (values, lengths, the picture's mode, pixels and info), and return no tensor that is
    the caller's own."""
    rng = np.random.default_rng(2)
    palette = Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)).convert("P")
    palette.info["note"] = "kept"
    start = Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8))
    tensors = {
        "ref_pixels": torch.rand(1, 3, 64, 64) * 2 - 1, "noise": torch.randn(1, 128, 4, 4),
        "embeds": torch.randn(1, 512, 96), "negative": torch.randn(1, 512, 96), "ref_latent": torch.randn(1, 128, 4, 4),
        "mask": torch.zeros(64, 80),
    }
    tensors["mask"][8:40, 8:48] = 1
    before = {k: v.clone() for k, v in tensors.items()}
    references, reference_latents = [palette, tensors["ref_pixels"]], [tensors["ref_latent"]]
    picture_state = (palette.mode, palette.tobytes(), dict(palette.info), start.tobytes())

    result = kc.generate(*tiny, prompt_embeds=tensors["embeds"], negative_embeds=tensors["negative"], kind="base",
                         guidance=3.0, noise=tensors["noise"], references=references,
                         reference_latents=reference_latents, steps=2, cache=None)
    assert result.latents.data_ptr() != tensors["noise"].data_ptr()
    kc.generate(*tiny, prompt=["a", "b"], image=start, mask=tensors["mask"], steps=2, cache=None)
    engine = kc.Engine(*tiny, prompt_cache=None)
    cond = engine.encode_prompts(["a fox"])
    init = InitLatents(tensors["ref_latent"], 0.5, torch.ones(1, 1, 4, 4))
    engine.denoise(cond, [tensors["ref_latent"]], kc.Settings(steps=2), init=init)
    engine.encode_pixels(tensors["ref_pixels"])
    engine.decode(tensors["noise"])

    for k, v in tensors.items():
        assert torch.equal(v, before[k]), k
    assert references == [palette, tensors["ref_pixels"]] and reference_latents == [tensors["ref_latent"]]
    assert (palette.mode, palette.tobytes(), dict(palette.info), start.tobytes()) == picture_state
