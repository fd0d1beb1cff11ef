"""What a run says: logs, warnings, progress text (hunt).

What is probed: what a demanding user reads while a run goes. A clean default run (``kc.generate``
with default options, ``klein-generate --demo``) logs no WARNING, raises no Python warning and prints
nothing outside the CLI's documented lines; the CLI's stderr handler and its ``-q`` flag (generate,
batch) do what docs/cli.md and docs/ray.md say, also when ``main`` runs more than once in a process;
each warning is said once per cause (not once per module of a LoRA, not once per internal pass over
a file), names the input it is about (the negative prompt is not "prompt 1"), is said on every run
where its cause holds (also when the prompt comes from the prompt cache), and no INFO line claims
what did not happen (a CUDA graph on the CPU).

Sub-areas probed without a defect found: no Python warning (torch, PIL, numpy) from the default
Python, CLI (text to image, references, inpaint, image to image, base + step cache) runs; library
code prints nothing (every line on stdout/stderr comes from the CLIs); every logger is named by its
module under "klein_core" or the pack's package; the fast-path INFO line is logged once per model and
device; the size / guidance / unused-negative / 5-references warnings are said once per run, also
with a batch; the node chain (loader in fp32, encoder, sampler, decode, run twice) returns no
``"warnings"`` and prints nothing (probed, not pinned here: the ComfyUI host's warm-up would double
this file's time), and the node warnings collector (nodes/notices.py) keeps each WARNING of the
node's thread once (tested in test_nodes_host.py); repeated ``cli.main`` runs keep one stderr
handler; the process-once notices (page-locked memory, staging) are guarded. Borderline, not filed: an fp8 matmul
failure (klein_core/quant/fp8.py ``FP8Linear.forward``) warns once per layer by design (its comment
says so), where the NVFP4 layer warns once per distinct failure.

Each ``Was a bug:`` test failed on the code it was written against because of the defect it names (fixed since); each
``Pinned:`` test holds behaviour that already works and is not tested elsewhere. Tiny random models
on the CPU in float32, 64x64 images, one or two steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import klein_core as kc
from klein_core import cli
from klein_core.accel.speed import apply_speed
from klein_core.distributed import batch as batch_module
from klein_core.distributed import ray_support
from klein_core.distributed.batch import Summary
from klein_core.distributed.models import ModelSpec, open_engine
from klein_core.lora import load_lora
from klein_core.pipeline.prompts import PromptCache
from klein_core.testing import write_tiny_model_files
from klein_core.testing.tiny import build_tiny_components

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["--width", "64", "--height", "64", "--steps", "1"]
LONG = "fox " * 700  # 713 tokens after the chat template: 201 cut at 512


@pytest.fixture(autouse=True)
def _cli_handlers_removed():
    """``cli.main`` hooks klein_core's warnings to a stderr handler (see the test below): none is
    left from another module before a test, and none after it."""
    root = logging.getLogger("klein_core")

    def drop() -> None:
        for handler in [h for h in root.handlers if getattr(h, "_klein_cli", False)]:
            root.removeHandler(handler)

    drop()
    yield
    drop()


@pytest.fixture(scope="module")
def tiny():
    return tuple(m.float() for m in build_tiny_components())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("logging_models")
    return root, write_tiny_model_files(root, dtype=torch.float32)


def _messages(caplog, logger: str = "klein_core", level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(logger) and r.levelno >= level]


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``cli.main(argv)`` with stdout and stderr captured (as a caller redirecting them would)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# Clean default runs


def test_pinned_default_python_and_cli_runs_log_no_warning_and_print_only_their_lines(tiny, tmp_path, caplog,
                                                                                     capsys):
    """Pinned: ``kc.generate`` with default options logs no WARNING, raises no Python warning and prints
    nothing; ``klein-generate --demo`` (no ``-q``) logs no WARNING and raises no Python warning, writes
    exactly the result line on stdout and on stderr only the ``--demo`` note, the progress bar and the
    ``speed`` line (docs/cli.md, Output); a second ``main`` in the process keeps one stderr handler."""
    tr, te, vae = tiny
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="klein_core"):
        warnings.simplefilter("always")
        kc.generate(tr, te, vae, prompt="a red fox", width=64, height=64, steps=1)
    assert (_messages(caplog), [str(w.message) for w in caught]) == ([], [])
    printed = capsys.readouterr()
    assert (printed.out, printed.err) == ("", "")

    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="klein_core"):
        warnings.simplefilter("always")
        rc, out, err = _run_cli(["--demo", *SMALL, "--out", str(tmp_path / "demo.png")])
        rc2, _, _ = _run_cli(["--demo", *SMALL, "--out", str(tmp_path / "demo2.png"), "-q"])
    assert (rc, rc2, _messages(caplog), [str(w.message) for w in caught]) == (0, 0, [], [])
    assert out.count("\n") == 1 and out.startswith("1 image(s) 64x64") and "demo.png" in out
    lines = [ln for ln in err.replace("\r", "\n").split("\n") if ln.strip()]
    assert lines[0].startswith("--demo: tiny random models") and lines[-1].startswith("speed fast (cpu"), err
    assert all(ln.startswith(("--demo:", "denoising [", "speed ")) for ln in lines), err
    handlers = [h for h in logging.getLogger("klein_core").handlers if getattr(h, "_klein_cli", False)]
    assert len(handlers) == 1


# ---------------------------------------------------------------------------------------------
# The CLI's stderr handler and -q


def test_cli_warnings_go_to_the_stderr_of_the_run_that_logs_them(tmp_path):
    """Was a bug: klein_core/cli.py ``log_to_stderr`` builds its ``_StderrHandler(sys.stderr)`` once, at the
    first ``main`` of the process, bound to the ``sys.stderr`` object of that moment, and later calls
    keep it (they only check that a handler exists). So a program that runs ``klein_core.cli.main``
    twice with stderr redirected (``contextlib.redirect_stderr``, a notebook cell, pytest's capture)
    gets the second run's ``WARNING: ...`` lines (here "Size 72x72 is not a multiple of 16") written
    into the first run's stream, while its ``error:`` lines and progress bar go to the current
    stderr; a closed first stream gives a "--- Logging error ---" traceback instead. Three test modules
    remove the handler after each test to work around it. Expected: warnings go to the stderr of the
    moment, like every other line of the CLI. Fix: a handler that looks ``sys.stderr`` up when it
    emits (a ``stream`` property returning ``sys.stderr``, as ``logging.lastResort`` does)."""
    rc1, _, first = _run_cli(["--demo", *SMALL, "--out", str(tmp_path / "a.png"), "-q"])
    rc2, _, second = _run_cli(["--demo", "--width", "72", "--height", "72", "--steps", "1",
                               "--out", str(tmp_path / "b.png"), "-q"])
    assert (rc1, rc2) == (0, 0)
    assert "WARNING: Size 72x72 is not a multiple of 16" in second, (
        f"the second run's warning went elsewhere; its stderr: {second!r}; the first run's: {first!r}")


def test_batch_quiet_writes_only_the_summary_line_on_stdout(tmp_path, monkeypatch):
    """Was a bug: klein_core/distributed/cli.py ``run_batch`` writes its summary to stdout as
    ``"\\n{N} image(s), ..."``: the leading newline is meant to end the progress line, which is on
    stderr. So stdout (what a script reads, or ``> summary.txt``) starts with an empty line, also with
    ``-q`` ("no progress lines", where there is no progress line to end), and with stdout redirected
    the terminal's progress line is never ended. docs/ray.md: progress on stderr, "then a summary
    line". Expected: stdout holds exactly the summary line; the progress line is ended on stderr
    (as klein-generate does: ``write_line(sys.stderr, "\\n")`` when the bar is open). Ray is not
    started here: ``require_ray`` / ``init_ray`` and the job itself are stood in for."""
    monkeypatch.setattr(ray_support, "require_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray_support, "init_ray", lambda *a, **k: None)

    def job(config, progress=None):
        if progress is not None:
            progress(1, 1, 0, 0.5)
        return Summary(rows=1, generated=1, seconds=0.5, per_worker={"worker-0": 1})

    monkeypatch.setattr(batch_module, "run_batch_job", job)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "a fox"}) + "\n")
    argv = ["batch", str(rows), "--out", str(tmp_path / "out"), "--demo", "--device", "cpu", "--workers", "1"]
    said = [_run_cli([*argv, *quiet]) for quiet in (["-q"], [])]
    assert [rc for rc, _, _ in said] == [0, 0]
    assert [out.split("\n") for _, out, _ in said] == [[out.strip(), ""] for _, out, _ in said], (
        f"stdout: {[out for _, out, _ in said]!r}")


# ---------------------------------------------------------------------------------------------
# Warnings: said when their cause holds, naming the input, once per cause


def test_a_prompt_cut_at_512_tokens_is_warned_also_when_its_embedding_comes_from_the_prompt_cache(files, tmp_path,
                                                                                                caplog):
    """Was a bug: ``klein-generate ... --prompt-cache DIR`` with a prompt over 512 tokens warns that it was cut
    on the first run only. The next run (a new process, or here a second ``main``) finds the embedding
    in DIR through ``Engine.cached_prompts`` -> ``PromptCache.cached`` (klein_core/pipeline/prompts.py),
    which never checks the prompt's length (``PromptCache.encode`` does: "cached or not, a cut prompt
    is said"), so the run cuts 201 tokens without a word. The same holds for ``Engine.encode_prompts``
    with a text encoder loaded from a file, whose second call with the same prompt is served by
    ``cached``. docs/troubleshooting.md: "prompt longer than 512 tokens | runs; a warning ... says how
    many tokens were cut". Expected: one warning on every run that cuts. Fix: ``PromptCache.cached``
    (or ``Engine.encode_prompts`` / ``cached_prompts``) warns as ``encode`` does when it returns
    embeddings of cut prompts."""
    root, _ = files
    argv = ["--models-dir", str(root), "--model", "flux-2-klein-4b.safetensors", "--prompt", LONG, *SMALL,
            "--dtype", "fp32", "--prompt-cache", str(tmp_path / "prompts"), "-q"]
    said = []
    for run in ("first", "second"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="klein_core"):
            rc, _, err = _run_cli([*argv, "--out", str(tmp_path / f"{run}.png")])
        assert rc == 0, err
        said.append([m for m in _messages(caplog) if "713 tokens" in m])
    assert [len(s) for s in said] == [1, 1], f"cut warnings per run: {said}"


def test_a_negative_prompt_cut_at_512_tokens_is_named_as_the_negative_prompt(tiny, caplog):
    """Was a bug: a base-model run (``kc.generate(..., kind="base", guidance=4, negative_prompt=<713 tokens>)``,
    or ``klein-generate --base --negative-prompt ...``) whose negative prompt is cut at 512 tokens warns
    "prompt 1 is 713 tokens after the chat template; truncated to max_length=512 ...": the index of the
    negative prompt in the internal list ``Engine._text_groups`` builds (the prompts, then the
    negative), which the user never wrote. They gave one prompt (which the message calls "prompt 0")
    and a negative prompt, so "prompt 1" names an input that does not exist and hides which text lost
    its end. Expected: the warning names the negative prompt (as the encoder node does: "negative_prompt
    is 713 tokens"). Fix: ``PromptCache.encode`` / ``warn_cut`` (klein_core/pipeline/tokenizer.py) take a
    label per text, and ``Engine.encode_prompts`` passes "negative prompt" for the negative."""
    tr, te, vae = tiny
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        kc.generate(tr, te, vae, prompt="a red fox", negative_prompt=LONG, kind="base", guidance=4.0,
                    width=64, height=64, steps=1, cache=None)
    cut = [m for m in _messages(caplog) if "512" in m and "tokens" in m]
    assert len(cut) == 1 and "negative prompt" in cut[0], cut


def test_a_lora_whose_metadata_rank_differs_from_its_tensors_is_warned_once_per_file(tmp_path, caplog):
    """Was a bug: ``load_lora`` of a diffusers/PEFT LoRA whose ``lora_adapter_metadata`` says ``r`` 4 while its
    factors have rank 2 (a LoRA resized by a tool that kept the metadata) logs one WARNING per module
    (klein_core/lora/read.py ``_build_patch``: "metadata gives rank 4 for '<module>', the tensors have
    2; using 2"): four here, one per adapted linear of a real LoRA (hundreds), each with its own text,
    so the ComfyUI node shows every one. The cause is one (the file's metadata) and so is the fix.
    Keys that are not applied are grouped into one line per LoRA (``log_skipped``); this is not.
    Expected: one warning per file, naming the modules' count (and a few of them). Fix: collect the
    mismatches in ``_build_patch`` and log them once in ``load_lora``, as ``log_skipped`` does."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for module in ("to_q", "to_k", "to_v", "to_out.0"):
        tensors[f"transformer.transformer_blocks.0.attn.{module}.lora_A.weight"] = torch.randn(2, 64, generator=g)
        tensors[f"transformer.transformer_blocks.0.attn.{module}.lora_B.weight"] = torch.randn(64, 2, generator=g)
    path = tmp_path / "resized.safetensors"
    save_file(tensors, str(path), metadata={
        "lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 4.0})})
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        lora = load_lora(path)
    assert len(lora.patches) == 4  # every module is used (at the tensors' rank)
    said = _messages(caplog, "klein_core.lora")
    assert len(said) == 1, f"{len(said)} warnings for one cause: {said}"


def test_a_file_warning_is_said_once_per_load_not_once_more_for_the_memory_estimate(files, tmp_path, caplog):
    """Was a bug: a worker's model load (klein_core/distributed/models.py ``open_engine``, what every
    ``batch`` actor and ``serve`` replica runs) of an all-in-one checkpoint (the transformer under
    ``model.diffusion_model.`` plus a bundled VAE tensor) logs "ignoring 1 tensors outside the
    transformer prefix" twice, and "Loaded Flux2 ... transformer from <file>" twice: once for the
    ``meta_model`` built to plan memory (klein_core/files/loaders.py ``meta_model`` runs the whole
    ``load_transformer`` on the meta device, with every log line of a real load although nothing is
    read), once for the load. The nodes do the same (nodes/cache.py ``weight_bytes`` before every
    load; on a GPU also nodes/loaders.py ``transformer_home``: three times), so ComfyUI's console shows
    each file warning two or three times per load (the node's own list drops the repeat). Expected:
    one warning and one "Loaded" line per load. Fix: ``meta_model`` builds quietly (the file's
    layout and load lines logged at DEBUG on the meta device, or suppressed while it runs)."""
    _, paths = files
    state = {"model.diffusion_model." + k: v for k, v in load_file(str(paths["klein_4b"])).items()}
    state["vae.decoder.conv_in.weight"] = torch.zeros(4)  # the bundled part the transformer ignores
    aio = tmp_path / "flux-2-klein-4b-all-in-one.safetensors"
    save_file(state, str(aio))
    spec = ModelSpec(aio, paths["qwen_4b"], paths["vae"], device="cpu", dtype="fp32")
    with caplog.at_level(logging.INFO, logger="klein_core"):
        open_engine(spec)
    ignored = [m for m in _messages(caplog) if "outside the transformer prefix" in m]
    loaded = [m for m in _messages(caplog, level=logging.INFO) if m.startswith("Loaded") and "transformer" in m]
    assert (len(ignored), len(loaded)) == (1, 1), f"warnings: {ignored}; load lines: {loaded}"


# ---------------------------------------------------------------------------------------------
# INFO lines say what happened


def test_review_the_memory_estimates_lines_stay_quiet_under_a_root_handler_at_notset(files):
    """Was a bug (review): the estimate's records were relabelled DEBUG but still emitted, so a host
    whose root handler has no level (ComfyUI's, at NOTSET, with the root logger at INFO) printed them
    as before. They are dropped unless DEBUG is on for their logger."""
    _, paths = files
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root, handler, level = logging.getLogger(), Keep(logging.NOTSET), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        from klein_core.files.loaders import meta_model

        meta_model(paths["klein_4b"], "transformer")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert [r.getMessage() for r in seen if r.name.startswith("klein_core.files")] == []


def test_the_fast_text_encoder_on_the_cpu_does_not_say_it_replays_cuda_graphs(files, caplog):
    """Was a bug: ``speed="fast"`` (the CLI's and the nodes' default; ``apply_speed`` / ``Engine(speed=)``) on a
    text encoder on the CPU logs "text encoder: CUDA graph replay of the plain forward enabled" at INFO
    (klein_core/accel/text_encoder.py ``enable_fast_text_encoder``, logged when the wrapper is
    installed, whatever the device), although nothing is recorded or replayed there: the wrapper runs
    the plain forward off CUDA, and docs/speed.md says "On the CPU ``fast`` is exactly the plain path".
    Every CPU run of ``klein-generate`` and every encoder node run on a CPU/MPS machine says it (the
    transformer's line, logged at its first forward, says "attention=plain ... on cpu"). Expected: no
    claim of CUDA graphs where none runs. Fix: log it when the first graph of a device is recorded (or
    name the device and log it only for a CUDA encoder)."""
    _, paths = files
    te = kc.load_text_encoder(paths["qwen_4b"], device="cpu", dtype="fp32")
    with caplog.at_level(logging.INFO, logger="klein_core"):
        apply_speed(text_encoder=te, speed="fast")
        kc.Engine(text_encoder=te, prompt_cache=PromptCache()).encode_prompts(["a red fox"])
    claims = [m for m in _messages(caplog, level=logging.INFO) if "CUDA graph" in m]
    assert claims == [], claims
