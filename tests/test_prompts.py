"""Prompt options (512 / whole prompt, model dtype / fp32 activations) and the prompt caches.

The disk cache is keyed by the encoder file's identity (stat only), so a prompt seen before is
answered without loading the encoder or opening its file, also from a fresh process's cache.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

import klein_core as kc
from klein_core.lora import has_loras
from klein_core.pipeline.prompts import encode_prompts, encoder_identity, loaded_encoder_identity
from klein_core.pipeline.sampling import (
    denoise,
    get_schedule,
    make_noise,
    pack,
    position_ids,
    text_position_ids,
    unpack,
)
from klein_core.pipeline.tokenizer import count_tokens
from klein_core.testing import build_tiny_components, write_tiny_model_files

LONG = " ".join(f"word{i}" for i in range(700))  # well over 512 tokens after the chat template


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, Path]:
    return write_tiny_model_files(tmp_path_factory.mktemp("models"), dtype=torch.float32)


@pytest.fixture(scope="module")
def encoder(model_files):
    return kc.load_text_encoder(model_files["qwen_4b"])


class _Opens:
    """Records every file opened under ``folder`` (Python's ``open`` audit event)."""

    active: _Opens | None = None
    _installed = False

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)
        self.paths: list[str] = []

    def __enter__(self) -> _Opens:
        if not _Opens._installed:
            sys.addaudithook(_Opens._hook)  # hooks cannot be removed: one, switched by `active`
            _Opens._installed = True
        _Opens.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        _Opens.active = None

    @staticmethod
    def _hook(event: str, args: tuple) -> None:
        rec = _Opens.active
        if rec is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if path.startswith(rec.folder):
                rec.paths.append(path)


def test_text_options_are_checked():
    assert kc.TextOptions().max_tokens == 512 and kc.TextOptions().activations is None
    assert kc.COMFYUI_TEXT == kc.TextOptions(max_tokens=None, activations=torch.float32)
    for bad in (0, -1, True, 512.0, "512"):
        with pytest.raises(ValueError, match="max_tokens"):
            kc.TextOptions(max_tokens=bad)
    with pytest.raises(ValueError, match="activations"):
        kc.TextOptions(activations=torch.int8)
    with pytest.raises(TypeError, match="TextOptions"):
        kc.Engine(*build_tiny_components(), text="comfyui")


def test_whole_prompt_keeps_every_token_and_512_cuts(encoder):
    n = count_tokens(LONG)
    assert n > 600
    cut = encode_prompts(encoder, [LONG], cache=None)
    whole = encode_prompts(encoder, [LONG], cache=None, options=kc.TextOptions(max_tokens=None))
    assert cut.shape[1] == 512 and whole.shape[1] == n
    # causal attention: the first 512 tokens are the same either way
    assert torch.equal(cut, whole[:, :512])
    short = encode_prompts(encoder, ["a cat"], cache=None, options=kc.TextOptions(max_tokens=None))
    assert short.shape[1] == 512  # padded to at least 512, as ComfyUI does


def test_fp32_activations_on_bf16_weights_leave_the_weights_alone(model_files):
    te = kc.load_text_encoder(model_files["qwen_4b"], dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in te.state_dict().items()}
    out = encode_prompts(te, ["a red fox"], cache=None, options=kc.COMFYUI_TEXT)
    assert out.dtype == torch.float32
    after = te.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    # the same as a float32 copy of the bf16 weights
    copy32 = kc.load_text_encoder(model_files["qwen_4b"], dtype=torch.bfloat16).float()
    ref = encode_prompts(copy32, ["a red fox"], cache=None, options=kc.TextOptions(max_tokens=None))
    assert torch.equal(out, ref)


def test_cache_keys_include_the_options(encoder):
    cache = kc.PromptCache()
    a = cache.encode(encoder, ["a cat"], kc.TextOptions())
    b = cache.encode(encoder, ["a cat"], kc.TextOptions(activations=torch.float64))
    assert cache.misses == 2 and a.dtype == torch.float32 and b.dtype == torch.float64
    assert cache.encode(encoder, ["a cat"], kc.TextOptions()) is not None and cache.hits == 1


def test_disk_cache_answers_a_fresh_process_without_opening_the_encoder(model_files, tmp_path):
    path = model_files["qwen_4b"]
    disk = tmp_path / "prompt_cache"
    first = kc.PromptCache(disk=kc.DiskPromptCache(disk))
    te = kc.load_text_encoder(path)
    identity = loaded_encoder_identity(te, "cpu")
    assert identity == encoder_identity(path, torch.float32, "cpu")
    options = kc.TextOptions(max_tokens=None)
    fresh = first.encode(te, ["a lighthouse at dusk", LONG], options, identity=identity)
    assert len(list(disk.glob("*.safetensors"))) == 2

    with _Opens(path.parent) as probe:  # the recorder sees a load's opens
        kc.load_text_encoder(path)
    assert str(path) in probe.paths
    restarted = kc.PromptCache(disk=kc.DiskPromptCache(disk))  # nothing in memory, as after a restart
    with _Opens(path.parent) as opens:
        got = restarted.cached(encoder_identity(path, torch.float32, "cpu"), ["a lighthouse at dusk", LONG],
                               options)
    assert opens.paths == []  # answered by stat alone: the encoder file was never opened
    assert got is not None and torch.equal(got, fresh)
    assert restarted.cached(identity, ["a prompt never seen"], options) is None
    assert restarted.cached(identity, ["a lighthouse at dusk"], kc.TextOptions()) is None  # other options
    assert restarted.cached(encoder_identity(path, torch.bfloat16, "cpu"), ["a lighthouse at dusk"],
                            options) is None  # other dtype


def test_disk_cache_misses_when_the_encoder_file_changes(model_files, tmp_path):
    src = model_files["qwen_4b"]
    path = tmp_path / "qwen_3_4b.safetensors"
    path.write_bytes(src.read_bytes())
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "pc"))
    cache.encode(kc.load_text_encoder(path), ["a cat"])
    old = encoder_identity(path, torch.float32, "cpu")
    assert cache.cached(old, ["a cat"]) is not None
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # replaced by a newer file
    new = encoder_identity(path, torch.float32, "cpu")
    assert new != old and cache.cached(new, ["a cat"]) is None


def test_disk_cache_is_bounded_and_survives_bad_files(encoder, tmp_path, caplog):
    probe = kc.DiskPromptCache(tmp_path / "probe")
    kc.PromptCache(disk=probe).encode(encoder, ["one"])
    entry = probe.size_bytes()
    disk = kc.DiskPromptCache(tmp_path / "pc", max_bytes=2 * entry + entry // 2)  # room for two
    cache = kc.PromptCache(disk=disk)
    for p in ["one", "two", "three"]:
        cache.encode(encoder, [p])
        time.sleep(0.02)  # distinct modification times
    assert len(list(disk.folder.glob("*.safetensors"))) == 2 and disk.size_bytes() <= disk.max_bytes
    identity = loaded_encoder_identity(encoder)
    restarted = kc.PromptCache(disk=disk)
    assert restarted.cached(identity, ["one"]) is None  # the least recently used went first
    assert restarted.cached(identity, ["two", "three"]) is not None
    big = kc.DiskPromptCache(tmp_path / "pc2")
    cache = kc.PromptCache(disk=big)
    cache.encode(encoder, ["four"])
    [f] = list(big.folder.glob("*.safetensors"))
    f.write_bytes(b"not a safetensors file")
    cache.clear()
    assert cache.cached(identity, ["four"]) is None  # an unreadable entry is a miss...
    assert not f.exists() and "removing unreadable" in caplog.text  # ...and is removed
    assert cache.encode(encoder, ["four"]).shape[1] == 512  # and encoded again


def test_text_encoder_with_loras_is_never_served_from_the_cache(model_files, tmp_path):
    te = kc.load_text_encoder(model_files["qwen_4b"])
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "pc"))
    plain = cache.encode(te, ["a cat"])
    name = "model.layers.0.self_attn.q_proj"
    w = te.state_dict()[name.removeprefix("model.") + ".weight"]
    g = torch.Generator().manual_seed(0)
    lora_sd = {f"text_encoder.{name}.lora_A.weight": torch.randn(4, w.shape[1], generator=g),
               f"text_encoder.{name}.lora_B.weight": torch.randn(w.shape[0], 4, generator=g)}
    from safetensors.torch import save_file

    save_file(lora_sd, str(tmp_path / "te_lora.safetensors"))
    lora = kc.load_lora(tmp_path / "te_lora.safetensors")
    with kc.apply_loras(te, lora):
        assert has_loras(te) and loaded_encoder_identity(te) is None
        adapted = cache.encode(te, ["a cat"])
        assert not torch.allclose(adapted, plain)
        assert torch.equal(adapted, encode_prompts(te, ["a cat"], cache=None))
    assert not has_loras(te)
    assert torch.equal(cache.encode(te, ["a cat"]), plain)
    copy = kc.with_loras(te, lora)
    assert has_loras(copy) and not torch.allclose(cache.encode(copy, ["a cat"]), plain)


def test_engine_uses_the_cache_before_placing_the_encoder(model_files, tmp_path, monkeypatch):
    tr, _, vae = build_tiny_components()
    te = kc.load_text_encoder(model_files["qwen_4b"])
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "pc"))
    engine = kc.Engine(tr, te, vae, kind="base", prompt_cache=cache, text=kc.COMFYUI_TEXT)
    first = engine.encode_prompts([LONG], "blurry")
    assert first.positive.shape[1] == count_tokens(LONG) and first.negative.shape[1] == 512
    entered = []
    real = kc.Engine._stage

    def spy(self, component, plan):
        entered.append(component)
        return real(self, component, plan)

    monkeypatch.setattr(kc.Engine, "_stage", spy)
    again = kc.Engine(tr, te, vae, kind="base", prompt_cache=kc.PromptCache(disk=cache.disk),
                      text=kc.COMFYUI_TEXT).encode_prompts([LONG], "blurry")
    assert entered == []  # both prompts from the disk cache: the encoder was not even placed
    assert torch.equal(again.positive, first.positive) and torch.equal(again.negative, first.negative)


def test_cfg_with_prompts_of_different_lengths_runs_two_forwards(tiny_cfg):
    """Whole prompts: positive and negative embeddings of different lengths; each half is the
    model run on its own text, combined as v_neg + g * (v_pos - v_neg)."""
    tr, txt, neg = tiny_cfg
    noise = make_noise(3, 1, 128, 2, 2)
    sigmas = get_schedule(2, 4)
    out = denoise(tr, noise, txt, sigmas, neg_txt=neg, guidance=4.0)
    # the reference: the same loop written out
    lat = pack(noise)
    img_ids = position_ids(2, 2)
    for i in range(2):
        t = sigmas[i].expand(1)
        vp = tr(img=lat, img_ids=img_ids, txt=txt, txt_ids=text_position_ids(txt.shape[1]), timesteps=t)
        vn = tr(img=lat, img_ids=img_ids, txt=neg, txt_ids=text_position_ids(neg.shape[1]), timesteps=t)
        lat = lat + (sigmas[i + 1] - sigmas[i]) * (vn + 4.0 * (vp - vn))
    diff = (out - unpack(lat, 2, 2)).abs().max().item()
    assert diff < 1e-5, diff


@pytest.fixture(scope="module")
def tiny_cfg():
    tr, te, _ = build_tiny_components()
    txt = encode_prompts(te, [LONG], cache=None, options=kc.TextOptions(max_tokens=None))
    neg = encode_prompts(te, ["blurry"], cache=None, options=kc.TextOptions(max_tokens=None))
    assert txt.shape[1] != neg.shape[1]
    return tr, txt, neg


def test_denoised_estimate_reaches_the_callback(tiny_cfg):
    tr, txt, _ = tiny_cfg
    seen = []

    def cb(step, total, latents, denoised):
        seen.append((step, latents.clone(), denoised.clone()))

    cb.wants_denoised = True  # type: ignore[attr-defined]
    out = denoise(tr, make_noise(1, 1, 128, 2, 2), txt, get_schedule(3, 4), callback=cb)
    assert [s for s, _, _ in seen] == [1, 2, 3]
    # at the last step sigma goes to 0: the estimate is the result
    assert torch.equal(seen[-1][2], out)
    assert not torch.equal(seen[0][2], seen[0][1])  # earlier, the estimate is not the noisy latents

    def plain(step, total, latents):  # callbacks without the attribute keep the old signature
        seen.append(step)

    denoise(tr, make_noise(1, 1, 128, 2, 2), txt, get_schedule(1, 4), callback=plain)
    assert seen[-1] == 1


def test_trim_pads_to_a_multiple_of_its_value():
    """TextOptions.trim: the longest prompt's token count rounded up to a multiple (at most
    max_tokens; without max_tokens nothing is cut); bad values are refused by name."""
    short, mid = "a cat", " ".join(f"w{i}" for i in range(30))
    assert count_tokens(short) <= 64 < count_tokens(mid) <= 128  # the counts the rules below rest on
    trim = kc.TextOptions(trim=64)
    assert trim.length([short]) == 64 and trim.length([short, mid]) == 128
    assert kc.TextOptions(trim=48).length([mid]) == 48 * -(-count_tokens(mid) // 48)
    assert trim.length([LONG]) == 512  # cut at max_tokens, as without trim
    whole = kc.TextOptions(max_tokens=None, trim=64)
    assert whole.length([LONG]) == 64 * -(-count_tokens(LONG) // 64) > 512  # whole prompts: nothing cut
    assert kc.TextOptions().length([short]) == 512 and kc.TextOptions(max_tokens=None).length([short]) == 512
    for bad in (0, -64, True, 64.0, "64"):
        with pytest.raises(ValueError, match="trim"):
            kc.TextOptions(trim=bad)


def test_trimmed_embeddings_are_the_first_rows_of_the_padded_ones(encoder, parity):
    """Qwen3 is causal and the padding is on the right, so a prompt's rows (and the padding rows
    kept) are those of the 512-token encode; cache entries at the two lengths stay apart, and one
    prompt's trimmed entry never answers another's of the same length."""
    cache = kc.PromptCache()
    trim = kc.TextOptions(trim=64)
    trimmed = cache.encode(encoder, ["a red fox"], trim)
    padded = cache.encode(encoder, ["a red fox"], kc.TextOptions())
    assert trimmed.shape[1] == 64 and padded.shape[1] == 512 and cache.misses == 2
    diff = parity("trimmed prompt embedding vs the first rows of the 512 one, fp32",
                  (trimmed - padded[:, :64]).abs().max().item())
    assert diff <= 1e-6, diff
    other = cache.encode(encoder, ["a grey owl"], trim)
    assert other.shape == trimmed.shape and cache.misses == 3 and not torch.equal(other, trimmed)
    assert torch.equal(cache.encode(encoder, ["a red fox"], trim), trimmed) and cache.hits == 1


def test_generate_with_trimmed_padding(parity):
    """A run with trim gives the transformer fewer text tokens (the longest prompt's, rounded up;
    with CFG the negative padded to its own length), and a finite image near the exact run's
    (approximate: on trained weights check it on your images)."""
    from klein_core.accel import relative_l2

    tr, te, vae = build_tiny_components()
    seen: list[int] = []
    hook = tr.txt_in.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        kw = {"prompt": "a red fox", "width": 64, "height": 64, "seed": 2, "cache": None}
        exact = kc.generate(tr, te, vae, **kw)
        assert set(seen) == {512}
        seen.clear()
        fast = kc.generate(tr, te, vae, text=kc.TextOptions(trim=64), **kw)
        assert set(seen) == {64}
        seen.clear()
        long_negative = " ".join(f"w{i}" for i in range(30))
        base = kc.generate(tr, te, vae, kind="base", steps=3, negative_prompt=long_negative,
                           text=kc.TextOptions(trim=64), **kw)
        assert set(seen) == {64, 128}  # the negative at its own length, not the prompt padded to it
        seen.clear()
        long_prompt = " ".join(f"p{i}" for i in range(40))  # over 64 tokens: 128; the empty negative: 64
        kc.generate(tr, te, vae, kind="base", steps=1, negative_prompt="", text=kc.TextOptions(trim=64),
                    **{**kw, "prompt": long_prompt})
        assert seen == [128]  # the negative padded up to the prompt's length: CFG ran as one batch
    finally:
        hook.remove()
    assert torch.isfinite(fast.latents).all() and torch.isfinite(base.latents).all()
    rel = parity("trimmed padding vs 512, tiny random weights, latents relative L2",
                 relative_l2(fast.latents, exact.latents))
    assert 0 < rel < 0.05, rel
