"""Bad files and bad inputs get one clear error and leave everything usable (issue 7, core side)."""

from __future__ import annotations

import json
import math
import random
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import save_file

import klein_core as kc
from klein_core.errors import WeightFormatError
from klein_core.files.opening import open_weights
from klein_core.memory.planner import MemoryRequest, ModelSizes, choose_plan, estimate
from klein_core.pipeline.images import prepare_reference_image, reference_size
from klein_core.testing import TINY_9B, build_tiny_components, tiny_text_encoder, tiny_transformer, tiny_vae

LOADERS = {"transformer": kc.load_transformer, "text encoder": kc.load_text_encoder, "VAE": kc.load_vae}


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    tr = {k: v.contiguous() for k, v in tiny_transformer().state_dict().items()}
    te = {"model." + k: v.contiguous() for k, v in tiny_text_encoder().state_dict().items()}
    vae = {k: v.contiguous() for k, v in tiny_vae().state_dict().items()}
    paths = {}
    for name, sd in (("transformer", tr), ("text encoder", te), ("VAE", vae)):
        paths[name] = d / f"{name.replace(' ', '_')}.safetensors"
        save_file(sd, paths[name])
    # FLUX.1-like transformer, FLUX.2-dev-like transformer, Qwen3 of another (too shallow) depth
    save_file({"double_blocks.0.img_mod.lin.weight": torch.zeros(6, 1), "img_in.weight": torch.zeros(1, 64)},
              d / "flux1.safetensors")
    dev = dict(tr)
    dev["txt_in.weight"] = torch.zeros(64, 15360)
    save_file(dev, d / "flux2_dev.safetensors")
    shallow = {k: v for k, v in te.items() if not any(f"layers.{i}." in k for i in range(20, 27))}
    save_file(shallow, d / "qwen3_20_layers.safetensors")
    ints = dict(tr)
    ints["img_in.weight"] = torch.zeros(64, 128, dtype=torch.int32)
    save_file(ints, d / "int_weights.safetensors")
    return d, paths


# --- files -------------------------------------------------------------------------------------

BAD_FILES = [
    # (file, loader, expected words in the message)
    ("text encoder", "transformer", ["text encoder"]),
    ("VAE", "transformer", ["VAE"]),
    ("transformer", "VAE", ["transformer"]),
    ("transformer", "text encoder", ["Qwen3"]),
    ("VAE", "text encoder", ["Qwen3"]),
    ("flux1.safetensors", "transformer", ["FLUX.1"]),
    ("flux2_dev.safetensors", "transformer", ["FLUX.2 [dev]", "klein-4b"]),
    ("qwen3_20_layers.safetensors", "text encoder", ["20"]),
    ("int_weights.safetensors", "transformer", ["img_in.weight", "not floating point"]),
]


@pytest.mark.parametrize("file,loader,words", BAD_FILES)
def test_wrong_file_is_named(files, file, loader, words):
    d, paths = files
    path = paths.get(file, d / file)
    with pytest.raises(ValueError) as exc:
        LOADERS[loader](path)
    msg = str(exc.value)
    assert str(path) in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("component", ["transformer", "text encoder", "VAE"])
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
def test_truncated_files(files, component, cut):
    d, paths = files
    data = paths[component].read_bytes()
    bad = d / f"trunc_{component.replace(' ', '_')}_{cut}.safetensors"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(WeightFormatError, match="truncated|not a valid|not a safetensors|outside"):
        LOADERS[component](bad)


def test_pickles_never_unpickled(tmp_path, monkeypatch):
    import pickle

    def boom(*a, **k):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    for name in ("model.ckpt", "model.pt", "model.pth", "pytorch_model.bin", "evil.safetensors"):
        (tmp_path / name).write_bytes(pickle.dumps({"a": 1}, protocol=2))
        for load in LOADERS.values():
            with pytest.raises(WeightFormatError):
                load(tmp_path / name)


def test_failed_load_leaves_a_later_load_working(files):
    _, paths = files
    with pytest.raises(ValueError):
        kc.load_transformer(paths["VAE"])
    assert kc.load_transformer(paths["transformer"]).config.hidden_size == 64


def _mutations(valid: bytes, n: int, seed: int = 0):
    rng = random.Random(seed)
    (hlen,) = struct.unpack("<Q", valid[:8])
    header = json.loads(valid[8 : 8 + hlen])
    for i in range(n):
        kind = i % 6
        if kind == 0:  # flip bytes in the header
            b = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(8, 8 + hlen)] = rng.randrange(256)
            yield bytes(b)
        elif kind == 1:  # lie about the header length
            yield struct.pack("<Q", rng.choice([0, 1, hlen - 1, hlen + 1, 2**63, rng.randrange(2**40)])) + valid[8:]
        elif kind == 2:  # truncate anywhere
            yield valid[: rng.randrange(len(valid))]
        else:  # structurally valid JSON with hostile values
            h = json.loads(json.dumps(header))
            key = rng.choice([k for k in h if k != "__metadata__"])
            field = rng.choice(["dtype", "shape", "data_offsets"])
            h[key][field] = rng.choice([
                -1, 2**62, [2**62, 2**62], [0, -5], [10**18], "F8_E4M3", "Q4", None, [1, 2, 3], {}, "",
                [rng.randrange(-3, 10**6) for _ in range(rng.randrange(0, 4))],
            ])
            raw = json.dumps(h).encode()
            yield struct.pack("<Q", len(raw)) + raw + valid[8 + hlen :]


def test_fuzz_header_reader(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"a": torch.randn(4, 8), "b": torch.arange(6, dtype=torch.int64), "c": torch.ones(3, dtype=torch.bfloat16)}, p)
    valid = p.read_bytes()
    t0 = time.perf_counter()
    outcomes = {"refused": 0, "read": 0}
    for i, data in enumerate(_mutations(valid, 3000)):
        f = tmp_path / "m.safetensors"
        f.write_bytes(data)
        try:
            src = open_weights(f, component="VAE")
            for k in src.keys():  # whatever the header claims must be readable exactly as claimed
                t = src.get(k)
                assert tuple(t.shape) == src.shape(k) and t.dtype == src.dtype(k)
            outcomes["read"] += 1
        except (WeightFormatError, ValueError):
            outcomes["refused"] += 1
    elapsed = time.perf_counter() - t0
    assert outcomes["refused"] > 1000 and sum(outcomes.values()) == 3000, outcomes
    assert elapsed < 60, f"fuzzing took {elapsed:.1f} s"


# --- inputs ------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.one_of(st.none(), st.integers(-10, 2100)),
    height=st.one_of(st.none(), st.integers(-10, 2100)),
    steps=st.one_of(st.none(), st.integers(-2, 3), st.floats(allow_nan=True)),
    guidance=st.one_of(st.none(), st.floats(-5, 20), st.sampled_from([float("nan"), float("inf"), -float("inf")])),
    seed=st.one_of(st.integers(-5, 2**64 + 5), st.booleans()),
    distilled=st.booleans(),
)
def test_generate_inputs_property(tiny, width, height, steps, guidance, seed, distilled):
    """Every combination either runs and returns the promised shape, or raises a clear
    ValueError/TypeError before any compute; never an obscure error or garbage."""
    tr, te, vae = tiny
    kw = dict(prompt="p", width=width, height=height, steps=steps, guidance=guidance, seed=seed,
              kind="distilled" if distilled else "base", output="latent")
    w = 1024 if width is None else width
    h = 1024 if height is None else height
    ok = (
        (steps is None or (isinstance(steps, int) and steps >= 1))
        and (guidance is None or (math.isfinite(guidance) and guidance >= 0))
        and isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64
        and w // 16 * 16 >= 64 and h // 16 * 16 >= 64 and (w // 16 * 16) * (h // 16 * 16) <= 4 * 1024 * 1024
    )
    if ok and (w // 16) * (h // 16) > 1024:
        kw["steps"] = None if steps is None else 1
        kw.update(width=min(w, 256), height=min(h, 256))  # keep the CPU run small; validity unchanged
        w, h = kw["width"], kw["height"]
    if not ok:
        with pytest.raises((ValueError, TypeError)):
            kc.generate(tr, te, vae, **kw)
        return
    kw["steps"] = 1
    res = kc.generate(tr, te, vae, **kw)
    assert res.latents.shape == (1, 128, h // 16, w // 16)
    assert torch.isfinite(res.latents).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    w=st.integers(1, 1500), h=st.integers(1, 1500),
    mode=st.sampled_from(["RGB", "RGBA", "L", "LA", "P", "I;16", "I", "F", "1", "CMYK"]),
)
def test_reference_preprocessing_property(w, h, mode):
    img = Image.new(mode, (w, h))
    if min(w, h) < 64 or max(w / h, h / w) > 8:
        with pytest.raises(ValueError):
            prepare_reference_image(img)
        return
    t = prepare_reference_image(img)
    ew, eh = reference_size(w, h)
    assert t.shape == (1, 3, eh, ew) and t.dtype == torch.float32
    assert float(t.min()) >= -1 and float(t.max()) <= 1


def test_nan_latents_are_reported(tiny):
    tr, te, vae = tiny
    broken = tiny_transformer()
    with torch.no_grad():
        broken.final_layer.linear.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="NaN"):
        kc.generate(broken, te, vae, prompt="x", width=64, height=64, steps=1)
    # the healthy models are unaffected
    assert kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=1).images[0].size == (64, 64)


def test_out_of_memory_message_names_settings(tiny, monkeypatch):
    tr, te, vae = tiny

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(kc.pipeline.engine, "denoise", oom)
    with pytest.raises(kc.KleinOutOfMemory) as exc:
        kc.generate(tr, te, vae, prompt="x", width=512, height=384, batch_size=2, steps=1,
                    reference_latents=[torch.zeros(1, 128, 4, 4)])
    msg = str(exc.value)
    assert "512x384" in msg and "batch" in msg and "references" in msg and "offload" in msg
    monkeypatch.undo()
    assert kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=1).latents.shape == (1, 128, 4, 4)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t", "x" * 5000])
def test_odd_prompts(tiny, prompt, caplog):
    tr, te, vae = tiny
    res = kc.generate(tr, te, vae, prompt=prompt, width=64, height=64, steps=1, output="latent")
    assert torch.isfinite(res.latents).all()
    if len(prompt) > 1000:
        assert "cut" in caplog.text or "truncat" in caplog.text.lower()


def test_mismatched_pair_named(tiny):
    tr, _, vae = tiny
    with pytest.raises(ValueError, match=r"text width 144.*text width 96"):
        kc.generate(tr, tiny_text_encoder(TINY_9B), vae, prompt="x")


def test_reference_batch_and_bad_reference_tensor(tiny):
    tr, te, vae = tiny
    with pytest.raises(ValueError, match="reference 1"):
        kc.generate(tr, te, vae, prompt="x", references=[torch.zeros(2, 3, 64, 64)], steps=1)
    arr = (np.random.default_rng(0).random((70, 90, 3)) * 255).astype(np.uint8)
    res = kc.generate(tr, te, vae, prompt="x", references=[Image.fromarray(arr)], steps=1)
    assert (res.width, res.height) == (80, 64)


def test_request_that_cannot_fit_is_refused_up_front_with_the_estimate(tiny, monkeypatch):
    tr, te, vae = tiny
    refs = [torch.zeros(1, 128, 64, 64)] * 3
    request = MemoryRequest(1024, 1024, references=((1024, 1024),) * 3)
    plan = choose_plan(estimate(request, ModelSizes.from_modules(tr, te, vae)), free_bytes=10**6)
    assert not plan.fits and "short by" in plan.reason
    called = []
    monkeypatch.setattr(kc.pipeline.engine, "denoise", lambda *a, **k: called.append(1))
    with pytest.raises(kc.KleinOutOfMemory, match="refused before running.*estimated peak.*short by"):
        kc.generate(tr, te, vae, prompt="x", reference_latents=refs, memory=plan, device="cpu")
    assert not called  # nothing ran
