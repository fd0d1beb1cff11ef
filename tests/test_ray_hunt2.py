"""Second bug hunt in klein_core.distributed (batch manifests, resume, PNG parameters, Serve requests).

No Ray cluster: the batch driver reads and checks its rows (``prepare_rows`` / ``run_batch_job`` with
every runnable row already done) before Ray starts, a batch actor (``RowsActor``) and a Serve replica
(``KleinServer`` without ``@serve.batch``) are plain classes run in-process on the tiny demo models.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_serve_replica import _Replica, _Request  # KleinServer without @serve.batch, run in-process

pytest.importorskip("starlette")  # Ray Serve's HTTP layer (the ray extra)

from klein_core import cli as kcli
from klein_core.distributed import cli as dcli
from klein_core.distributed.batch import BatchConfig, RowsActor, prepare_rows, run_batch_job
from klein_core.distributed.manifest import Entry, Manifest, image_path, write_atomic
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import RowError, parse_row
from klein_core.distributed.runner import RowRunner
from klein_core.distributed.serve import Job, KleinServer, ServeOptions, parse_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers --------------------------------------------------------------------------------------------

def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _prepare(src: Path, out: Path, spec: ModelSpec | None = None):
    manifest = Manifest(out)
    return prepare_rows(BatchConfig(src, out, spec or ModelSpec(demo=True)), manifest)


def _finish(out: Path, row_id: str) -> None:
    """What a worker and the driver record for a finished row: its PNG, then its entry."""
    path = image_path(out, row_id)
    write_atomic(path, b"png")
    Manifest(out).append([Entry(row_id, str(path.relative_to(out)), 0, 0.1, "worker")])


def _png_rgb(color=(200, 30, 40), size=(96, 80)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _post(server: KleinServer, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(server(_Request("/generate", "POST", data)))


@pytest.fixture(scope="module")
def replica():
    server = _Replica(ModelSpec(demo=True), ServeOptions())
    deadline = time.monotonic() + 120
    while server.runner is None and server.load_error is None:
        assert time.monotonic() < deadline, "models never loaded"
        time.sleep(0.05)
    assert server.load_error is None
    return server


def _pixels_of(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


# -- batch rows -----------------------------------------------------------------------------------------

def test_lone_surrogate_prompt_is_a_bad_row_not_the_end_of_the_job(tmp_path):
    """Was a bug: a JSONL row whose prompt holds an unpaired surrogate (``"fox \\ud83d"``, an emoji cut in half
    by the program that wrote the manifest) stops the whole batch job. ``check_row`` calls
    ``count_tokens``, which raises a plain ValueError ("the prompt is not valid Unicode text ..."); only
    RowError is caught in ``prepare_rows``, so it escapes ``run_batch_job``: ``python -m klein_core
    batch`` prints ``error: the prompt is not valid Unicode text: ...`` (no row named) and exits 2
    before any row runs, instead of recording ``row 1 (id 'a'): ...`` and going on."""
    src = _write(tmp_path / "rows.jsonl", '{"id": "a", "prompt": "fox \\ud83d"}\n{"id": "b", "prompt": "x"}\n')
    out = tmp_path / "out"
    _finish(out, "b")  # the good row is done, so the job needs no Ray
    summary = run_batch_job(BatchConfig(src, out, ModelSpec(demo=True)))
    assert (summary.rows, summary.skipped, summary.failed) == (2, 1, 1)
    err = Manifest(out).entries["a"].error
    assert err.startswith("row 1 (id 'a'): ") and "unpaired surrogate" in err


def test_undecodable_line_is_a_bad_row_not_the_end_of_the_job(tmp_path):
    """Was a bug: one JSONL line that is not UTF-8 (a Latin-1 ``caf\\xe9`` pasted into the manifest) stops the
    whole job: ``read_rows`` iterates the text file and the UnicodeDecodeError escapes ``prepare_rows``
    / ``run_batch_job``; the CLI prints ``error: 'utf-8' codec can't decode byte 0xe9 in position 26:
    invalid continuation byte`` (neither file nor row named) and exits 2. docs/ray.md: a line that is
    not JSON is a bad row that never stops the job."""
    src = _write(tmp_path / "rows.jsonl", b'{"id": "a", "prompt": "caf\xe9"}\n{"id": "b", "prompt": "x"}\n')
    out = tmp_path / "out"
    _finish(out, "b")
    summary = run_batch_job(BatchConfig(src, out, ModelSpec(demo=True)))
    assert (summary.rows, summary.skipped, summary.failed) == (2, 1, 1)
    assert Manifest(out).done("b")


@pytest.mark.parametrize("name, text", [
    ("rows.csv", "\ufeffid,prompt\r\na,a fox\r\nb,a cat\r\n"),
    ("rows.jsonl", '\ufeff{"id": "a", "prompt": "a fox"}\r\n{"id": "b", "prompt": "a cat"}\r\n'),
], ids=["csv", "jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_field(tmp_path, name, text):
    """Was a bug: a manifest saved with a UTF-8 byte order mark (Excel's "CSV UTF-8", Notepad) is read with
    ``encoding="utf-8"``, so the BOM stays: in CSV the header's first column is ``'\\ufeffid'`` and
    EVERY row fails with ``row N: unknown field(s) '\\ufeffid'``; in JSONL row 1 fails with ``row 1: not
    valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) ...)``. Reading with ``utf-8-sig``
    fixes both (rows.py ``read_rows``)."""
    src = _write(tmp_path / name, text)
    todo, bad, _, total = _prepare(src, tmp_path / "out")
    assert [e.error for e in bad] == []
    assert [(r.id, r.prompt) for r in todo] == [("a", "a fox"), ("b", "a cat")] and total == 2


def test_csv_row_with_more_cells_than_the_header_is_refused(tmp_path):
    """Was a bug: a CSV row with an unquoted comma in its prompt (``a,a red, fox`` under ``id,prompt``) has one
    cell more than the header; ``csv.DictReader`` puts it under the key None and ``read_rows`` drops
    it (``k is not None``), so the row silently runs with the prompt ``'a red'``, while a misspelt
    column is refused as an unknown field. Expected: a bad row naming the extra cell(s)."""
    src = _write(tmp_path / "rows.csv", "id,prompt\na,\"a fox\"\nb,a red, fox\n")
    todo, bad, _, _ = _prepare(src, tmp_path / "out")
    assert [r.id for r in todo] == ["a"], [(r.id, r.prompt) for r in todo]
    assert len(bad) == 1 and bad[0].error.startswith("row 2 (id 'b'): ")


def test_csv_integers_written_as_integral_floats_are_read(tmp_path):
    """Was a bug: a CSV written by pandas from a table whose optional integer columns have empty cells (pandas
    stores them as float64) holds ``96.0`` / ``2.0``; ``_int`` (rows.py) accepts the integral float
    ``96.0`` from JSON but refuses the same value as CSV text: every such row fails with ``row 1 (id
    'a'): width must be an integer, got '96.0'`` (and steps likewise)."""
    pd = pytest.importorskip("pandas")
    src = tmp_path / "rows.csv"
    pd.DataFrame({"id": ["a", "b"], "prompt": ["fox", "cat"], "width": [96, None], "steps": [2, None]}).to_csv(
        src, index=False)
    assert src.read_text().splitlines()[1] == "a,fox,96.0,2.0"
    todo, bad, _, _ = _prepare(src, tmp_path / "out")
    assert [e.error for e in bad] == []
    assert sorted((r.id, r.width, r.steps) for r in todo) == [("a", 96, 2), ("b", None, None)]


def test_references_are_relative_to_the_input_files_folder_not_the_working_directory(tmp_path, monkeypatch):
    """docs/ray.md: batch reference paths are relative to the input file's folder. A reference that
    exists only beside the manifest is found from another working directory; one that exists only in
    the working directory is a missing reference, named with its full path."""
    jobdir, cwd = tmp_path / "job", tmp_path / "elsewhere"
    jobdir.mkdir()
    cwd.mkdir()
    _write(jobdir / "beside.png", _png_rgb())
    _write(cwd / "here.png", _png_rgb())
    monkeypatch.chdir(cwd)
    src = _write(jobdir / "rows.jsonl", '{"id": "ok", "references": ["beside.png"], "steps": 1}\n'
                                        '{"id": "cwd", "references": ["here.png"], "steps": 1}\n')
    todo, bad, _, _ = _prepare(Path(os.path.relpath(src, cwd)), tmp_path / "out")
    assert [r.id for r in todo] == ["ok"]
    assert [(e.id, e.error) for e in bad] == [
        ("cwd", f"row 2 (id 'cwd'): references[1] {Path(os.path.relpath(jobdir, cwd)) / 'here.png'}: no such file")]


def test_odd_but_valid_values_are_read_as_documented(tmp_path):
    """Seeds at the bounds and as integral floats / strings, sizes not multiples of 16 (rounded down by
    the engine's rules), unicode prompts, CRLF and blank lines; bad seeds are refused with the row."""
    rows = [
        {"id": "s0", "prompt": "\u72d0\u72f8 \U0001f98a caf\u00e9", "seed": 0, "width": 100, "height": 70},
        {"id": "smax", "seed": 2**64 - 1},
        {"id": "sfloat", "seed": 5.0},
        {"id": "sstr", "seed": " 18446744073709551615 "},
        {"id": "neg", "seed": -1},
        {"id": "over", "seed": 2**64},
        {"id": "half", "seed": 1.5},
        {"id": "flag", "seed": True},
    ]
    src = _write(tmp_path / "rows.jsonl", "\r\n\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n")
    todo, bad, _, total = _prepare(src, tmp_path / "out")
    got = {r.id: r for r in todo}
    assert total == 8 and set(got) == {"s0", "smax", "sfloat", "sstr"}
    assert got["s0"].prompt == rows[0]["prompt"] and (got["s0"].width, got["s0"].height) == (100, 70)
    assert (got["smax"].seed, got["sfloat"].seed, got["sstr"].seed) == (2**64 - 1, 5, 2**64 - 1)
    assert {e.id: e.error for e in bad} == {
        "neg": "row 5 (id 'neg'): seed must be from 0 to 2^64-1, got -1",
        "over": "row 6 (id 'over'): seed must be from 0 to 2^64-1, got 18446744073709551616",
        "half": "row 7 (id 'half'): seed must be an integer, got 1.5",
        "flag": "row 8 (id 'flag'): seed must be an integer, got True",
    }


# -- PNG parameters: the CLI's -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_runner():
    return RowRunner(ModelSpec(demo=True))


def test_batch_png_parameters_carry_the_clis_keys(tmp_path, demo_runner):
    """Was a bug: docs/ray.md promises batch PNGs carry "the CLI's PNG metadata", but the ``parameters`` a
    batch actor writes lack keys ``klein-generate`` writes for the same image: ``dtype`` and
    ``quantize`` (the precision the weights ran in, which changes the pixels) and ``reference_sizes``
    (observed: CLI-only keys {'dtype': 'float32', 'quantize': None, 'reference_sizes': [],
    'batch': 1, 'step_cache': None}). ``RowRunner.run`` (runner.py) builds its own dict."""
    cli_png = tmp_path / "cli.png"
    assert kcli.main(["--demo", "--prompt", "a fox", "--width", "64", "--height", "64", "--steps", "1",
                      "--seed", "7", "--out", str(cli_png), "-q"]) == 0
    cli_params = json.loads(Image.open(cli_png).text["parameters"])
    out = tmp_path / "out"
    actor = RowsActor.__new__(RowsActor)  # what __init__ sets, with the module's runner (no second load)
    actor.out_dir, actor.base_dir, actor.runner = out, tmp_path, demo_runner
    (entry,) = actor({"row": [parse_row({"id": "r1", "prompt": "a fox", "width": 64, "height": 64, "steps": 1,
                                         "seed": 7}).to_json()]})["entry"]
    assert json.loads(entry)["error"] is None
    png = Image.open(out / "images" / "r1.png")
    params = json.loads(png.text["parameters"])
    assert np.array_equal(np.asarray(png), np.asarray(Image.open(cli_png)))  # the same image
    missing = {k: cli_params[k] for k in ("dtype", "quantize", "reference_sizes") if k not in params}
    assert missing == {}
    assert params["dtype"] == cli_params["dtype"]


def test_lora_strength_in_the_parameters_is_the_one_that_ran(tmp_path, demo_runner):
    """Was a bug: a batch row or request with ``loras: ["style:0.123456789"]`` records
    ``"loras": ["style:0.123457"]`` in its PNG parameters (``f"{n}:{s:g}"`` in runner.py), a strength
    that did not run; ``klein-generate`` fixed exactly this (``_strength_text``: short only when exact,
    else every digit), so its PNG says ``style.safetensors:0.123456789``."""
    qkv = demo_runner.engine.transformer.double_blocks[0].img_attn.qkv.weight
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(2, qkv.shape[1], generator=g),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], 2, generator=g)},
              tmp_path / "style.safetensors")
    runner = RowRunner(ModelSpec(demo=True, lora_dir=tmp_path), engine=demo_runner.engine)
    row = parse_row({"id": "r", "prompt": "a fox", "width": 64, "height": 64, "steps": 1,
                     "loras": ["style:0.123456789"]})
    assert row.loras == (("style", 0.123456789),)
    (text,) = runner.run(row, []).params["loras"]
    strength = text.rpartition(":")[2]
    assert float(strength) == 0.123456789, text


@pytest.mark.parametrize("kind", ["distilled", "base"])
def test_batch_parameters_name_a_negative_prompt_only_where_cfg_ran(demo_runner, kind):
    """Was a bug: a batch row with ``negative_prompt`` on a distilled model (no CFG: the engine says the
    negative prompt is not used) recorded it in the PNG's parameters, a setting that changed no pixel
    (the CLI had the same fault; tests/test_outputs_hunt.py). Now it is recorded where CFG ran only:
    a base model with guidance above 1."""
    engine = demo_runner.engine
    runner = RowRunner(ModelSpec(demo=True), engine=engine)
    row = parse_row({"id": "r", "prompt": "a fox", "negative_prompt": "blurry", "width": 64, "height": 64,
                     "steps": 1, "guidance": 3})
    old = engine.kind
    engine.kind = kind
    try:
        params = runner.run(row, []).params
    finally:
        engine.kind = old
    assert params["negative_prompt"] == ("blurry" if kind == "base" else ""), params


def test_a_failing_row_is_entered_under_its_id_and_the_actors_other_rows_complete(tmp_path, demo_runner,
                                                                                   monkeypatch):
    """One ``map_batches`` call of three rows whose middle one fails inside the engine: three entries in
    order, the failed one under its own id with the exception's type and message and no file, the
    others with their PNG at ``images/<id>.png``."""
    actor = RowsActor.__new__(RowsActor)
    actor.out_dir, actor.base_dir, actor.runner = tmp_path / "out", tmp_path, demo_runner
    real = demo_runner.run

    def flaky(row, images, *, callback=None):
        if row.id == "mid":
            raise RuntimeError("device lost")
        return real(row, images, callback=callback)

    monkeypatch.setattr(demo_runner, "run", flaky)
    rows = [parse_row({"id": i, "prompt": i, "width": 64, "height": 64, "steps": 1, "seed": 2**64 - 1}).to_json()
            for i in ("first", "mid", "last")]
    entries = [Entry(**json.loads(t)) for t in actor({"row": rows})["entry"]]
    assert [(e.id, e.file, e.seed, e.error) for e in entries] == [
        ("first", "images/first.png", 2**64 - 1, None), ("mid", None, 2**64 - 1, "RuntimeError: device lost"),
        ("last", "images/last.png", 2**64 - 1, None)]
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["first.png", "last.png"]


# -- resume --------------------------------------------------------------------------------------------

def test_a_rerun_after_a_crash_redoes_only_rows_without_a_finished_png(tmp_path):
    """A job stopped by an exception mid-way (simulated: PNGs of a, b written with entries; c's PNG
    renamed but its entry never appended; d's temporary PNG left; e failed): the rerun skips a and b,
    redoes c, d and e, removes the temporary file, and names PNGs ``images/<id>.png``."""
    src = _write(tmp_path / "rows.jsonl", "".join(json.dumps({"id": i, "prompt": i}) + "\n" for i in "abcde"))
    out = tmp_path / "out"
    for i in "ab":
        _finish(out, i)
    write_atomic(image_path(out, "c"), b"png")  # renamed, then the job died before the entry
    tmp_png = out / "images" / ".d.png.tmp-0123456789ab"
    tmp_png.write_bytes(b"\x89PNG half")
    Manifest(out).append([Entry("e", None, 0, 0.1, "worker", "RuntimeError: boom")])
    with open(out / "manifest.jsonl", "a") as fh:
        fh.write('{"id": "c", "file": "images/c.png", "se')  # the cut line of c's entry
    manifest = Manifest(out)
    assert manifest.clean_temporaries() == 1 and not tmp_png.exists()
    todo, bad, skipped, total = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), manifest)
    assert ([r.id for r in todo], bad, skipped, total) == (["c", "d", "e"], [], 2, 5)
    assert image_path(out, "c") == out / "images" / "c.png"


# -- Serve requests --------------------------------------------------------------------------------------

def test_lone_surrogate_prompt_request_is_a_400(replica):
    """Was a bug: ``POST /generate {"prompt": "fox \\ud83d"}`` (a JSON escape of half an emoji, valid JSON)
    is answered 500 with a traceback: ``parse_request`` -> ``check_row`` -> ``count_tokens`` raises a
    plain ValueError ("the prompt is not valid Unicode text: it has an unpaired surrogate U+D83D at
    position 4 ..."), and ``KleinServer.__call__`` turns only RowError into a 400. docs/ray.md: a bad
    field is a 400 with the message."""
    answer = _post(replica, b'{"prompt": "fox \\ud83d", "width": 64, "height": 64, "steps": 1}')
    assert answer.status_code == 400
    assert "unpaired surrogate" in json.loads(answer.body)["error"]


@pytest.mark.parametrize("ref", ["data:image/png;base64", "data:"])
def test_data_url_without_a_comma_is_a_400(replica, ref):
    """Was a bug: a reference ``"data:image/png;base64"`` (a data URL whose payload was left off) makes
    ``open_reference`` index ``ref.split(",", 1)[1]`` -> IndexError: list index out of range, which
    ``KleinServer.__call__`` does not catch: a 500 with a traceback instead of the 400 ``references[1]:
    not valid base64 ...`` (rows.py ``open_reference``)."""
    answer = _post(replica, {"prompt": "x", "references": [ref], "width": 64, "height": 64, "steps": 1})
    assert answer.status_code == 400
    assert json.loads(answer.body)["error"].startswith("references[1]: ")


def test_data_url_reference_and_documented_json_answer(replica):
    """A reference sent as a data URL works like bare base64; the json answer has exactly the fields
    docs/ray.md lists, the seed 2^64-1 exact, sizes rounded down to multiples of 16, and a PNG with
    the row's parameters; the png answer has the documented headers."""
    png = _png_rgb()
    body = {"id": "edit-1", "prompt": "make it blue", "seed": 2**64 - 1, "width": 100, "height": 70, "steps": 1,
            "references": ["data:image/png;base64," + base64.b64encode(png).decode()]}
    answer = _post(replica, body)
    assert answer.status_code == 200, answer.body
    d = json.loads(answer.body)
    assert set(d) == {"id", "seed", "width", "height", "steps", "guidance", "timings", "batch_size", "batch_id",
                      "worker", "image_base64"}
    assert set(d["timings"]) == {"text", "references", "denoise", "decode", "queue", "total"}
    assert (d["id"], d["seed"], d["width"], d["height"], d["steps"]) == ("edit-1", 2**64 - 1, 96, 64, 1)
    img = Image.open(io.BytesIO(base64.b64decode(d["image_base64"])))
    params = json.loads(img.text["parameters"])
    assert img.size == (96, 64) and params["seed"] == 2**64 - 1 and params["references"] == ["<base64 1>"]
    assert img.text["Software"].startswith("klein_core ")
    plain = _post(replica, {**body, "references": [base64.b64encode(png).decode()], "response": "png"})
    assert plain.status_code == 200 and plain.media_type == "image/png"
    assert {k: plain.headers[k] for k in ("x-klein-id", "x-klein-seed")} == {"x-klein-id": "edit-1",
                                                                             "x-klein-seed": str(2**64 - 1)}
    assert json.loads(plain.headers["x-klein-batch-size"]) == 1 and "total" in json.loads(plain.headers["x-klein-timings"])
    assert np.array_equal(_pixels_of(plain.body), np.asarray(img))


def test_a_batch_of_mixed_sizes_answers_each_request_with_its_own_image(replica):
    """Requests of different sizes in one ``@serve.batch`` call (``_run_jobs`` reorders them by shape):
    each outcome is its own request's (id, seed, size) and its pixels equal the same request run
    alone."""
    spec = replica.spec

    def job(i: int, w: int, h: int) -> Job:
        return parse_request(json.dumps({"id": f"j{i}", "prompt": f"lighthouse {i}", "seed": 10 + i, "width": w,
                                         "height": h, "steps": 1}).encode(),
                             kind=spec.kind, max_tokens=spec.max_tokens, lora_dir=spec.lora_dir)

    sizes = [(112, 64), (64, 96), (80, 80), (64, 64)]
    batched = replica._run_jobs([job(i, w, h) for i, (w, h) in enumerate(sizes)])
    for i, ((w, h), out) in enumerate(zip(sizes, batched)):
        assert (out["id"], out["seed"], out["width"], out["height"], out["batch_size"]) == (f"j{i}", 10 + i, w, h, 4)
        (single,) = replica._run_jobs([job(i, w, h)])
        assert np.array_equal(_pixels_of(out["png"]), _pixels_of(single["png"])), i


def test_the_replica_serves_the_next_request_after_an_engine_failure(replica, monkeypatch):
    """A request that fails inside the engine is a 500 with the message and the request's id; the
    replica's next request is answered 200 with the same image as before the failure."""
    body = {"id": "ok", "prompt": "a kite", "seed": 3, "width": 64, "height": 64, "steps": 1}
    before = json.loads(_post(replica, body).body)
    real = replica.runner.run
    calls = []

    def broken_once(row, images, *, callback=None):
        if not calls:
            calls.append(row.id)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(row, images, callback=callback)

    monkeypatch.setattr(replica.runner, "run", broken_once)
    failed = _post(replica, {**body, "id": "bad"})
    assert failed.status_code == 500
    assert json.loads(failed.body) == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered",
                                       "id": "bad"}
    after = _post(replica, body)
    assert after.status_code == 200
    assert np.array_equal(_pixels_of(base64.b64decode(json.loads(after.body)["image_base64"])),
                          _pixels_of(base64.b64decode(before["image_base64"])))


def test_wrong_route_and_method(replica):
    """docs/ray.md: 404 for a wrong route, 405 for a wrong method on /generate, both JSON errors."""
    nf = asyncio.run(replica(_Request("/generat", "POST", b"{}")))
    wm = asyncio.run(replica(_Request("/generate", "GET")))
    assert (nf.status_code, wm.status_code) == (404, 405)
    assert "error" in json.loads(nf.body) and "error" in json.loads(wm.body)


def test_an_oversized_body_is_a_400_before_it_is_parsed():
    body = b'{"prompt": "' + b"a" * (64 << 20) + b'"}'
    with pytest.raises(RowError, match=r"^request body is \d+ bytes; at most 67108864$"):
        parse_request(body, kind="distilled", max_tokens=512, lora_dir=None)


def test_cli_batch_args_reach_the_spec(tmp_path):
    """``--max-tokens whole`` with the batch command: long prompts are kept, as docs/ray.md says."""
    p = __import__("argparse").ArgumentParser()
    dcli.add_batch_args(p)
    spec = dcli.spec_from_args(p.parse_args([str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"), "--demo",
                                             "--max-tokens", "whole"]))
    src = _write(tmp_path / "r.jsonl", json.dumps({"id": "long", "prompt": "fox " * 600}) + "\n")
    todo, bad, _, _ = _prepare(src, tmp_path / "o", spec)
    assert [r.id for r in todo] == ["long"] and bad == []


def test_integer_fields_refuse_huge_exponents_and_fractions_at_once():
    """Review of the Decimal parsing above: "1e999999999" was turned into an integer of a billion digits
    (a Serve replica pinned for minutes); "1e-999" and a fraction past float precision were accepted.
    Each is refused at once, naming the field; integral forms of any spelling are exact."""
    from klein_core.distributed.rows import _int

    t0 = time.perf_counter()
    for bad in ("1e999999999", "1e-999", "12345678901234567890.5", "nan", "inf"):
        with pytest.raises(RowError, match="seed must be an integer"):
            _int({"seed": bad}, "seed", "row 1")
    assert time.perf_counter() - t0 < 1.0
    assert _int({"seed": "18446744073709551615.0"}, "seed", "row 1") == 2**64 - 1
    assert _int({"seed": "1.5e3"}, "seed", "row 1") == 1500


def test_jsonl_rows_ending_in_a_lone_carriage_return_are_rows(tmp_path):
    """Lines ended by a lone CR (old Mac files) are rows, as text mode reads them (reading bytes split
    on LF only, making the whole file one bad row)."""
    from klein_core.distributed.rows import read_rows

    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'{"id": "a", "prompt": "fox"}\r{"id": "b", "prompt": "cat"}\r')
    rows = list(read_rows(src))
    assert [r["id"] for _, r in rows] == ["a", "b"], rows
