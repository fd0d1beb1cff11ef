"""Progress reporting and live previews, as a ComfyUI user sees them (the Klein Sampler's and the
Klein LoRA Trainer's progress bar, the latent previews) and as the command lines print them
(klein-generate's ``denoising [###-] 3/4`` line, the training CLI's ``step N/M`` line).

The node tests run the nodes' ``execute`` inside ComfyUI 0.3.75's modules on the CPU with tiny random
models (the ``comfy`` fixture of test_nodes.py, the ``env`` fixture of test_train_node.py); the CLI
tests run ``klein_core.cli.main`` with ``--demo`` (tiny models built in memory).
"""

from __future__ import annotations

import argparse
import errno
import io
import logging
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from test_nodes import M4B_BASE, _encode, _load, _sample, comfy, progress  # noqa: F401 (fixtures)
from test_train_node import _run as _train
from test_train_node import env  # noqa: F401 (fixture)
from train_files import one_thread, tiny_training_files  # noqa: F401 (an autouse fixture)

from klein_core import cli
from klein_core.pipeline import sampling
from klein_core.pipeline.inpaint import comfy_mask_to_latents

DEMO = ["--demo", "--width", "64", "--height", "64"]


@pytest.fixture(autouse=True)
def _no_cli_log_handler_left():
    """``cli.main`` hooks klein_core's warnings to the stderr of the moment (pytest's capture, closed
    after the test): removed again, so later tests' warnings do not hit a closed stream."""
    root = logging.getLogger("klein_core")
    before = list(root.handlers)
    yield
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)


@pytest.fixture(scope="module")
def models(comfy):  # noqa: F811
    """The distilled and the base model and their conditioning, loaded once (the first node run of a
    module pays the host's warm-up, about 2 s)."""
    distilled, _ = _load(comfy)
    base, _ = _load(comfy, M4B_BASE)
    return SimpleNamespace(distilled=distilled, base=base, cond=_encode(comfy, "a red door"),
                           cfg_cond=_encode(comfy, negative="blurry"))


class _Terminal(io.StringIO):
    """stderr as a terminal (``isatty()`` True), so a bar drawn only on terminals is drawn here too."""

    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> _Terminal:
    """sys.stderr replaced by a :class:`_Terminal` for the rest of the test (called in the test's body:
    pytest's own capture puts its stream back between a fixture's setup and the call)."""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def _segments(stderr: str) -> list[str]:
    """What a terminal shows of stderr, one entry per (re)drawn line: split at every \\r and \\n."""
    return [s for s in re.split(r"[\r\n]", stderr) if s.strip()]


def _bar_counts(stderr: str) -> list[str]:
    """The ``step/total`` of every ``denoising [...]`` redraw in stderr."""
    return [s.split("]", 1)[1].split()[0] for s in _segments(stderr) if s.startswith("denoising [")]


# ----- klein-generate's progress line ---------------------------------------------------------------


def test_cli_progress_line_fits_an_80_column_terminal_at_a_base_models_50_steps(monkeypatch):
    """Was a bug: klein-generate's progress line grows by one character per step. Input: the default run of a
    base model (50 steps: ``klein-generate --help`` "steps (default: 4 distilled, 50 base)") on a
    terminal of 80 columns (``COLUMNS=80``, what ``shutil.get_terminal_size()`` falls back to). Seen:
    ``\\rdenoising [###...###] 50/50  0.01 s/step   `` is 83-85 characters (the bar alone is 50; at
    ``--steps 1000``, which the CLI accepts, over 1000): the line wraps, and each ``\\r`` redraw only
    returns to the start of the last screen row, so the "one-line bar" (``_Progress``'s docstring)
    prints a new row per step, 50 rows of bar. Expected: every redraw fits the terminal's width (a bar
    of fixed width, as the training CLI's ``step N/M`` line and tqdm have). Cause: klein_core/cli.py:335
    ``bar = "#" * step + "-" * (total - step)``."""
    terminal = _terminal(monkeypatch)
    monkeypatch.setenv("COLUMNS", "80")
    columns = shutil.get_terminal_size().columns
    bar = cli._Progress(quiet=False)
    for step in range(1, 51):
        bar(step, 50, torch.zeros(1))
    lines = _segments(terminal.getvalue())
    assert len(lines) == 50 and lines[-1].startswith("denoising [") and "50/50" in lines[-1]
    too_long = [len(s) for s in lines if len(s) > columns]
    assert not too_long, f"{len(too_long)} of 50 redraws are wider than {columns} columns (up to {max(too_long)})"


def test_cli_error_during_denoising_is_not_glued_to_the_progress_line(tmp_path, monkeypatch):
    """Was a bug: an error raised during the denoising steps is printed on the end of the open progress line.
    Input: ``klein-generate --demo --steps 4`` whose second step runs out of memory (torch's
    OutOfMemoryError from the transformer, which the engine turns into its "Out of ... memory while
    denoising" message). Seen on stderr: ``\\rdenoising [#---] 1/4  0.73 s so far   error: Out of CPU
    memory while denoising; ...``: the error line does not start with ``error:``. Expected: it starts a
    line of its own (docs/cli.md: "every error is one line (`error: ...`)"), as the Ctrl-C path already
    does (cli.py:685 writes ``"\\ncancelled\\n"``), so a reader or a script looking for ``^error:`` finds
    it. Cause: klein_core/cli.py:676-680 write ``error: ...`` without ending the bar's line; ``_Progress``
    writes its newline only at the last step (cli.py:337). Fix: have ``_Progress`` remember that a line
    is open and end it (``\\n``) before any later stderr message, or write the errors with a leading
    ``\\n`` when a bar line is open."""
    terminal = _terminal(monkeypatch)
    real = sampling._velocity
    calls = []

    def velocity(job, latents, i):
        calls.append(i)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(job, latents, i)

    monkeypatch.setattr(sampling, "_velocity", velocity)
    rc = cli.main([*DEMO, "--steps", "4", "--out", str(tmp_path / "o.png")])
    err = terminal.getvalue()
    assert rc == 1 and "1/4" in err and "Out of CPU memory while denoising" in err, err
    lines = _segments(err)
    assert [s for s in lines if "error:" in s] == [s for s in lines if s.startswith("error:")], lines


def test_cli_step_cache_notice_counts_the_steps_that_run_with_an_image(tmp_path, monkeypatch):
    """Was a bug: with ``--image`` the step-cache notice counts steps that never run. Input: ``klein-generate
    --demo --steps 4 --image in.png --strength 0.5 --step-cache`` (a distilled model: docs/cli.md "a
    distilled model's few steps get a notice"). Seen: "--step-cache is meant for base models (20-50
    steps): of these 4 steps at most 1 can skip", then the progress line ``2/2`` and the summary "0 of 2
    forwards skipped": strength 0.5 runs 2 of the 4 steps (docs/inpaint.md, diffusers' rule), and with
    the step cache's 2 warm-up steps and its last step none of them can skip. Expected: the notice
    speaks of the steps that run ("of these 2 steps at most 0 can skip"), as the bar and the summary do.
    Cause: klein_core/cli.py:630 ``steps = args.steps or ...`` ignores ``--strength`` (and the default
    strength with ``--image``); use ``klein_core.pipeline.inpaint.steps_to_run(steps, strength)``."""
    terminal = _terminal(monkeypatch)
    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "in.png")
    rc = cli.main(["--demo", "--steps", "4", "--image", str(tmp_path / "in.png"), "--strength", "0.5",
                   "--step-cache", "--out", str(tmp_path / "o.png")])
    err = terminal.getvalue()
    assert rc == 0, err
    assert _bar_counts(err) == ["1/2", "2/2"], err  # 2 of the 4 steps ran
    assert "0 of 2 forwards skipped" in err, err
    notice = next(s for s in _segments(err) if s.startswith("--step-cache is meant for base models"))
    assert "of these 2 steps at most 0 can skip" in notice, notice


def test_pinned_cli_progress_line_counts_the_image_to_image_steps_and_ends_its_line(tmp_path, monkeypatch):
    """Pinned: klein-generate's bar with ``--image --strength 0.5`` at 4 steps counts the 2 steps that run
    (``1/2``, ``2/2``: the schedule's first int(4 - 4 x 0.5) = 2 steps are skipped), reaches its total,
    and ends its line before the result line."""
    terminal = _terminal(monkeypatch)
    Image.new("RGB", (64, 64), (200, 30, 10)).save(tmp_path / "in.png")
    rc = cli.main(["--demo", "--steps", "4", "--image", str(tmp_path / "in.png"), "--strength", "0.5",
                   "--out", str(tmp_path / "o.png")])
    err = terminal.getvalue()
    assert rc == 0, err
    assert _bar_counts(err) == ["1/2", "2/2"], err
    assert re.search(r"denoising \[[^]\r\n]*\] 2/2 [^\r\n]*\n", err), err  # the line ended after 2/2


# ----- Klein Sampler: progress bar --------------------------------------------------------------------


def test_pinned_cfg_batch_inpaint_bar_counts_the_steps_that_run_once(comfy, models, progress):  # noqa: F811
    """Pinned: on a base model with CFG (two passes per step), a batch of 2 and an inpainting latent at
    denoise 0.5 of 4 steps, ComfyUI's bar gets one update per step that runs, 1 of 2 and 2 of 2 (not
    one per CFG pass or per image, not 4 steps), and so reaches its total."""
    mask = torch.zeros(1, 64, 96)
    mask[:, :32] = 1
    _sample(comfy, models.base, models.cfg_cond, width=0, height=0, steps=4, guidance=3.0, batch_size=2,
            latent={"samples": torch.randn(1, 128, 4, 6)}, mask=mask, denoise=0.5)
    assert [(v, t) for v, t, _ in progress] == [(1, 2), (2, 2)]


def test_pinned_the_run_after_a_cancel_starts_its_bar_at_step_1_and_reaches_its_total(comfy, models, progress,  # noqa: F811
                                                                                        monkeypatch):
    """Pinned: a run cancelled at step 2 of 5 leaves its bar at 1 of 5; the next run (the same node, the
    model kept) reports 1..4 of 4 from its own start, not from where the cancelled bar stopped."""
    model, cond = models.distilled, models.cond
    real = comfy.mm.throw_exception_if_processing_interrupted
    calls = []

    def cancel_at_step_2():
        calls.append(1)
        if len(calls) == 2:
            raise comfy.mm.InterruptProcessingException()

    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", cancel_at_step_2)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _sample(comfy, model, cond, width=64, height=64, steps=5)
    assert [(v, t) for v, t, _ in progress] == [(1, 5)]
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", real)
    progress.clear()
    _sample(comfy, model, cond, width=64, height=64, steps=4)
    assert [(v, t) for v, t, _ in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]


# ----- Klein Sampler: previews ------------------------------------------------------------------------


def test_pinned_inpaint_preview_shows_the_kept_image_where_the_mask_is_black(comfy, models, progress,  # noqa: F811
                                                                             monkeypatch):
    """Pinned: while inpainting, the latents each step hands ComfyUI's previewer are batch item 0's
    estimate with the unmasked region taken from the image itself (as ComfyUI's own KSamplerX0Inpaint
    blends x0), so the preview never shows a re-imagined background; the masked region is the model's."""
    import latent_preview

    seen = []
    real = latent_preview.get_previewer

    def spy(device, latent_format):
        previewer = real(device, latent_format)
        decode = previewer.decode_latent_to_preview_image
        previewer.decode_latent_to_preview_image = lambda fmt, x0: seen.append(x0.clone()) or decode(fmt, x0)
        return previewer

    monkeypatch.setattr(latent_preview, "get_previewer", spy)
    monkeypatch.setattr(comfy.args.args, "preview_method", comfy.args.LatentPreviewMethod.Auto)
    image = torch.randn(2, 128, 4, 6)
    mask = torch.zeros(2, 64, 96)
    mask[0, :32] = 1  # item 0: top half repainted
    mask[1, :, :48] = 1  # item 1: left half
    _sample(comfy, models.distilled, models.cond, width=0, height=0, steps=3, batch_size=2,
            latent={"samples": image}, mask=mask)
    assert len(seen) == 3 and all(p is not None for _, _, p in progress)
    keep = comfy_mask_to_latents(mask[:1], 4, 6)[0, 0] == 0  # item 0's kept latent positions
    assert keep.any() and not keep.all()
    for x0 in seen:
        assert x0.shape == (1, 128, 4, 6)
        assert torch.equal(x0[0][:, keep], image[0][:, keep])  # the image itself, exactly
        assert not torch.equal(x0[0][:, ~keep], image[0][:, ~keep])


def test_pinned_own_preview_matches_comfyuis_latent2rgb_orientation_size_and_colour(comfy):  # noqa: F811
    """Pinned: the pack's own latent preview (used where the host has no FLUX.2 previewer) draws a
    non-square latent as ComfyUI's Latent2RGBPreviewer does for Flux2: the same size (2x the latent grid,
    width x height), orientation and colours (within 1 level: ComfyUI truncates, the pack rounds)."""
    import latent_preview
    from comfy.latent_formats import Flux2

    fmt = Flux2()
    theirs = latent_preview.Latent2RGBPreviewer(fmt.latent_rgb_factors, fmt.latent_rgb_factors_bias,
                                                fmt.latent_rgb_factors_reshape)
    x0 = torch.randn(2, 128, 3, 5, generator=torch.Generator().manual_seed(4)) * 3
    ours = comfy.preview.latent_preview(x0)
    _, want, _ = theirs.decode_latent_to_preview_image("JPEG", x0[:1])
    assert ours.size == want.size == (10, 6)
    a, b = np.asarray(ours, dtype=np.int16), np.asarray(want, dtype=np.int16)
    assert np.abs(a - b).max() <= 1
    assert a.std() > 10  # not a flat image: orientation and colour were really compared


# ----- Klein LoRA Trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_training(env):  # noqa: F811
    """A Klein LoRA Trainer run to its end with a checkpoint at its last step (steps 1, checkpoint_every
    1), and the progress updates it sent."""
    calls = []
    before = env.utils.PROGRESS_BAR_HOOK
    env.utils.PROGRESS_BAR_HOOK = lambda value, total, preview, node_id=None: calls.append((value, total))
    try:
        _train(env, lora_name="hunt_finished", steps=1, checkpoint_every=1)
    finally:
        env.utils.PROGRESS_BAR_HOOK = before
    yield calls
    (env.loras / "hunt_finished.safetensors").unlink(missing_ok=True)


def test_trainer_queued_again_after_its_last_checkpoint_draws_the_new_sample_prompts(env, finished_training):  # noqa: F811
    """Was a bug: the trainer node, queued again on a finished run's settings with new sample prompts, draws
    none of them. Input: Klein LoRA Trainer run to its end with a checkpoint at the last step (the
    defaults 1000 steps / checkpoint_every 250 do this; here steps 1, checkpoint_every 1), then queued
    again with only ``sample_prompts`` changed (two prompts). The sample inputs are left out of the run's
    settings key on purpose (docs/training.md: "`steps`, the sample inputs, `memory_mode` and `speed`
    are left out"; nodes/train.py run_key), so the second run resumes from checkpoint-1, its last
    step, and trains nothing. Seen: ``samples`` is the placeholder "no sample images were made" ([1, 64, 256, 3]), and
    ComfyUI's progress bar gets no update at all for the whole node. Expected: the new prompts drawn
    with the final LoRA, ``[2, 64, 64, 3]`` (the sample_every tooltip: "one image per prompt at every
    multiple of sample_every and always after the last step (the final LoRA)"). Cause:
    klein_core/train/trainer.py:336 ``Trainer.train`` runs its loop (and so ``_sample_due`` /
    ``sample_images`` and ``on_step``) only for steps still to run; after ``resume`` at the final step
    nothing samples. Fix: in ``run_job`` (klein_core/train/job.py:218-220), when the resumed state is at
    ``config.steps`` and sample prompts are given, call ``trainer.sample_images()`` (and report the
    step once, so the bar shows N of N)."""
    # the first run: the dataset's 3 images encoded, then one step tick, its total reached
    assert finished_training == [(1, 3), (2, 3), (3, 3), (1, 1)]
    calls = []
    before = env.utils.PROGRESS_BAR_HOOK
    env.utils.PROGRESS_BAR_HOOK = lambda value, total, preview, node_id=None: calls.append((value, total))
    try:
        out = _train(env, lora_name="hunt_finished", steps=1, checkpoint_every=1,
                     sample_prompts="a red dot\na blue line", sample_steps=1)
    finally:
        env.utils.PROGRESS_BAR_HOOK = before
    samples = out.args[2]
    assert samples.shape == (2, 64, 64, 3), (
        f"samples {list(samples.shape)} (progress updates {calls}): the new sample prompts were not drawn")


# ----- the training CLI's progress line -------------------------------------------------------------


def test_train_cli_error_during_training_is_not_glued_to_the_step_line(tmp_path, monkeypatch):
    """Was a bug: the training CLI prints a mid-run I/O error on the end of its open ``step N/M`` line. Input:
    ``python -m klein_core train ... --steps 2 --checkpoint-every 2`` whose checkpoint write at step 2
    fails with ENOSPC (a full disk). Seen: ``\\rstep 1/2  loss 1.55  17.16 it/s  ETA 00:00:00   error:
    [Errno 28] No space left on device``. Expected: the error on a line of its own starting with
    ``error:``, as the same function already does for a diverged run (klein_core/train/cli.py:226-227
    writes ``"\\nerror: ..."`` for FloatingPointError) and as docs/cli.md promises for the CLI ("every
    error is one line (`error: ...`)"). Cause: klein_core/train/cli.py:223-225 write ``error: ...`` for
    DatasetError / ValueError / OSError without the leading newline, though OSError can come mid-run
    (checkpoints, sample images)."""
    terminal = _terminal(monkeypatch)
    from klein_core.train import trainer
    from klein_core.train.cli import add_train_args, run_train

    paths, data = tiny_training_files(tmp_path)
    real = trainer.Trainer.save_checkpoint

    def save_checkpoint(self, path=None):
        if self.step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path)

    monkeypatch.setattr(trainer.Trainer, "save_checkpoint", save_checkpoint)
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    args = parser.parse_args([
        "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
        "--transformer", str(paths["klein_base_4b"]), "--output", str(tmp_path / "out" / "l.safetensors"),
        "--steps", "2", "--resolution", "32", "--rank", "2", "--device", "cpu", "--checkpoint-every", "2",
        "--cache-dir", str(tmp_path / "cache")])
    assert run_train(args) == 2
    err = terminal.getvalue()
    assert "step 1/2" in err and "No space left on device" in err, err
    lines = _segments(err)
    assert [s for s in lines if "error:" in s] == [s for s in lines if s.startswith("error:")], lines
