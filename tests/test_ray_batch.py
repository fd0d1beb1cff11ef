"""Batch generation on Ray Data (klein_core.distributed): CPU, tiny models, a local 2-CPU Ray cluster.

Images must be bit-identical to single-process ``klein_core.generate``; bad rows are recorded and
never stop the job; a killed job resumes without redoing finished rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import klein_core as kc

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from klein_core.distributed import cli as dcli
from klein_core.distributed.manifest import Manifest
from klein_core.distributed.rows import RowError, parse_row, read_rows
from klein_core.testing.tiny import write_tiny_model_files

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_model_files(tmp_path_factory.mktemp("models"))


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    dcli.add_batch_args(p)
    return p.parse_args(list(argv))


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _good_rows(n: int, size: int = 64, steps: int = 2) -> list[dict]:
    return [{"id": f"img{i:02d}", "prompt": f"a red fox number {i}", "seed": 1000 + 7 * i, "width": size + 16 * (i % 2),
             "height": size, "steps": steps} for i in range(n)]


def test_batch_equals_generate_and_records_bad_rows(cluster, models, tmp_path, capsys):
    Image.new("RGB", (96, 80), (200, 30, 40)).save(tmp_path / "ref.png")
    rows = _good_rows(11)
    rows.append({"id": "edit", "prompt": "make it blue", "seed": 2**64 - 1, "steps": 2, "references": ["ref.png"]})
    rows += [{"id": "small", "prompt": "x", "width": 32, "height": 64},
             {"id": "noref", "prompt": "x", "references": ["missing.png"]},
             {"id": "long", "prompt": "fox " * 600}]
    src = _write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = _args(str(src), "--out", str(out), "--models-dir", str(models["vae"].parents[1]), "--workers", "2",
                 "--batch-size", "2", "--address", cluster, "-q")
    assert dcli.run_batch(args) == 1  # some rows failed
    assert "12 image(s), 3 failed, 0 already done, 15 row(s)" in capsys.readouterr().out

    man = Manifest(out)
    assert man.done_ids() == {r["id"] for r in rows[:12]}
    errors = {i: e.error for i, e in man.entries.items() if e.error}
    assert errors == {
        "small": "row 13 (id 'small'): Output size 32x64 is too small: both sides must be at least 64 px.",
        "noref": f"row 14 (id 'noref'): references[1] {tmp_path / 'missing.png'}: no such file",
        "long": "row 15 (id 'long'): prompt is 613 tokens; the limit is 512 (or run the job with --max-tokens whole)",
    }
    workers = {man.entries[r["id"]].worker for r in rows[:12]}
    assert len(workers) == 2  # both actors took rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated"] == 12 and summary["failed"] == 3 and sum(summary["per_worker"].values()) == 12

    tr = kc.load_transformer(models["klein_4b"], device="cpu", dtype=torch.float32)
    te = kc.load_text_encoder(models["qwen_4b"], device="cpu", dtype=torch.float32)
    vae = kc.load_vae(models["vae"], device="cpu", dtype=torch.float32)
    for r in rows[:12]:
        refs = [Image.open(tmp_path / p) for p in r.get("references", [])]
        want = kc.generate(tr, te, vae, prompt=r["prompt"], seed=r["seed"], width=r.get("width"),
                           height=r.get("height"), steps=r["steps"], references=refs, kind="distilled").images[0]
        got = Image.open(out / man.entries[r["id"]].file)
        assert np.array_equal(np.asarray(got), np.asarray(want)), r["id"]
        params = json.loads(got.text["parameters"])
        assert (params["id"], params["seed"], params["transformer"]) == (r["id"], r["seed"], "flux-2-klein-4b.safetensors")
        assert params["environment"]["torch"] == torch.__version__ and params["environment"]["device"] == "cpu"
        assert params["vae_tile"] == "auto" and params["decode_tiles"] == [None]  # the CPU decodes whole


def test_killed_job_resumes_without_redoing_rows(cluster, tmp_path):
    src = _write_rows(tmp_path / "rows.jsonl", _good_rows(16, size=192, steps=4))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "klein_core", "batch", str(src), "--out", str(out), "--demo",
           "--workers", "1", "--batch-size", "1", "--address", cluster, "-q"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    manifest = out / "manifest.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.is_file() and len(manifest.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = Manifest(out).done_ids()
    assert 3 <= len(first) < 16, "the job was not stopped halfway"
    # what a kill between two writes can leave: a cut manifest line and a temporary PNG
    with open(manifest, "a") as fh:
        fh.write('{"id": "img15", "file": "images/img15.png", "se')
    (out / "images" / ".img15.png.tmp-deadbeef").write_bytes(b"\x89PNG half")
    stamps = {i: (out / "images" / f"{i}.png").stat().st_mtime_ns for i in first}

    args = _args(str(src), "--out", str(out), "--demo", "--workers", "2", "--batch-size", "2", "--address",
                 cluster, "-q")
    assert dcli.run_batch(args) == 0
    man = Manifest(out)
    assert man.done_ids() == {f"img{i:02d}" for i in range(16)}
    assert not list((out / "images").glob(".*tmp*"))
    assert {i: (out / "images" / f"{i}.png").stat().st_mtime_ns for i in first} == stamps  # not redone
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["skipped"], summary["generated"], summary["failed"]) == (len(first), 16 - len(first), 0)


def test_rows_from_csv_and_parquet(tmp_path):
    (tmp_path / "r.csv").write_text('id,prompt,seed,width,references,loras\n'
                                    'a,"a fox, red",18446744073709551615,128,x.png|y.png,"[""style:0.5""]"\n'
                                    'b,cat,nope,,,\n')
    got = list(read_rows(tmp_path / "r.csv"))
    a = parse_row(got[0][1], 1)
    assert (a.id, a.prompt, a.seed, a.width, a.height, a.references, a.loras) == (
        "a", "a fox, red", 2**64 - 1, 128, None, ("x.png", "y.png"), (("style", 0.5),))
    with pytest.raises(RowError, match=r"^row 2 \(id 'b'\): seed must be an integer, got 'nope'$"):
        parse_row(got[1][1], 2)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["p"], "prompt": ["dog"], "seed": pa.array([2**64 - 1], pa.uint64()),
                             "steps": [3]}), tmp_path / "r.parquet")
    (n, raw), = read_rows(tmp_path / "r.parquet")
    p = parse_row(raw, n)
    assert (p.id, p.seed, p.steps) == ("p", 2**64 - 1, 3)
    with pytest.raises(RowError, match=r"^row 1 \(id 'a/b'\): id must be 1 to 128 letters"):
        parse_row({"id": "a/b"}, 1)
    with pytest.raises(RowError, match=r"^row 1 \(id 'q'\): unknown field\(s\) 'promt'; the fields are id, prompt"):
        parse_row({"id": "q", "promt": "x"}, 1)


def test_without_ray_one_clear_error(monkeypatch, tmp_path, capsys):
    code = ("import sys; import klein_core.distributed.cli, klein_core.distributed.batch, "
            "klein_core.distributed.serve; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    res = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"  # importing the package never imports Ray
    src = _write_rows(tmp_path / "rows.jsonl", _good_rows(1))
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert dcli.run_batch(_args(str(src), "--out", str(tmp_path / "o"), "--demo")) == 2
    assert capsys.readouterr().err.strip().endswith('batch and serve run on Ray: pip install "klein-nodes[ray]"')


def test_trim_padding_reaches_the_workers_spec(tmp_path):
    """--trim-padding in a batch job: every worker's engine pads prompts to a multiple of 64, and
    the PNGs' parameters say so, as klein-generate's do."""
    for flag, trim in (([], None), (["--trim-padding"], 64)):
        spec = dcli.spec_from_args(_args(str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "o"), "--demo", *flag))
        assert spec.text.trim == trim and spec.text.max_tokens == 512
        assert spec.png_params()["trim_padding"] == trim


def test_vae_tile_reaches_the_workers_engine(tmp_path):
    """--vae-tile in a batch job: the spec carries it to each worker's Engine and the PNGs' parameters
    record it, as klein-generate's do."""
    from klein_core.distributed.models import open_engine

    for flag, tile, recorded in (([], "auto", "auto"), (["--vae-tile", "none"], None, "none"),
                                 (["--vae-tile", "32"], 32, 32)):
        spec = dcli.spec_from_args(_args(str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "o"), "--demo", *flag))
        assert spec.vae_tile == tile and spec.png_params()["vae_tile"] == recorded
    assert open_engine(spec).vae_tile == 32


def test_speed_is_fast_by_default_as_in_klein_generate(tmp_path):
    """Was a bug: batch and serve ran the models "as loaded" (the plain path on a GPU) while
    ``klein-generate`` runs ``fast``. The job's spec, its workers' models and the PNGs' parameters now
    say ``fast`` unless ``--speed`` says otherwise."""
    from klein_core.accel.speed import speed_of
    from klein_core.distributed.models import ModelSpec, open_engine

    assert ModelSpec(demo=True).speed == "fast"
    for flag, speed in (([], "fast"), (["--speed", "plain"], "plain"), (["--speed", "compile"], "compile")):
        spec = dcli.spec_from_args(_args(str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "o"), "--demo", *flag))
        assert spec.speed == speed and spec.png_params()["speed"] == speed
    engine = open_engine(dcli.spec_from_args(_args(str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "o"),
                                                   "--demo")))
    assert {speed_of(m) for m in (engine.transformer, engine.vae, engine.text_encoder)} == {"fast"}
