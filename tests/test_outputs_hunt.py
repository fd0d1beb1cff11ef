"""Bug hunt: "no data lost" and faithful outputs (the CLI's images and their parameters, the trainer's
LoRA file, the batch job's output folder).

Everything here is fast and CPU only: the CLI runs ``--demo`` with ``klein_core.cli.generate``
replaced by a stand-in that returns ready images (the code under test is what the CLI does with
them: ``check_out``, ``_save_images`` and the ``parameters`` it writes); the trainer runs one step
on the tiny model files; the batch job is driven up to its first write, without Ray.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from train_files import tiny_training_files

from klein_core import cli as kcli
from klein_core.distributed import ray_support
from klein_core.distributed.batch import BatchConfig, prepare_rows
from klein_core.distributed.manifest import Entry, Manifest, image_path, write_atomic
from klein_core.distributed.models import ModelSpec
from klein_core.lora import apply_loras, load_lora
from klein_core.pipeline.engine import GenerationResult
from klein_core.testing.tiny import build_tiny_components
from klein_core.train.adapters import AdapterConfig, LoRASet, TargetGroup, preset, text_encoder_preset
from klein_core.train.cli import add_train_args, run_train
from klein_core.train.save import save_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["--demo", "--width", "64", "--height", "64", "--steps", "1", "-q"]


# -- helpers ------------------------------------------------------------------------------------------

@pytest.fixture
def fake_generate(monkeypatch):
    """``klein_core.cli.generate`` replaced: returns ``batch_size`` distinct 64x64 images at once and
    records each call (so a test can tell whether a generation ran)."""
    calls: list[dict] = []

    def generate(transformer, text_encoder, vae, **kw):
        calls.append(kw)
        n = kw.get("batch_size", 1)
        images = [Image.new("RGB", (64, 64), (40 * i % 256, 90, 200)) for i in range(n)]
        kind = kw.get("kind", "distilled")
        guidance = 1.0 if kind != "base" else float(4.0 if kw.get("guidance") is None else kw["guidance"])
        refs = [(64, 64)] * len(kw.get("references") or [])
        steps = kw.get("steps") or 1
        return GenerationResult(torch.zeros(n, 128, 4, 4), images, None, 64, 64, steps, guidance, kw["seed"],
                                {"text": 0.0, "denoise": 0.0}, refs, [None] * n)

    monkeypatch.setattr(kcli, "generate", generate)
    return calls


def _params(path: Path) -> dict:
    with Image.open(path) as img:
        return json.loads(img.text["parameters"])


def _train_args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    """The tiny model files and two-image dataset, and one latent/prompt cache for every training test
    (encoded once). The first AdamW of a process imports torch._dynamo (about 2 s): done here too,
    not inside the first training test."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    root = tmp_path_factory.mktemp("train")
    paths, data = tiny_training_files(root)
    return paths, data, root / "cache"


def _train(inputs, output: Path, *extra: str) -> tuple[int | None, BaseException | None, str, bool]:
    """``run_train`` of one step on the tiny files: (exit code, what it raised, stderr, whether a step
    ran)."""
    import sys

    paths, data, cache = inputs
    args = _train_args("--dataset", str(data), "--transformer", str(paths["klein_base_4b"]),
                       "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
                       "--output", str(output), "--steps", "1", "--resolution", "32", "--rank", "1",
                       "--device", "cpu", "--cache-dir", str(cache), *extra)
    err = io.StringIO()
    real, sys.stderr = sys.stderr, err
    try:
        rc, raised = run_train(args), None
    except Exception as exc:  # noqa: BLE001 - what escapes is the finding
        rc, raised = None, exc
    finally:
        sys.stderr = real
    text = err.getvalue()
    return rc, raised, text, "step 1/1" in text


@pytest.fixture(scope="module")
def tiny_models():
    torch.manual_seed(0)
    return build_tiny_components()


def _random_up(lora: LoRASet, seed: int) -> LoRASet:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.up.copy_(torch.randn(layer.up.shape, generator=g))
    return lora


# -- klein-generate: the images and their parameters ---------------------------------------------------

@pytest.mark.parametrize("name, batch", [
    ("狐" * 84, 1),             # 252 bytes, a legal name; ".png" is added -> 256 bytes
    ("狐" * 83 + ".png", 2),    # 253 bytes, a legal name; the batch's "_00" -> 256 bytes
    ("fox.png", 2),             # a folder "fox_00.png" is in the way of the first batch file
], ids=["png-added", "batch-suffix", "batch-name-is-a-folder"])
def test_an_out_name_that_cannot_be_written_is_refused_before_the_generation(tmp_path, fake_generate, capsys,
                                                                            name, batch):
    """Was a bug: ``klein-generate --demo --out <name>`` where the name given is a legal file name but the
    name actually written is not: a 252-byte name without an extension (the CLI adds ``.png``:
    256 bytes, over the 255-byte name limit of ext4, XFS, Btrfs...), a 253-byte ``....png`` with
    ``--batch 2`` (``_00`` is added: 256 bytes), or ``--out fox.png --batch 2`` beside a folder
    ``fox_00.png``. Seen: every check passes, the models load, the whole generation runs, and only
    then ``error: --out ..._00.png: cannot write it (File name too long)`` (or ``Is a directory``),
    exit 2, not one image on disk: the batch that was computed is lost. Expected: refused before
    anything loads, as ``check_out`` promises for ``--out`` ("checked before anything loads (a
    generation must not be lost at the end)", klein_core/cli.py; docs/cli.md: a bad ``--out`` "is
    refused before any model loads"), or the images written. ``check_out`` checks ``out`` itself,
    not the names ``_save_images`` derives from it (the ``.png`` it adds, the ``_NN`` of a batch)."""
    out = tmp_path / name
    if name == "fox.png":
        (tmp_path / "fox_00.png").mkdir()
    rc = kcli.main([*SMALL, "--prompt", "a fox", "--batch", str(batch), "--out", str(out)])
    written = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    ran = len(fake_generate) > 0
    assert not (ran and not written), (
        f"the generation ran, then nothing was saved (exit {rc}): {capsys.readouterr().err.strip()[-160:]}")


def test_an_out_name_over_the_limit_as_given_is_one_error_line(tmp_path, fake_generate, capsys):
    """Was a bug: ``--out <300 bytes>.png``: ``check_out`` asked ``Path.is_dir()`` about the name, which
    raises for a name over the file system's limit (ENAMETOOLONG is not among the errors pathlib
    ignores): an OSError traceback, exit 1. Now one line naming the name's length, exit 2."""
    rc = kcli.main([*SMALL, "--prompt", "a fox", "--out", str(tmp_path / ("a" * 300 + ".png"))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not fake_generate and len(err.splitlines()) == 1, (rc, err[-300:])
    assert "304 bytes, over the" in err


def test_review_a_file_written_whole_keeps_its_mode_and_writes_through_a_link(tmp_path, monkeypatch):
    """Review of the fixes above: ``atomic_path`` replaced a symbolic link at ``--out`` by a file (the
    target kept the old picture) and reset the permission bits of the file it replaced. Now the
    link's target is written and keeps its mode; an unlimited name length (-1) refuses nothing."""
    import os
    import stat

    from klein_core.files import atomic

    target, link = tmp_path / "target.png", tmp_path / "link.png"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link.symlink_to(target)
    with atomic.atomic_path(link) as tmp:
        tmp.write_bytes(b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    monkeypatch.setattr(atomic.os, "pathconf", lambda *a: -1)
    assert atomic.unwritable(tmp_path / ("a" * 300 + ".png")) is None


def test_out_starting_with_a_tilde_is_the_home_folder(tmp_path, fake_generate, monkeypatch):
    """Was left last review: ``--out "~/renders/x.png"`` quoted (no shell expands it) wrote into a
    folder named ``~`` in the working folder. It is the home folder, as the prompt cache's folder is."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert kcli.main([*SMALL, "--prompt", "a fox", "--out", "~/renders/x.png"]) == 0
    assert (tmp_path / "home" / "renders" / "x.png").is_file() and not (tmp_path / "~").exists()


def test_a_failed_write_keeps_the_image_that_was_at_out(tmp_path, fake_generate, monkeypatch, capsys):
    """Was a bug: ``klein-generate --demo --out fox.png`` over an existing good ``fox.png`` (a rerun), when
    the write fails half-way (simulated: PIL's PNG writer writes part of the file, then the disk is
    full, ``ENOSPC``). Seen: exit 2 with ``cannot write it (No space left on device)``, and
    ``fox.png`` is now a truncated 20-odd-byte file: the previous image is destroyed and the new one
    not written. Expected: the old file intact (or the new one complete). ``_save_images``
    (klein_core/cli.py, ``img.save(p, pnginfo=meta)``) writes straight into the final name, which PIL
    truncates first; every other writer of the project goes through a temporary file and a rename
    (``save_lora``, ``save_state``, the sample images, the batch job's ``write_atomic``: "``path`` is
    either absent, its old content, or all of ``data``"). Fix: save to a temporary name in the same
    folder and ``os.replace`` it (``write_atomic`` of ``png_bytes``)."""
    out = tmp_path / "fox.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(out)
    before = out.read_bytes()
    real = Image.SAVE["PNG"]

    def disk_full(im, fp, filename, *args, **kw):
        buf = io.BytesIO()
        real(im, buf, filename, *args, **kw)
        fp.write(buf.getvalue()[:24])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(Image.SAVE, "PNG", disk_full)
    rc = kcli.main([*SMALL, "--prompt", "a fox", "--out", str(out)])
    monkeypatch.setitem(Image.SAVE, "PNG", real)
    assert rc != 0 and "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == before, f"{out.name} is now {len(out.read_bytes())} bytes of a cut PNG"


@pytest.mark.parametrize("flags", [[], ["--base", "--guidance", "1"]], ids=["distilled", "base-guidance-1"])
def test_parameters_do_not_claim_a_negative_prompt_that_did_not_run(tmp_path, fake_generate, flags):
    """Was a bug: ``klein-generate --demo --negative-prompt blurry`` on a distilled model (or ``--base
    --guidance 1``): no CFG runs, the engine even warns "the negative prompt is not used", yet the
    PNG's ``parameters`` say ``"negative_prompt": "blurry"``, a setting that did not change one pixel.
    Expected: ``""`` (or null). docs/cli.md: the parameters are "everything that changed the pixels,
    resolved"; the engine applies the same rule to guidance ("a distilled model runs without CFG
    whatever was asked, so the result and the PNG's parameters say 1, not the guidance given",
    pipeline/request.py ``resolve``), and a quantisation that did not run is not recorded either.
    Cause: ``run_generate`` (klein_core/cli.py) copies ``args.negative_prompt``; the batch job's
    ``RowRunner.run`` (distributed/runner.py) copies ``row.negative_prompt`` the same way. Fix: record
    it only when CFG ran (``kind == "base"`` and the resolved guidance > 1)."""
    out = tmp_path / "n.png"
    argv = [*SMALL, *flags, "--prompt", "a fox", "--negative-prompt", "blurry", "--out", str(out)]
    assert kcli.main(argv) == 0
    params = _params(out)
    assert params["guidance"] == 1.0  # no CFG ran
    assert params.get("negative_prompt") == "", params.get("negative_prompt")


def test_pinned_parameters_keep_odd_prompts_paths_and_the_largest_seed_exactly(tmp_path, fake_generate):
    """Pinned: the PNG ``parameters`` of ``klein-generate`` round-trip prompts and a negative prompt
    with newlines, quotes, backslashes, tabs, accents, CJK, an emoji and a lone surrogate (bytes of
    argv that are not UTF-8), a reference path with spaces and unicode, seed 2^64-1 and ``--batch 2``
    (``batch``, ``batch_index`` and one file per image), read back from the files."""
    prompt = 'a "red" fox\n\tin snow \\ under ☃ — naïve 狐 🦊 \udcff'
    negative = "blurry,\nlow 'quality' \\n"
    ref = tmp_path / "réf ☃.png"
    Image.new("RGB", (64, 64), (9, 9, 9)).save(ref)
    out = tmp_path / "odd.png"
    rc = kcli.main([*SMALL, "--base", "--guidance", "4", "--prompt", prompt, "--negative-prompt", negative,
                    "--ref", str(ref), "--seed", str(2**64 - 1), "--batch", "2", "--out", str(out)])
    assert rc == 0
    files = [tmp_path / "odd_00.png", tmp_path / "odd_01.png"]
    for i, f in enumerate(files):
        p = _params(f)
        assert (p["prompt"], p["negative_prompt"], p["seed"]) == (prompt, negative, 2**64 - 1)
        assert (p["references"], p["batch"], p["batch_index"], p["guidance"]) == ([str(ref)], 2, i, 4.0)
    with Image.open(files[0]) as a, Image.open(files[1]) as b:
        assert a.tobytes() != b.tobytes()  # two images, not one written twice


# -- the trainer: the LoRA file -----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["an existing folder", "a path under a file"])
def test_train_output_that_cannot_be_written_is_refused_before_training(tmp_path, train_inputs, where):
    """Was a bug: ``python -m klein_core train ... --output X`` where X is an existing folder (or lies under a
    regular file). Seen: every step trains, then ``save_lora`` fails at the very end with an uncaught
    ``IsADirectoryError`` (``FileExistsError``) traceback out of ``run_train``; the trained LoRA is
    lost (for a folder it is left as a hidden ``.X.tmp`` beside it). Expected: one line, exit 2,
    before anything trains; ``klein-generate`` refuses such an ``--out`` before any model loads
    (docs/cli.md), and README: "Bad input gets one clear error naming the file or input and what to
    do; the process never crashes". Cause: ``run_job`` (train/job.py) never checks ``job.output``
    before training, and ``run_train`` (train/cli.py) catches only DatasetError, ValueError and
    FileNotFoundError. Fix: check the output path (not a folder, its parent a folder or creatable)
    with the other options, before any encoding."""
    if where == "an existing folder":
        output = tmp_path / "my_lora.safetensors"
        output.mkdir()
    else:
        (tmp_path / "loras").write_text("a file, not a folder")
        output = tmp_path / "loras" / "my_lora.safetensors"
    rc, raised, _, trained = _train(train_inputs, output)
    assert raised is None and rc == 2 and not trained, (
        f"exit {rc}, raised {type(raised).__name__ if raised else None}: {raised}; "
        f"a step trained first: {trained}")


def test_custom_targets_the_default_naming_cannot_write_are_refused_before_training(tmp_path, train_inputs):
    """Was a bug: ``python -m klein_core train ... --targets txt_in --output l.safetensors`` (the default
    ``--format diffusers``; the same for ``img_in``, ``final_layer.linear``, ``time_in.*``, the
    modulation linears, or a catch-all ``.*``). ``txt_in`` is a linear of the model, so the targets
    pass the documented check ("custom --targets that compile and each match a linear of the model",
    checked before anything is encoded: docs/training.md), every step trains, and only ``save_lora``
    at the end says ``error: no diffusers name for core module 'txt_in'``, exit 2: the trained LoRA is
    lost and no file is written. (``--format kohya`` and ``comfyui`` write and ``load_lora`` reads
    such a module.) Expected: refused before training, naming the module and the formats that can
    hold it, or written. job.py checks ``fmt`` up front for this very reason ("before training, not
    when the LoRA is saved at the end") but not whether the format can name every adapted module.
    Cause: train/save.py ``diffusers_names`` knows the double/single block modules only. Fix: call
    ``lora_state_dict`` (or a dry ``diffusers_names`` over the LoRASet's modules) right after the
    LoRASet is built in ``run_job``, or map these modules to diffusers' names (``context_embedder``,
    ``x_embedder``, ``proj_out``, ``norm_out.linear``...)."""
    output = tmp_path / "out" / "l.safetensors"
    rc, raised, err, trained = _train(train_inputs, output, "--targets", "txt_in")
    written = output.is_file()
    assert raised is None and (written or not trained), (
        f"exit {rc}: a step trained, then no LoRA was written: {err.strip().splitlines()[-1:]}")
    if written:
        assert not load_lora(output).skipped
    # The fix chose refusal before training, naming the module and the namings that hold it.
    assert rc == 2 and not trained and not written
    assert "txt_in" in err and "kohya or comfyui" in err, err


def test_a_lora_name_near_the_length_limit_is_saved(tmp_path, tiny_models):
    """Was a bug: ``save_lora(<folder>/<80 CJK characters>.safetensors, lora)``: the name is 252 bytes, a
    legal file name (the limit is 255), but the LoRA is first written to ``.<name>.tmp`` (257 bytes),
    so ``safetensors`` fails with "File name too long" and nothing is written. Through ``python -m
    klein_core train --output`` (or the trainer node's ``lora_name``) this happens after the last
    step: the whole run is lost, with a ``SafetensorError`` traceback (not an OSError the CLI would
    name). Expected: the file written and read back by ``load_lora``. Cause: train/save.py
    ``save_lora`` (``tmp = path.with_name(f".{path.name}.tmp")``, 5 bytes longer than the name).
    Fix: a short temporary name in the same folder (``tempfile.mkstemp(dir=path.parent,
    prefix=".klein-", suffix=".tmp")``)."""
    tr, _, _ = tiny_models
    lora = _random_up(LoRASet(tr, preset("style", rank=1), seed=0), 1)
    path = tmp_path / ("猫" * 80 + ".safetensors")
    assert len(path.name.encode()) == 252
    try:
        save_lora(path, lora, metadata={"steps": 1})
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
        pytest.fail(f"saving a LoRA under a 252-byte name failed: {type(exc).__name__}: {exc}")
    assert load_lora(path).metadata["klein.steps"] == "1"


def test_pinned_mixed_ranks_and_alphas_round_trip_through_load_lora_in_every_naming(tmp_path, tiny_models):
    """Pinned: a LoRA with two transformer groups of different ranks and alphas (rank 2 alpha 5 on
    double block 0 with its split q/k/v, rank 3 alpha 1.5 on the single blocks) and a text-encoder
    part (rank 2 alpha 7), saved in each naming (diffusers with the PEFT rank/alpha patterns, Kohya
    with alpha keys, ComfyUI with the scale folded into B) and read back by ``klein_core.load_lora``,
    merges exactly the deltas that were trained into exactly the adapted weights of both models (every
    key used), and the file's ``klein.ranks`` / ``klein.targets`` name the ranks and alphas."""
    tr, te, _ = tiny_models
    groups = (TargetGroup("d0", r"double_blocks\.0\..*", 2, 5.0),
              TargetGroup("single", r"single_blocks\..*", 3, 1.5))
    cfg = AdapterConfig(groups)
    lora = _random_up(LoRASet(tr, cfg, seed=1), 3)
    text = _random_up(LoRASet(te, text_encoder_preset(2, 7.0), seed=2), 4)
    base_tr = {k: v.clone() for k, v in tr.state_dict().items()}
    base_te = {k: v.clone() for k, v in te.state_dict().items()}
    expected = {("tr", f"{n}.weight"): layer for n, layer in lora.items()}
    expected.update({("te", f"{n}.weight"): layer for n, layer in text.items()})
    for fmt in ("diffusers", "kohya", "comfyui"):
        path = save_lora(tmp_path / f"{fmt}.safetensors", lora, fmt=fmt, text_lora=text)
        loaded = load_lora(path)
        assert not loaded.skipped, (fmt, loaded.skipped)
        handle = apply_loras((tr, te), [(loaded, 1.0)], mode="merge")
        try:
            now = {("tr", k): v.clone() for k, v in tr.state_dict().items()}
            now.update({("te", k): v.clone() for k, v in te.state_dict().items()})
        finally:
            handle.remove()
        before = {("tr", k): v for k, v in base_tr.items()} | {("te", k): v for k, v in base_te.items()}
        changed = {k for k in now if not torch.equal(now[k], before[k])}
        assert changed == set(expected), fmt
        for key, layer in expected.items():
            want = layer.scale * torch.cat([layer.up[p] @ layer.down[p] for p in range(layer.parts)])
            torch.testing.assert_close(now[key] - before[key], want, atol=2e-6, rtol=0, msg=f"{fmt} {key}")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert set(json.loads(meta["klein.ranks"]).values()) == {2, 3}
        targets = {g.name: {"pattern": g.pattern, "rank": g.rank, "alpha": g.alpha} for g in groups}
        assert json.loads(meta["klein.targets"]) == targets
        assert json.loads(meta["klein.text_encoder_targets"])["text_encoder"]["alpha"] == 7.0


# -- the batch job's output folder ----------------------------------------------------------------------

def _rows(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_two_rows_of_a_job_never_share_a_png(tmp_path, monkeypatch):
    """Was a bug: a batch file with rows ``{"id": "Fox", "prompt": "a red fox"}`` and ``{"id": "fox", "prompt":
    "a grey fox"}``. Seen: both are accepted and run, into ``images/Fox.png`` and ``images/fox.png``:
    on the case-insensitive file systems of macOS (APFS's default, a platform the README supports) and
    Windows these are one file, so the second row's image silently replaces the first's, while the
    manifest records both ids as done with their own ``file``, and no rerun ever redoes the lost one.
    Expected: no two rows of a job write the same PNG; the second is a bad row, as a duplicate id is
    ("id 'fox' was already used by row 1"). docs/ray.md: the id "names the PNG", and each row is one
    image. Cause: ``prepare_rows`` (distributed/batch.py) compares ids case-sensitively. Fix: key
    ``seen`` on ``row.id.casefold()`` (or name the files so that they cannot collide). Review: only
    where the output's file system does not tell case apart (a probe file says; stood in for here),
    so case-distinct ids keep working on Linux, and a resumed Linux job with both done is unchanged."""
    from klein_core.distributed import batch

    src = _rows(tmp_path / "rows.jsonl", {"id": "Fox", "prompt": "a red fox"},
                {"id": "fox", "prompt": "a grey fox"})
    out = tmp_path / "out"
    monkeypatch.setattr(batch, "folds_case", lambda folder: True)  # macOS / Windows
    todo, bad, _, total = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), Manifest(out))
    assert total == 2
    names = [image_path(out, r.id).name for r in todo]
    assert len({n.casefold() for n in names}) == len(names), f"rows writing one file: {names}"
    assert "the file system of --out does not tell case apart" in bad[0].error
    monkeypatch.setattr(batch, "folds_case", lambda folder: False)  # Linux: two files
    todo, bad, _, _ = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), Manifest(out))
    assert [r.id for r in sorted(todo, key=lambda r: r.id)] == ["Fox", "fox"] and not bad
    assert batch.folds_case(tmp_path) is (sys.platform in ("darwin", "win32"))  # the probe, on this machine


@pytest.mark.parametrize("where", ["a file", "a folder under a file"])
def test_batch_out_that_is_not_a_folder_is_one_error_line(tmp_path, monkeypatch, capsys, where):
    """Was a bug: ``python -m klein_core batch rows.jsonl --out renders --demo`` where ``renders`` is an
    existing regular file (or ``--out renders/job`` under it). Seen: an uncaught ``FileExistsError``
    (``NotADirectoryError``) traceback out of ``klein_core.cli.main``: ``OutputLock.__enter__``
    (distributed/manifest.py, ``self.path.parent.mkdir``) raises it, ``run_batch_job`` turns only
    ``OutputInUse`` into a CLIError, and ``main`` catches FileNotFoundError but no other OSError.
    Expected: ``error: --out renders: ...`` on one line and exit 2 (docs/ray.md: "2: the job could not
    start"; README: "Bad input gets one clear error naming the file or input and what to do; the
    process never crashes"), as ``klein-generate`` says of an ``--out`` under a file. Here Ray is not
    started (``require_ray`` and ``init_ray`` stubbed): the folder is taken before any row runs."""
    monkeypatch.setattr(ray_support, "require_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray_support, "init_ray", lambda *a, **k: None)
    src = _rows(tmp_path / "rows.jsonl", {"id": "a", "prompt": "a fox"})
    (tmp_path / "renders").write_text("a file")
    out = tmp_path / "renders" if where == "a file" else tmp_path / "renders" / "job"
    try:
        argv = ["batch", str(src), "--out", str(out), "--demo", "--device", "cpu", "--workers", "1", "-q"]
        rc, raised = kcli.main(argv), None
    except Exception as exc:  # noqa: BLE001 - what escapes is the finding
        rc, raised = None, exc
    err = capsys.readouterr().err
    assert raised is None and rc == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, (
        f"exit {rc}, raised {type(raised).__name__ if raised else None}: {raised}")


def test_pinned_a_done_row_whose_png_was_deleted_is_redone_and_a_failed_write_keeps_the_old_png(tmp_path,
                                                                                                 monkeypatch):
    """Pinned: a row with an error-free manifest entry whose PNG the user deleted is not "done" and runs
    again (the others are skipped); and ``write_atomic`` that fails while writing (the disk full at
    ``fsync``) leaves the PNG that was there unchanged and no temporary file behind."""
    src = _rows(tmp_path / "rows.jsonl", {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    out = tmp_path / "out"
    for rid in "ab":
        write_atomic(image_path(out, rid), b"png " + rid.encode())
    Manifest(out).append([Entry(r, f"images/{r}.png", 0, 0.1, "w") for r in "ab"])
    image_path(out, "b").unlink()
    todo, bad, skipped, total = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), Manifest(out))
    assert ([r.id for r in todo], bad, skipped, total) == (["b"], [], 1, 2)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.fsync", disk_full)
    with pytest.raises(OSError):
        write_atomic(image_path(out, "a"), b"a new image")
    assert image_path(out, "a").read_bytes() == b"png a"
    assert sorted(p.name for p in (out / "images").iterdir()) == ["a.png"]


def test_a_training_run_says_before_its_first_step_that_it_replaces_an_existing_lora(tmp_path, train_inputs, caplog):
    """Was a bug: ``train --output l.safetensors`` over a LoRA trained earlier replaced it at the end of
    the run without a word; the user found out only afterwards. The run now warns at its start (while
    stopping costs nothing), and only when the file exists."""
    out = tmp_path / "l.safetensors"
    with caplog.at_level(logging.WARNING, logger="klein_core.train.job"):
        assert _train(train_inputs, out)[0] == 0
        assert "exists" not in caplog.text
        assert _train(train_inputs, out)[0] == 0
    assert f"output {out} exists; this run replaces it when it ends" in caplog.text
    (said,) = [r for r in caplog.records if "exists" in r.getMessage()]
    assert said.created < out.stat().st_mtime  # said before the new file was written
