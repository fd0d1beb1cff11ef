# ruff: noqa: F811  (tiny, imported from test_python_api_hunt, is a fixture)
"""The quality of errors across the public Python API: a bad argument gets one clear TypeError /
ValueError naming the argument and the fix, before any expensive work, and is never taken silently
with a wrong meaning.

Tests whose docstring starts with "BUG:" fail on the code they were written against; "Edge case:"
tests pin behaviour found correct that no other test holds. Tiny random models, CPU, one torch thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_python_api_hunt import _assert_clear, _error_of, tiny  # noqa: F401 (tiny: a fixture)

import klein_core as kc
from klein_core.testing import build_tiny_components, write_tiny_model_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"width": 64, "height": 64, "steps": 2, "output": "latent", "cache": None}


@pytest.fixture(scope="module")
def picture():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def lora():
    """A rank-4 LoRA on one linear of the tiny 4B transformer (in memory)."""
    g = torch.Generator().manual_seed(5)
    return kc.load_lora({"transformer.single_blocks.0.linear1.lora_A.weight": torch.randn(4, 64, generator=g),
                         "transformer.single_blocks.0.linear1.lora_B.weight": torch.randn(576, 4, generator=g)})


# ---------------------------------------------------------------------------------------------
# Callables and caches given to generate() / Engine


def test_a_callback_that_is_not_callable_is_refused_before_any_work(tiny):
    """Was a bug: ``kc.generate(..., callback=5)`` (or Engine.generate / Engine.denoise with one) is taken;
    the prompts are encoded and the first denoising step runs, then the sampler calls it and a bare
    ``TypeError: 'int' object is not callable`` escapes from sampling._euler_loop, naming no argument
    (on a real model: after the text encoder and a full transformer step, tens of seconds in).
    Fix: refuse it up front, naming ``callback`` (klein_core/pipeline/engine.py, Engine.denoise and
    Engine.generate: ``if callback is not None and not callable(callback): raise TypeError(...)``)."""
    tr, te, vae = tiny
    calls = []
    hook = tr.register_forward_hook(lambda *_: calls.append(1))
    try:
        exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", callback=5, **SMALL))
    finally:
        hook.remove()
    _assert_clear(exc, "callback")
    assert not calls, f"the transformer ran {len(calls)} step(s) before the callback was refused"


@pytest.mark.parametrize("argument, value", [("kv_cache", "cache"), ("check_cancel", 3), ("make_room", 3)])
def test_engine_refuses_a_hook_or_cache_of_the_wrong_kind_up_front(tiny, argument, value):
    """Was a bug: ``kc.Engine(kv_cache="cache")``, ``check_cancel=3`` and ``make_room=3`` are stored without a
    look. They fail only when used, deep inside, naming nothing: kv_cache with
    ``AttributeError: 'str' object has no attribute 'get'`` in Engine.denoise (after the prompts and
    references were encoded, a KV-mode run with references), check_cancel with ``TypeError: 'int'
    object is not callable`` at the first VAE image, make_room the same in the CUDA planner (never on
    the CPU: accepted silently there). Fix: klein_core/pipeline/engine.py, Engine.__init__: refuse a
    kv_cache that is not a ReferenceKVCache (or None), and a check_cancel / make_room that is not
    callable, with a TypeError naming the argument (as prompt_cache and text already are)."""
    tr, te, vae = tiny
    _assert_clear(_error_of(lambda: kc.Engine(tr, te, vae, prompt_cache=None, **{argument: value})), argument)


def test_a_wrong_kv_cache_fails_with_a_clear_error_and_not_an_attribute_error(tiny, picture):
    """Was a bug: generate(kind="kv", kv_cache="cache", references=[picture]) runs the text encoder and
    the VAE, then crashes in Engine.denoise with ``AttributeError: 'str' object has no attribute
    'get'``, not an error naming kv_cache. Fix: klein_core/pipeline/engine.py, Engine.__init__: check
    ``kv_cache`` is a ReferenceKVCache or None (TypeError naming kv_cache)."""
    tr, te, vae = tiny
    exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", kind="kv", kv_cache="cache",
                                        references=[picture], **{**SMALL, "steps": 1}))
    _assert_clear(exc, "kv_cache")


# ---------------------------------------------------------------------------------------------
# Stage inputs


@pytest.mark.parametrize("shape", [(1, 3, 0, 64), (1, 3, 64, 0)])
def test_a_reference_tensor_with_a_side_of_zero_is_refused_by_its_number(tiny, shape):
    """Was a bug: a ``[1, 3, 0, 64]`` reference tensor passes the "multiples of 16" check (0 is one) and
    reaches the VAE's first convolution: ``RuntimeError: Calculated padded input size per channel:
    (2 x 66). Kernel size: (3 x 3). Kernel size can't be greater than actual input size`` from inside
    torch, naming no reference (Engine.encode_references and generate(references=[...]) alike;
    Engine.encode_pixels refuses the same shape clearly). Fix: klein_core/pipeline/vae_io.py, where
    a tensor reference's shape is checked (encode_references): refuse sides under 16 (or 64, as a PIL
    reference is) with "reference N: ..."."""
    tr, te, vae = tiny
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    _assert_clear(_error_of(lambda: engine.encode_references([torch.zeros(shape)])), "reference 1")


@pytest.mark.parametrize("negative", [5, ["no"]])
def test_a_negative_prompt_of_the_wrong_type_is_named_as_the_negative_prompt(tiny, negative):
    """Was a bug: ``engine.encode_prompts(["a"], negative_prompt=5)`` says ``prompts[1] must be a str, got
    int``: it blames a second prompt the caller never gave (the negative is appended to the prompt
    list in Engine._text_groups before the tokenizer checks the list). A list given as the negative
    prompt reads the same. Fix: klein_core/pipeline/engine.py, Engine._text_groups: refuse a
    ``negative_prompt`` that is not None or a str with "negative_prompt must be a str, got ..."."""
    tr, te, vae = tiny
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    exc = _error_of(lambda: engine.encode_prompts(["a"], negative))
    _assert_clear(exc, "negative")


# ---------------------------------------------------------------------------------------------
# Image-to-image options of generate()


@pytest.mark.parametrize("option, value", [("image_as_reference", "no"), ("composite", "false")])
def test_image_flags_refuse_strings_instead_of_reading_them_as_true(tiny, picture, option, value):
    """Was a bug: ``generate(image=..., image_as_reference="no")`` and ``composite="false"`` run as if True
    (any non-empty string is truthy): the image joins the references / the composite is applied,
    the opposite of what was asked, without a word. Fix: klein_core/pipeline/inpaint.py,
    InitImage.__post_init__: ``as_reference`` and ``composite`` must be bools (TypeError naming the
    option, as feather and strength are already checked)."""
    tr, te, vae = tiny
    mask = Image.new("L", picture.size, 255)
    exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", image=picture, mask=mask,
                                        **{option: value}, **{**SMALL, "steps": 1}))
    _assert_clear(exc, option, "as_reference" if option == "image_as_reference" else option)


def test_a_bad_mask_crop_padding_is_named_as_generate_calls_it(tiny, picture):
    """Was a bug: ``kc.generate(..., mask_crop_padding=-3)`` is refused with "crop_padding must be a whole
    number of pixels >= 0": generate() has no argument of that name (it is InitImage's field), so the
    message points at an argument the caller cannot find. Fix: klein_core/pipeline/engine.py,
    generate(): check mask_crop_padding itself (or re-raise the InitImage/prepare_inpaint error with
    the name ``mask_crop_padding``)."""
    tr, te, vae = tiny
    mask = Image.new("L", picture.size, 255)
    exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", image=picture, mask=mask,
                                        mask_crop_padding=-3, **{**SMALL, "steps": 1}))
    _assert_clear(exc, "mask_crop_padding")


# ---------------------------------------------------------------------------------------------
# LoRA


@pytest.mark.parametrize("case", ["a path", "a list of paths"])
def test_a_lora_path_instead_of_a_loaded_lora_says_load_lora(tiny, case):
    """Was a bug: ``kc.apply_loras(transformer, "my_lora.safetensors")`` (a path where a LoRA is expected,
    the natural first try) fails with ``ValueError: not enough values to unpack (expected 2, got
    1)`` (each character of the path is unpacked as a (LoRA, strength) pair); a list of paths with
    ``too many values to unpack``. Neither names the argument nor the fix. Fix:
    klein_core/lora/apply.py, _normalise: refuse a str / PathLike (alone or as an item) with
    "load it first: kc.load_lora(path)", and any item that is not a LoRA or a 2-item (LoRA, strength)."""
    tr, _, _ = tiny
    loras = "/models/loras/my_lora.safetensors"
    exc = _error_of(lambda: kc.apply_loras(tr, loras if case == "a path" else [loras]))
    _assert_clear(exc, "load_lora")
    assert loras in str(exc)  # the whole path, not its first character


@pytest.mark.parametrize("strength", [None, "strong"])
def test_a_lora_strength_that_is_not_a_number_is_named(tiny, lora, strength):
    """Was a bug: ``apply_loras(tr, [(lora, None)])`` raises ``TypeError: float() argument must be a string
    or a real number, not 'NoneType'`` and ``(lora, "strong")`` ``ValueError: could not convert string
    to float: 'strong'``: the messages name neither the LoRA nor "strength". Fix:
    klein_core/lora/apply.py, _normalise: wrap ``float(strength)`` and raise "<lora name>: strength
    must be a finite number, got ..." (the message already used for inf/NaN)."""
    tr, _, _ = tiny
    _assert_clear(_error_of(lambda: kc.apply_loras(tr, [(lora, strength)])), "strength")


# ---------------------------------------------------------------------------------------------
# Loaders


@pytest.mark.parametrize("loader, words", [
    (kc.load_transformer, ("transformer", "source")),
    (kc.load_text_encoder, ("text encoder", "text_encoder", "source")),
    (kc.load_vae, ("vae", "source")),
    (kc.load_lora, ("lora", "source")),
])
def test_loaders_given_none_say_what_they_expected(loader, words):
    """Was a bug: ``kc.load_transformer(None)`` (an unset path variable, ``os.environ.get(...)``) raises
    Python's bare ``TypeError: expected str, bytes or os.PathLike object, not NoneType`` from
    ``Path(source)`` in files/opening.open_weights (load_lora: lora/read._read_source): it names
    neither the loader, the argument nor what to give. Fix: open_weights / _read_source: refuse a
    source that is not a path, a state dict or a WeightSource with "<component> source must be a
    file or folder path (str or Path) or a state dict, got NoneType"."""
    _assert_clear(_error_of(lambda: loader(None)), *words)


# ---------------------------------------------------------------------------------------------
# Edge cases: correct behaviour not pinned elsewhere


def test_misspelled_keywords_are_refused_not_swallowed(tiny):
    """Edge case: no public entry point takes ``**kwargs``, so a misspelled option (``seeds=``,
    ``negative=``, ``vae_tiles=``, ``quantise=``) raises a TypeError naming it instead of being dropped."""
    tr, te, vae = tiny
    calls = [
        lambda: kc.generate(tr, te, vae, prompt="a", seeds=3, **SMALL),
        lambda: kc.Engine(tr, te, vae, vae_tiles=32),
        lambda: kc.Settings(step=4),
        lambda: kc.GenerationRequest(prompts="a"),
        lambda: kc.TextOptions(maxtokens=5),
        lambda: kc.load_vae({}, quantize="fp8"),
        lambda: kc.apply_loras(tr, [], strength=0.5),
    ]
    for i, call in enumerate(calls):
        exc = _error_of(call)
        assert isinstance(exc, TypeError) and "unexpected keyword" in str(exc), (i, exc)


def test_loader_file_of_another_component_is_named_and_bad_options_are_refused(tmp_path):
    """Edge case: each loader given another component's file names the file and what it is, and a bad
    ``dtype`` / ``quantize`` is refused by name (not a KeyError or torch error)."""
    paths = write_tiny_model_files(tmp_path)
    cases = [
        (lambda: kc.load_transformer(paths["qwen_4b"]), ("qwen_3_4b", "text encoder")),
        (lambda: kc.load_vae(paths["klein_4b"]), ("flux-2-klein-4b", "not a flux.2 vae")),
        (lambda: kc.load_text_encoder(paths["vae"]), ("flux2-vae", "vae")),
        (lambda: kc.load_transformer(paths["klein_4b"], dtype=torch.int8), ("dtype",)),
        (lambda: kc.load_transformer(paths["klein_4b"], dtype="fp64x"), ("dtype",)),
        (lambda: kc.load_transformer(paths["klein_4b"], quantize="int8"), ("quantize",)),
        (lambda: kc.load_text_encoder(paths["qwen_4b"], quantize=True), ("quantize",)),
    ]
    for call, words in cases:
        exc = _error_of(call)
        _assert_clear(exc, words[0])
        assert all(w.lower() in str(exc).lower() for w in words), exc


def test_engine_is_usable_after_a_refused_stage_call(tiny):
    """Edge case: a stage call refused for a bad input (a non-float latent, a NaN latent, a wrong
    settings object) leaves the engine as it was: the next valid call gives the same latents as a
    fresh engine's."""
    tr, te, vae = tiny
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    cond = engine.encode_prompts(["a"])
    settings = kc.Settings(64, 64, 1, seed=3)
    for bad in (lambda: engine.decode(torch.zeros(1, 128, 4, 4, dtype=torch.long)),
                lambda: engine.decode(torch.full((1, 128, 4, 4), float("nan"))),
                lambda: engine.denoise(cond, [], {"steps": 1})):
        _assert_clear(_error_of(bad), "latents", "settings")
    got, _ = engine.denoise(cond, [], settings)
    fresh = kc.Engine(tr, te, vae, prompt_cache=None)
    want, _ = fresh.denoise(fresh.encode_prompts(["a"]), [], settings)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# From the review of the fixes above: what must still be accepted, and the other entry points


def test_generate_refuses_bad_arguments_before_switching_the_models_speed(tiny, picture):
    """Was a bug (review): generate() built its Engine, which switches the models to ``speed``, before
    checking its other arguments, so a refused call (callback=5, composite="false", steps=0, a width
    off the grid) left the models on the fast path, against Engine's promise that bad arguments leave
    them untouched. The speed is now switched once the request has passed every check."""
    from klein_core.accel import speed

    tr, te, vae = build_tiny_components(seed=1)
    assert speed.speed_of(tr) == "plain"
    mask = Image.new("L", picture.size, 255)
    small = {k: v for k, v in SMALL.items() if k not in ("steps", "width")}
    for bad in ({"callback": 5}, {"image": picture, "mask": mask, "composite": "false"}, {"steps": 0},
                {"width": 7}):
        _assert_clear(_error_of(lambda bad=bad: kc.generate(tr, te, vae, prompt="a", speed="fast",
                                                            **{"steps": 2, "width": 64, **bad}, **small)),
                      "callback", "composite", "steps", "size")
        assert speed.speed_of(tr) == "plain" and speed.speed_of(vae) == "plain"


def test_engine_denoise_refuses_a_callback_that_is_not_callable(tiny):
    """Was a bug: as through generate(), Engine.denoise with ``callback=5`` ran a step first."""
    tr, te, vae = tiny
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    cond = engine.encode_prompts(["a"])
    _assert_clear(_error_of(lambda: engine.denoise(cond, [], kc.Settings(64, 64, 1), callback=5)), "callback")


def test_a_zero_sided_reference_through_generate_is_named_before_the_size_is_taken_from_it(tiny):
    """Was a bug (review): without width and height the output size comes from the first reference;
    a ``[1, 3, 0, 64]`` one was told to "give width and height explicitly", after which it failed
    anyway. Now the reference is named first."""
    tr, te, vae = tiny
    exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", references=[torch.zeros(1, 3, 0, 64)],
                                        output="latent", steps=1, cache=None))
    _assert_clear(exc, "reference 1")
    assert "0 pixels" in str(exc)


def test_crop_padding_without_a_mask_names_generates_argument(tiny, picture):
    """Was a bug (review): generate(image=..., mask_crop_padding=8) without a mask said "crop_padding
    needs a mask", an argument generate() does not have."""
    tr, te, vae = tiny
    exc = _error_of(lambda: kc.generate(tr, te, vae, prompt="a", image=picture, mask_crop_padding=8, **SMALL))
    _assert_clear(exc, "mask_crop_padding")


def test_numpy_and_integer_flags_and_values_keep_working(tiny, picture, lora):
    """Edge case (review): the new checks refuse strings and None, not what worked before: numpy
    bools and 0 / 1 as flags, a numpy integer crop padding, a numpy float LoRA strength, a LoRA spec
    as any 2-item sequence, and Path sources."""
    from klein_core.pipeline.inpaint import InitImage

    mask = Image.new("L", picture.size, 255)
    init = InitImage(picture, mask, as_reference=np.bool_(False), composite=0, crop_padding=np.int64(8),
                     feather=np.int64(4))
    assert init.as_reference is False and init.composite is False and init.crop_padding == 8 and init.feather == 4
    assert InitImage(picture, mask, as_reference=1).as_reference is True
    for bad in ("no", None, [False], 2, 0.5):  # [False] and 2 read as True before
        _assert_clear(_error_of(lambda bad=bad: InitImage(picture, mask, as_reference=bad)), "as_reference")
    tr = build_tiny_components(seed=2)[0]
    ref = tr.single_blocks[0].linear1.weight.detach().clone()
    kc.apply_loras(tr, [(lora, np.float32(0.5))])
    changed = tr.single_blocks[0].linear1.weight.detach().clone()
    kc.apply_loras(tr, [[lora, 0.5]])  # a list pair, as before
    assert not torch.equal(changed, ref)
    _assert_clear(_error_of(lambda: kc.apply_loras(tr, [(lora, None)])), "strength")
    assert isinstance(_error_of(lambda: kc.apply_loras(tr, [(lora, None)])), TypeError)  # as float(None)
    assert isinstance(_error_of(lambda: kc.apply_loras(tr, [(lora, "strong")])), ValueError)


def test_loaders_accept_path_objects(tmp_path):
    """Edge case (review): the None check lets ``Path`` and ``os.PathLike`` sources through."""
    import os

    class Where(os.PathLike):
        def __init__(self, path):
            self.path = path

        def __fspath__(self):
            return str(self.path)

    paths = write_tiny_model_files(tmp_path)
    assert kc.load_vae(paths["vae"]).config == kc.load_vae(Where(paths["vae"])).config


@pytest.mark.parametrize("lead", [(0, 5), (3, 0)])
def test_lokr_branch_takes_an_empty_batch(lead):
    """Was a bug (review): a LoKr branch reshaped its output with ``-1``, which an input with no rows
    (``[0, 5, in]``, ``[3, 0, in]``) cannot resolve: "cannot reshape tensor of 0 elements"."""
    from klein_core.lora.apply import _kron_apply

    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(4, 2, generator=g), torch.randn(3, 5, generator=g)
    y = _kron_apply(w1, w2, torch.zeros(*lead, 10), False)
    assert y.shape == (*lead, 12)
    x = torch.randn(2, 10, generator=g)
    torch.testing.assert_close(_kron_apply(w1, w2, x, False), x @ torch.kron(w1, w2).T)
