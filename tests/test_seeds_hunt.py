"""Seeds, determinism and reproducibility across the public paths (hunt).

What is probed: what a user who reruns a seed expects. The same seed gives the same latents in one
process (no state carried over by caches, generators or in-place changes of the caller's tensors),
in every memory mode and in ``speed="fast"`` on the CPU (documented as the plain path there); seeds
2^32 apart and the largest seed behave as docs/cli.md says; the noise of image ``i`` of a batch is
found again when that image is taken out of its batch (ComfyUI's ``batch_index``, which the Klein
Sampler's tooltip promises to follow: "drawn on the CPU like ComfyUI's RandomNoise"); seeds written
in batch rows (JSONL, CSV) are read as the same integers as over HTTP; training runs accept every
seed the rest of the pack accepts, and draw each random stream of a step from a generator of its own.

Each ``Was a bug:`` test failed on the code it was written against because of the defect it names (fixed since); each
``Pinned:`` test holds behaviour that already works and is not tested elsewhere. Tiny random models
on the CPU, 64x64 images, few steps.
"""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch
from test_nodes import comfy  # noqa: F401 (fixture: the nodes in ComfyUI 0.3.75's modules)
from train_files import tiny_training_files

import klein_core as kc
from klein_core.distributed.rows import RowError, parse_row, read_rows
from klein_core.pipeline.inputs import InitLatents
from klein_core.pipeline.sampling import make_noise
from klein_core.testing.tiny import build_tiny_components, tiny_transformer
from klein_core.train.adapters import LoRASet, preset
from klein_core.train.cli import add_train_args, run_train
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"width": 64, "height": 64, "steps": 2}


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components()


def _latents(tiny, **kw) -> torch.Tensor:
    tr, te, vae = tiny
    return kc.generate(tr, te, vae, prompt=kw.pop("prompt", "a fox"), output="latent", cache=None,
                       **{**SMALL, **kw}).latents


# ---------------------------------------------------------------------------------------------
# Batch rows: seeds written as JSON numbers with a fraction


def test_jsonl_batch_row_seeds_with_a_fraction_are_read_exactly(tmp_path):
    """Was a bug: ``python -m klein_core batch rows.jsonl`` reads a seed written as a JSON number with a
    fraction or exponent through a binary float: ``read_rows`` (klein_core/distributed/rows.py) parses
    each line with plain ``json.loads``, and ``_int`` takes any integral float. So ``"seed":
    9007199254740993.0`` silently runs (and the manifest records) seed 9007199254740992, another
    image; ``"seed": 5.0000000000000001`` (not an integer) runs seed 5; and the largest seed written
    ``18446744073709551615.0`` is refused with "seed must be from 0 to 2^64-1, got
    18446744073709551616", a number that is not in the file. The same values are read exactly from a
    CSV cell, and over HTTP (``parse_request`` in serve.py parses with ``parse_float=Decimal``: "a seed
    9007199254740993.0 is that seed, 5.0000000000000001 is refused", docs/ray.md), and docs/ray.md
    gives batch rows and HTTP requests one field table. Expected: the JSONL reader parses with
    ``json.loads(line, parse_float=decimal.Decimal)`` as serve does, so each seed is the exact integer
    or refused as not an integer."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "seed": 9007199254740993.0}\n'
                    '{"id": "b", "seed": 5.0000000000000001}\n'
                    '{"id": "c", "seed": 18446744073709551615.0}\n')
    got = []
    for number, raw in read_rows(path):
        try:
            got.append(parse_row(raw, number).seed)
        except RowError as exc:
            got.append("not an integer" if "seed must be an integer" in str(exc) else str(exc))
    assert got == [9007199254740993, "not an integer", 2**64 - 1]


# ---------------------------------------------------------------------------------------------
# The Klein Sampler node and ComfyUI's batch_index


def test_klein_sampler_draws_the_noise_of_the_latents_batch_index(comfy):  # noqa: F811
    """Was a bug: the Klein Sampler ignores a latent's ``batch_index`` (set by ComfyUI's *Latent From Batch*
    and *Repeat Latent Batch*): ``KleinSampler.execute`` / ``init_from_latent`` (nodes/sampler.py)
    read only ``samples`` and ``noise_mask``, and the engine draws the noise for images 0..B-1. Its
    ``seed`` tooltip says the noise is "drawn on the CPU like ComfyUI's RandomNoise", and RandomNoise
    (``comfy.sample.prepare_noise``), like KSampler, draws image ``i``'s noise for ``batch_index`` i,
    so an image taken out of a batch with *Latent From Batch* is sampled again with its own noise
    (Klein Model to MODEL, which the docs say equals the Klein Sampler, does so). Here two encoded
    images are sampled image to image as a batch of 2 with seed 5; the second, taken out with
    *Latent From Batch* (``batch_index`` [1]), sampled with seed 5 comes out as another image (it got
    image 0's noise) instead of the batch's second image (within the last-bit difference of a fused
    batch forward: 3.0e-7 measured with that noise passed by hand). Expected: with a ``batch_index``,
    the noise of image ``i`` is ``make_noise(seed, max(batch_index) + 1, ...)[batch_index[i]]`` (passed
    to ``Engine.denoise`` as ``noise=``)."""
    model, _ = comfy.pack.KleinModelLoader.execute("flux-2-klein-4b.safetensors", "flux2-vae.safetensors",
                                                   "fp32", "auto").args[:2]
    # a native CONDITIONING (as CLIPTextEncode gives): one prompt's embedding, no text encoder to load
    cond = [[torch.randn((1, 16, 96), generator=torch.Generator().manual_seed(4)), {}]]
    images = torch.randn((2, 128, 4, 4), generator=torch.Generator().manual_seed(1))
    kw = {"width": 0, "height": 0, "steps": 2, "guidance": 0.0, "seed": 5, "denoise": 0.5,
          "latent_as_reference": False}
    with torch.inference_mode():
        batch = comfy.pack.KleinSampler.execute(model, cond, batch_size=2, latent={"samples": images},
                                                **kw).args[0]["samples"]
        # what Latent From Batch (batch_index 1, length 1) outputs
        taken = {"samples": images[1:2].clone(), "batch_index": [1]}
        alone = comfy.pack.KleinSampler.execute(model, cond, batch_size=1, latent=taken, **kw).args[0]["samples"]
    assert (batch[0] - batch[1]).abs().max() > 0.1  # two different images
    diff = (alone[0] - batch[1]).abs().max().item()
    assert diff <= 1e-5, f"batch_index 1 alone differs from the batch's image 1 by {diff:.3g}"


def test_review_a_jsonl_number_far_too_large_is_shown_as_written(tmp_path):
    """Was a bug (review): with JSONL numbers read as Decimal, a width of 1e20 was refused as
    "width Decimal('1E+20') is far too large"; the number is shown as a number."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "width": 1e20}\n')
    (_, raw), = list(read_rows(path))
    with pytest.raises(RowError, match=r"width 1E\+20 is far too large") as err:
        parse_row(raw, where="row 1")
    assert "Decimal" not in str(err.value)


def test_klein_sampler_batch_index_rules(comfy):  # noqa: F811
    """The noise a ``batch_index`` asks for (nodes/sampler.py ``batch_noise``): one index per image picks
    that image of the seed's batch; one index for several images (Repeat Latent Batch of a picked
    image) continues from it; none, or 0..B-1, is the seed's plain batch; anything else is refused
    naming ``batch_index``."""
    batch_noise = importlib.import_module("klein_pack_nodes.sampler").batch_noise
    full = make_noise(7, 4, 128, 2, 3)
    assert batch_noise({"samples": None}, 7, 2, (2, 3)) is None
    assert torch.equal(batch_noise({"batch_index": [3, 1]}, 7, 2, (2, 3)), full[[3, 1]])
    assert torch.equal(batch_noise({"batch_index": [1]}, 7, 3, (2, 3)), full[1:4])
    assert torch.equal(batch_noise({"batch_index": [0, 1]}, 7, 2, (2, 3)), full[:2])
    for bad in ([0, 1, 2], [-1], [], [True], "1", [5000]):
        with pytest.raises(ValueError, match="batch_index"):
            batch_noise({"batch_index": bad}, 7, 2, (2, 3))


# ---------------------------------------------------------------------------------------------
# Training seeds


def _train_args(root, paths, data, out, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args([
        "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
        "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", "1", "--resolution", "32",
        "--rank", "2", "--device", "cpu", "--cache-dir", str(root / "cache"), *extra])


def test_train_with_the_largest_seed_and_a_text_encoder_lora_trains(tmp_path, capsys):
    """Was a bug: ``klein_core train --seed 18446744073709551615 --text-encoder-rank 2`` (the largest seed,
    2^64-1, which the same command takes without ``--text-encoder-rank``, and which generation takes
    everywhere) stops after the models are loaded and the dataset encoded with ``error: Overflow when
    unpacking long long`` (exit 2), a message that names no option: ``_run`` (klein_core/train/job.py)
    seeds the text-encoder LoRA with ``job.config.seed + 1``, 2^64, which ``torch.Generator.manual_seed``
    cannot take. Nothing checks the training seed's range up front either (``TrainConfig``, the CLI's
    ``_job``). Expected: the run trains (the text-encoder LoRA's seed derived within 64 bits, e.g.
    ``(seed + 1) % 2**64`` or the trainer's own ``_seed(seed, ...)`` hash), and a seed outside
    0..2^64-1 is refused naming ``seed`` before anything loads."""
    paths, data = tiny_training_files(tmp_path)
    out = tmp_path / "out" / "lora.safetensors"
    code = run_train(_train_args(tmp_path, paths, data, out, "--seed", str(2**64 - 1), "--text-encoder-rank", "2"))
    err = capsys.readouterr().err
    assert code == 0 and out.is_file(), err[-300:]


def test_trainer_draws_each_random_stream_of_a_step_from_its_own_generator(monkeypatch):
    """Was a bug: two random streams of a training step share one generator seed when the global batch holds
    12 or more samples. ``Trainer._batch`` (klein_core/train/trainer.py) seeds sample ``j``'s noise and
    sigma with ``_seed(seed, step, j)``, the reference-dropout coin with ``_seed(seed, step, 0xD)`` and
    the epoch's batch order (``batch_order``) with ``_seed(seed, epoch, 0xB)``: 0xD is position 13 and
    0xB position 11, so at every step the dropout coin is the first number of sample 13's noise stream
    (whether the batch loses its references is decided by that sample's noise), and at step ``s`` the
    shuffle of epoch ``s`` and sample 11's noise come from one generator state. ``_seed``'s comment
    promises "distinct, stable seeds per (seed, step, position)" and docs/training.md draws each of them
    from its own generator. Here a global batch of 14 with reference dropout: one step's draws use 14
    distinct generator seeds where there are 16 streams (14 samples, the dropout coin, the epoch order).
    Expected: the tags live in a space of their own (e.g. ``_seed(seed, step, 0xD, -1)`` or a separate
    leading tag per kind of draw), so every stream is distinct whatever the batch size."""
    model = tiny_transformer()
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randn(1, 128, 1, 1, generator=g), torch.randn(1, 3, 96, generator=g))
               for _ in range(14)]
    trainer = Trainer(model, LoRASet(model, preset("style", rank=2), seed=1), samples,
                      TrainConfig(steps=1, batch_size=14, seed=3, reference_dropout=0.5))
    seeds: list[int] = []
    real = torch.Generator

    class Recording(real):  # type: ignore[misc,valid-type]
        def manual_seed(self, seed):
            seeds.append(int(seed))
            return super().manual_seed(seed)

    try:
        monkeypatch.setattr(torch, "Generator", Recording)
        assert trainer._batch(0) is not None
    finally:
        monkeypatch.undo()
        trainer.close()
    assert len(set(seeds)) >= 16, f"{len(set(seeds))} distinct generator seeds for 16 random streams"


# ---------------------------------------------------------------------------------------------
# Pinned


def test_pinned_seeds_2_32_apart_and_the_largest_seed_give_the_same_latents(tiny):
    """Pinned: docs/cli.md (``--seed``): "as in ComfyUI, torch's CPU generator uses its low 32 bits, so
    seeds 2^32 apart give the same image"; the largest seed 2^64-1 runs (ComfyUI's seed widget's
    maximum) and equals 2^32-1. Another seed gives another image."""
    a = _latents(tiny, seed=5)
    assert torch.equal(a, _latents(tiny, seed=5 + 2**32))
    assert torch.equal(_latents(tiny, seed=2**64 - 1), _latents(tiny, seed=2**32 - 1))
    assert (a - _latents(tiny, seed=6)).abs().max() > 0.1


def test_pinned_a_seed_reruns_exactly_in_every_memory_mode_and_leaves_the_callers_tensors(tiny):
    """Pinned: in one process a seed gives the same latents again, with ``memory`` resident, swap,
    blocks or minimum and ``speed="fast"`` (the plain path on the CPU, docs/speed.md), and the
    caller's explicit noise, reference latents and init latents are not changed in place by an
    inpainting run (so reusing them reproduces it)."""
    tr, te, vae = tiny
    want = _latents(tiny, seed=9)
    for memory in ("resident", "swap", "blocks", "minimum"):
        assert torch.equal(_latents(tiny, seed=9, memory=memory), want), memory
    assert torch.equal(_latents(tiny, seed=9, speed="fast"), want)
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    cond = engine.encode_prompts(["a fox"])
    noise, ref = make_noise(9, 1, 128, 4, 4), torch.randn((1, 128, 4, 4), generator=torch.Generator().manual_seed(2))
    image, mask = torch.randn((1, 128, 4, 4), generator=torch.Generator().manual_seed(3)), torch.zeros(1, 1, 4, 4)
    mask[..., :2] = 1
    kept = [t.clone() for t in (noise, ref, image, mask)]
    runs = [engine.denoise(cond, [ref], kc.Settings(steps=4), noise=noise, init=InitLatents(image, 0.6, mask))[0]
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert all(torch.equal(a, b) for a, b in zip((noise, ref, image, mask), kept))


@pytest.mark.parametrize("name", ["seed", "sample_seed"])
@pytest.mark.parametrize("value", [-1, 2**64])
def test_training_seeds_out_of_range_are_refused_when_configured(name, value):
    """Was a bug: ``TrainConfig`` took a seed of -1 (trained silently) or 2^64 (failed after the models
    loaded and the dataset was encoded), and a ``sample_seed`` out of range failed at the first sample
    image, after the steps. Both are refused when the configuration is made, naming the field."""
    with pytest.raises(ValueError, match=rf"^{name} must be an integer from 0 to 2\^64-1, got {value}$"):
        TrainConfig(**{name: value})
