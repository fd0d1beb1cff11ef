"""What the docs promise a newcomer who follows them literally, against what the code does.

README.md, docs/cli.md, docs/troubleshooting.md, docs/memory.md, docs/kv.md, docs/api.md and
docs/python.md: flags, defaults, quoted messages, signatures. The python blocks of the docs are run by
tests/test_docs_snippets.py and the public names by tests/test_public_api.py; this file checks the
prose and the tables. A test whose docstring starts with "Was a bug" (or "Was a doc bug") showed a
mismatch, since mended in the code (or the doc); the others pin a documented claim that no other
test checked.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import klein_core as kc
from klein_core import cli
from klein_core.testing import write_tiny_model_files

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--width", "64", "--height", "64", "--steps", "1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return d, write_tiny_model_files(d)


@pytest.fixture(scope="module")
def tiny(models):
    _, p = models
    return (kc.load_transformer(p["klein_4b"], device="cpu", dtype="fp32"),
            kc.load_text_encoder(p["qwen_4b"], device="cpu", dtype="fp32"),
            kc.load_vae(p["vae"], device="cpu", dtype="fp32"))


@pytest.fixture(autouse=True)
def _cli_log_handler_removed():
    """cli.main adds a stderr handler to the "klein_core" logger, bound to the stream of the test that made
    it (capsys's); removed after each test so a later test's warnings are not written to a closed stream."""
    yield
    root = logging.getLogger("klein_core")
    for handler in [h for h in root.handlers if getattr(h, "_klein_cli", False)]:
        root.removeHandler(handler)


def _files(p, transformer="klein_4b", encoder="qwen_4b"):
    return ["--transformer", str(p[transformer]), "--text-encoder", str(p[encoder]), "--vae", str(p["vae"])]


def _params(path: Path) -> dict:
    with Image.open(path) as img:
        return json.loads(img.text["parameters"])


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def _doc(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _no_model_loads(monkeypatch):
    import klein_core.files.loaders as loading

    def never(*a, **k):
        raise AssertionError("a model was loaded before the request was refused")

    for name in ("load_transformer", "load_text_encoder", "load_vae"):
        monkeypatch.setattr(loading, name, never)


# ---------------------------------------------------------------------------------------------
# docs/cli.md


def test_an_overflow_in_the_cli_is_one_line_not_a_traceback(tmp_path, capsys):
    """Was a bug: docs/cli.md:39-40 says "Sizes, steps, seed and device are checked before any model loads, and
    every error is one line", and docs/troubleshooting.md:36 lists, for "numbers that overflow without
    bad weights", the message "The sampler produced NaN/Inf values ...". In the CLI that message is a
    FloatingPointError, which ``cli.main`` does not catch (it catches CLIError, ValueError, TypeError,
    FileNotFoundError, WeightFormatError): ``--base --guidance 1e38`` (a finite guidance >= 0, so it
    passes the CLI's check) ends in a 20-line traceback and exit code 1. Fix the code: catch
    FloatingPointError (and KleinOutOfMemory, the same path) in ``main`` and print ``error: ...``."""
    args = ["--demo", "--base", *SMALL[:4], "--steps", "2", "--prompt", "a", "--negative-prompt", "b",
            "--guidance", "1e38", "--out", str(tmp_path / "o.png"), "-q"]
    try:
        rc = cli.main(args)
    except FloatingPointError as exc:
        pytest.fail(f"klein-generate ends in a traceback, not one line: FloatingPointError: {exc}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and err[-1].startswith("error: The sampler produced NaN/Inf values"), err


@pytest.mark.parametrize("ext", ["xbm", "grib"])
def test_an_out_extension_pil_cannot_write_is_refused_before_any_model_loads(models, tmp_path, monkeypatch,
                                                                              capsys, ext):
    """Was a bug: docs/cli.md:27-29: "`--out` ... the extension picks the format ... a folder, an extension PIL
    cannot write or a path under a file is refused before any model loads". ``check_out`` only asks
    whether PIL has a save handler registered for the extension: ``.xbm`` (PIL writes only 1-bit XBM) and
    ``.grib`` (a stub whose handler is not installed) pass, every model loads, the image is generated,
    and only then "--out o.xbm: cannot write it (cannot write mode RGB as XBM)": the generation is lost,
    which the check exists to prevent. Fix the code: in ``check_out``, save a 1x1 RGB image in that format
    to a BytesIO and refuse the extension when that raises."""
    _, p = models
    _no_model_loads(monkeypatch)
    rc = cli.main([*_files(p), *SMALL, "--out", str(tmp_path / f"o.{ext}"), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --out") and err.count("\n") == 0, err


def test_quiet_hides_the_progress_bar_and_the_notes_not_the_warnings(tmp_path, capsys):
    """Was a doc bug: docs/cli.md said "`-q` / `--quiet` hides the progress bar", but -q also hides the
    speed line, the summary, the step-cache summary and the distilled model's notice. The doc (and
    ``--help``) now say so; warnings still show under -q."""
    run = ["--demo", *SMALL[:4], "--steps", "2", "--step-cache", "--guidance", "3"]
    notes = (("the speed that ran", "speed fast"), ("the step-cache summary", "step cache"),
             ("the distilled model's notice", "--step-cache is meant for base models"))
    assert cli.main([*run, "--out", str(tmp_path / "loud.png")]) == 0
    loud = capsys.readouterr().err
    assert [what for what, text in notes if text not in loud] == [], loud
    assert cli.main([*run, "--out", str(tmp_path / "q.png"), "-q"]) == 0
    quiet = capsys.readouterr().err
    assert [what for what, text in notes if text in quiet] == [], quiet
    assert "guidance 3.00 is ignored" in quiet  # a warning: shown under -q too
    assert "`--quiet` hides the progress bar and the notes on stderr" in " ".join(_doc("docs/cli.md").split())


def test_an_out_folder_with_a_trailing_separator_is_refused_in_one_line(tmp_path, capsys):
    """Was a bug: docs/cli.md:28-29 "a folder ... is refused before any model loads" and docs/cli.md:40 "every
    error is one line". ``--out existing_folder`` gave one line, but ``--out new_folder/`` was refused by
    argparse's ``type=``: the whole 18-line usage, then "klein-generate: error: argument --out: ... is a
    folder". ``check_out`` now refuses the trailing separator too, in the CLI's one line."""
    rc = cli.main(["--demo", "--out", str(tmp_path / "renders") + "/"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --out") and "is a folder" in err
    assert err.count("\n") == 0, f"{err.count(chr(10)) + 1} lines:\n{err}"


def test_a_kv_file_keeps_kv_references_under_distilled_unless_ref_mode_says(models, tmp_path):
    """Was a doc bug: docs/cli.md said "`--base`/`--distilled` and `--ref-mode` override the guess", but on
    flux-2-klein-9b-kv.safetensors ``--distilled`` changes nothing (the code lets it undo only a "base"
    guess, on purpose: a KV file's references run as stored keys/values). The doc now says so; this pins
    both: --distilled keeps KV, --ref-mode joint runs them jointly."""
    _, p = models
    ref = tmp_path / "r.png"
    Image.new("RGB", (64, 64), (90, 20, 10)).save(ref)
    base = [*_files(p, "klein_9b_kv", "qwen_8b"), "--ref", str(ref), "--steps", "1", "-q"]
    assert cli.main([*base, "--distilled", "--out", str(tmp_path / "kv.png")]) == 0
    assert _params(tmp_path / "kv.png")["ref_mode"] == "kv"
    assert cli.main([*base, "--ref-mode", "joint", "--out", str(tmp_path / "joint.png")]) == 0
    assert _params(tmp_path / "joint.png")["ref_mode"] == "joint"
    assert "a 9B-KV file keeps its KV references unless `--ref-mode`" in " ".join(_doc("docs/cli.md").split())


def test_demo_does_not_record_a_quantisation_that_did_not_run(models, tmp_path):
    """Was a bug: docs/cli.md:40-42: "PNGs carry the parameters in their `parameters` text chunk (JSON:
    everything that changed the pixels, resolved: ... `dtype`, `quantize` ...)" and docs/cli.md:54-55:
    "`--demo` builds tiny random models in memory instead of reading files (it checks an install ...)".
    ``--demo --quantize q4`` never quantises the demo transformer: the pixels are byte-identical to a run
    without --quantize, yet the PNG records "quantize": "q4" (and the install check passes for a path
    that never ran), while the same tiny transformer read from a file does change with --quantize q4.
    Fix the code: quantise the demo transformer as a loaded one would be (or refuse
    --quantize with --demo)."""
    _, p = models
    run = [*SMALL[:4], "--steps", "2", "--prompt", "a fox", "-q"]
    # The same tiny transformer read from a file: --quantize q4 does change its pixels at this size.
    files = [tmp_path / f"file{i}.png" for i in range(2)]
    assert cli.main([*_files(p), *run, "--out", str(files[0])]) == 0
    assert cli.main([*_files(p), *run, "--quantize", "q4", "--out", str(files[1])]) == 0
    assert not np.array_equal(_pixels(files[0]), _pixels(files[1]))
    plain, asked = tmp_path / "plain.png", tmp_path / "q4.png"
    assert cli.main(["--demo", *run, "--out", str(plain)]) == 0
    rc = cli.main(["--demo", *run, "--quantize", "q4", "--out", str(asked)])
    if rc == 0:
        same = np.array_equal(_pixels(plain), _pixels(asked))
        assert not (_params(asked)["quantize"] == "q4" and same), \
            "the PNG says quantize q4, but the pixels are those of the unquantised demo model"


def test_model_without_models_dir_is_refused_also_with_demo(tmp_path, capsys):
    """Was a bug: docs/cli.md:20-21: "`--model` without `--models-dir`, or together with `--transformer`, is
    refused." With --demo, ``--model flux-2-klein-9b.safetensors`` (and ``--transformer``, ``--models-dir``)
    are ignored without a word and the 4B-shaped demo model runs; the code's own comment in
    ``resolve_files`` says that was the bug the refusal fixed ("it used to be ignored without a word, and
    another transformer than the one asked for ran"). Fix the code: refuse model-file flags with --demo
    (one line, exit 2)."""
    rc = cli.main(["--demo", "--model", "flux-2-klein-9b.safetensors", *SMALL, "--out", str(tmp_path / "o.png"),
                   "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "--model" in err, (rc, err)


def test_the_seed_range_is_0_to_2_64_minus_1(tmp_path, capsys):
    """docs/cli.md:26: "`--seed` (0..2^64-1, default 0)": the largest seed runs and is recorded exactly in
    the PNG; one more is refused in one line before anything is built."""
    out = tmp_path / "s.png"
    assert cli.main(["--demo", *SMALL, "--seed", str(2**64 - 1), "--out", str(out), "-q"]) == 0
    assert _params(out)["seed"] == 2**64 - 1
    capsys.readouterr()
    assert cli.main(["--demo", *SMALL, "--seed", str(2**64), "--out", str(out), "-q"]) == 2
    assert capsys.readouterr().err == f"error: --seed must be from 0 to 2^64-1, got {2**64}\n"


def test_the_prompt_cache_is_not_used_with_a_lora(models, tmp_path, capsys):
    """docs/cli.md:37-38: "`--prompt-cache DIR` (prompt embeddings kept in DIR ...; not used with a
    `--lora`, which may change the encoder)": a run with a LoRA writes nothing into DIR, and a second
    identical run loads the text encoder again (no "not loaded" note)."""
    from train_files import nonzero_lora

    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    _, p = models
    lora = save_lora(tmp_path / "style.safetensors",
                     nonzero_lora(kc.load_transformer(p["klein_4b"], device="cpu", dtype="fp32"), preset("full", rank=2)),
                     fmt="comfyui")
    cache = tmp_path / "cache"
    args = [*_files(p), *SMALL, "--prompt", "a fox", "--lora", str(lora), "--prompt-cache", str(cache),
            "--out", str(tmp_path / "l.png")]
    for _ in range(2):
        assert cli.main(args) == 0
        assert "not loaded" not in capsys.readouterr().err
    assert not cache.exists() or not any(cache.iterdir())
    # and without the LoRA the cache is used: the second run does not load the encoder
    plain = [a for a in args if a not in ("--lora", str(lora))]
    for _ in range(2):
        assert cli.main(plain) == 0
    assert "not loaded" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# docs/troubleshooting.md


def test_leaving_the_size_out_takes_the_first_references_size(tmp_path, capsys):
    """Was a doc bug: docs/troubleshooting.md (for ComfyUI, the CLI and Python alike) said "lower the size
    (0 = first reference's size)"; only the ComfyUI sampler reads 0 that way, and ``--width 0`` is
    refused ("Output size 0x0 is too small"). The doc now says to leave width and height out in the CLI
    and Python: that takes the reference's size."""
    ref = tmp_path / "ref.png"
    Image.new("RGB", (96, 64), (10, 120, 30)).save(ref)
    out = tmp_path / "o.png"
    assert cli.main(["--demo", "--ref", str(ref), "--steps", "1", "--out", str(out), "-q"]) == 0
    assert Image.open(out).size == (96, 64)
    assert cli.main(["--demo", "--ref", str(ref), "--width", "0", "--height", "0", "--steps", "1", "--out",
                     str(out), "-q"]) == 2
    assert "too small" in capsys.readouterr().err
    assert "in the CLI and Python, leave width and height out" in _doc("docs/troubleshooting.md")


def test_the_quoted_size_and_distilled_messages_are_what_users_get(tiny, caplog):
    """docs/troubleshooting.md:21 quotes the refusal of a size over 4 MP ("Output size 4096x2048 is 8.4
    megapixels; FLUX.2 Klein supports at most 4 megapixels"), :23 says guidance / a negative prompt on a
    distilled model "runs without CFG; a warning says they are not used", :25 says more than 4
    references "runs; a warning (Klein is published for up to 4)". The quote is read from the doc."""
    tr, te, vae = tiny
    row = next(line for line in _doc("docs/troubleshooting.md").splitlines() if line.startswith("| size under 64 px"))
    quoted = re.search(r'refused: "([^"]+)"', row).group(1)
    with pytest.raises(ValueError) as refused:
        kc.generate(tr, te, vae, prompt="x", width=4096, height=2048, steps=1)
    assert quoted in str(refused.value), (quoted, str(refused.value))

    small = {"prompt": "x", "width": 64, "height": 64, "steps": 1, "cache": None}
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        plain = kc.generate(tr, te, vae, output="latent", **small)
        caplog.clear()
        guided = kc.generate(tr, te, vae, guidance=3.0, negative_prompt="blurry", output="latent", **small)
        notes = " | ".join(r.getMessage() for r in caplog.records)
    assert torch.equal(plain.latents, guided.latents)  # runs without CFG
    assert "guidance 3.00 is ignored" in notes and "the negative prompt is not used" in notes, notes
    ref = Image.new("RGB", (64, 64), (120, 60, 30))
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        caplog.clear()
        five = kc.generate(tr, te, vae, references=[ref] * 5, **small)
        notes = " | ".join(r.getMessage() for r in caplog.records)
    assert len(five.images) == 1 and "5 references: Klein is published for at most 4" in notes, notes


# ---------------------------------------------------------------------------------------------
# docs/api.md and docs/python.md


def test_the_result_says_the_guidance_that_ran(tiny):
    """Was a bug: docs/api.md:34: "`GenerationResult` ...: `images` (PIL), `latents` ..., the size, steps,
    guidance and seed that ran". On a distilled model ``generate(guidance=3.0)`` warns "guidance 3.00 is
    ignored" and gives latents equal to guidance 1's, but ``result.guidance`` is 3.0 (and the CLI's PNG
    records "guidance": 3.0 among "everything that changed the pixels, resolved", docs/cli.md:41).
    Fix the code: report 1.0 (no CFG) as the guidance that ran, as ``Resolved.cfg`` already knows; or fix
    the doc to say "as requested"."""
    tr, te, vae = tiny
    kw = {"prompt": "x", "width": 64, "height": 64, "steps": 2, "output": "latent", "cache": None}
    one = kc.generate(tr, te, vae, **kw)
    three = kc.generate(tr, te, vae, guidance=3.0, **kw)
    assert torch.equal(one.latents, three.latents)
    assert three.guidance == one.guidance == 1.0, three.guidance


_ARG = re.compile(r"^(\*|\.\.\.|[A-Za-z_]\w*(=.+)?)$")


def _documented_calls() -> list[tuple[str, list[str]]]:
    """(name, arguments) of each `name(args)` heading a row of docs/api.md's tables for a public name,
    where the arguments are parameter names (not an example such as `[(lora, strength), ...]`)."""
    calls = []
    for name, args in re.findall(r"^\| `(\w+)\(([^`]*)\)` \|", _doc("docs/api.md"), re.MULTILINE):
        parts = [a.strip() for a in args.split(",")]
        if name in kc.__all__ and all(_ARG.match(a) for a in parts):
            calls.append((name, parts))
    return calls


def test_the_api_tables_signatures_are_the_code_s():
    """docs/api.md's tables give each callable as `name(params)` ("`load_transformer(source, *, device,
    dtype, quantize)`", "`Engine(transformer, text_encoder, vae, *, kind, device, memory, vae_tile, ...,
    make_room, check_cancel)`", "`TextOptions(max_tokens=512, activations=None, trim=None)`"...): each
    parameter exists under that name, in that order, keyword-only after `*` (positional before it), with
    the default given; parameters the doc leaves out have defaults, so a call as documented works. Also
    docs/memory.md:11 "`memory="auto"`, the default" and :81 "`vae_tile="auto"` (the default)"."""
    calls = _documented_calls()
    assert {"load_transformer", "load_text_encoder", "load_vae", "generate", "Engine", "TextOptions"} <= \
        {n for n, _ in calls}, calls
    for name, parts in calls:
        params = [p for p in inspect.signature(getattr(kc, name)).parameters.values() if p.name != "self"]
        by_name = {p.name: p for p in params}
        keyword_only = False
        last = -1
        for part in parts:
            if part == "*":
                keyword_only = True
                continue
            if part == "...":
                continue
            pname, _, default = part.partition("=")
            assert pname in by_name, f"docs/api.md: {name}({', '.join(parts)}): no parameter {pname!r}"
            param = by_name[pname]
            assert params.index(param) > last, f"{name}: {pname} out of order"
            last = params.index(param)
            if keyword_only:
                assert param.kind is param.KEYWORD_ONLY, f"{name}: {pname} is not keyword-only"
            else:
                assert param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD), f"{name}: {pname}"
            if default:
                assert param.default == ast.literal_eval(default), f"{name}: {pname}={param.default!r}"
        named = {p.partition("=")[0] for p in parts}
        for param in params:
            if param.name not in named and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                assert param.default is not param.empty, f"{name}: {param.name} is required but not documented"
    for f in (kc.generate, kc.Engine):
        sig = inspect.signature(f)
        assert sig.parameters["memory"].default == "auto" and sig.parameters["vae_tile"].default == "auto"


def test_get_schedule_takes_the_documented_parameter_names():
    """Was a doc bug: docs/api.md gave `get_schedule(steps, image_seq_len)`; the parameter is ``num_steps``,
    so the documented keyword raised a TypeError. The doc now gives the names the code takes."""
    from klein_core.pipeline.sampling import get_schedule

    row = next(ln for ln in _doc("docs/api.md").splitlines() if "`get_schedule(" in ln)
    names = re.search(r"`get_schedule\((\w+), (\w+)\)`", row).groups()
    sigmas = get_schedule(**{names[0]: 4, names[1]: 256})
    assert sigmas.dtype == torch.float32 and sigmas.shape == (5,)


def test_check_cancel_is_called_before_each_image_a_vae_stage_handles(tiny):
    """docs/api.md:26: "`check_cancel()` is called before each image a VAE stage handles", and
    docs/python.md:59-60: "`check_cancel=` (called before each image a VAE stage handles; raise to
    stop)": once per latent decoded, per reference and per picture encoded, and an exception it raises
    stops the stage."""
    tr, te, vae = tiny
    calls: list[int] = []
    engine = kc.Engine(tr, te, vae, check_cancel=lambda: calls.append(1), prompt_cache=None)
    engine.decode(torch.randn(3, 128, 4, 4))
    assert len(calls) == 3
    calls.clear()
    ref = Image.new("RGB", (64, 64), (50, 60, 70))
    engine.encode_references([ref, ref])
    assert len(calls) == 2
    calls.clear()
    engine.encode_pixels(torch.rand(2, 3, 64, 64) * 2 - 1)
    assert len(calls) == 2

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    with pytest.raises(Stop):
        kc.Engine(tr, te, vae, check_cancel=stop, prompt_cache=None).decode(torch.randn(1, 128, 4, 4))


# ---------------------------------------------------------------------------------------------
# README.md


def test_the_install_steps_never_change_torch_and_match_the_stated_versions():
    """README.md:22-23: "Install its few requirements with the Python that runs ComfyUI (safetensors,
    einops, numpy, pillow, tokenizers, gguf; torch is never changed)", README.md:16 "torch comes from
    ComfyUI: never install it for the pack", and README.md:50/61: "(Linux or macOS, Python 3.10+)", "Any
    torch 2.4 or newer works": requirements.txt names exactly those packages (tomli only for Python 3.10's
    TOML reading) and no torch; pyproject.toml asks for Python >= 3.10 and torch >= 2.4."""
    names = []
    for line in _doc("requirements.txt").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower())
    assert "torch" not in names
    assert set(names) - {"tomli"} == {"safetensors", "einops", "numpy", "pillow", "tokenizers", "gguf"}, names
    project = _doc("pyproject.toml")
    assert re.search(r'^requires-python = ">=3\.10"$', project, re.MULTILINE)
    assert re.search(r'^\s*"torch>=2\.4",', project, re.MULTILINE)
