"""Regressions from a bug hunt in klein_core.distributed (batch jobs and the per-worker runner).

No Ray needed: a job whose rows are all done never starts Ray, and the runner runs in-process.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from train_files import nonzero_lora

from klein_core.cli import CLIError
from klein_core.distributed import batch as dbatch
from klein_core.distributed.batch import BatchConfig, run_batch_job
from klein_core.distributed.manifest import Entry, Manifest, image_path, write_atomic
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import RowSpec
from klein_core.distributed.runner import RowRunner
from klein_core.testing import tiny as demo
from klein_core.train.adapters import preset
from klein_core.train.save import save_lora


def _done_job(tmp_path: Path) -> BatchConfig:
    """A job whose one row is already done (so it runs without Ray)."""
    out = tmp_path / "out"
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "b1", "prompt": "x", "width": 64, "height": 64}) + "\n")
    write_atomic(image_path(out, "b1"), b"png")
    Manifest(out).append([Entry("b1", "images/b1.png", 0, 0.1, "w")])
    return BatchConfig(src, out, ModelSpec(demo=True))


def test_second_job_on_the_same_out_is_refused_and_leaves_the_first_jobs_files(tmp_path, monkeypatch):
    config = _done_job(tmp_path)
    in_flight = config.out_dir / "images" / ".a1.png.tmp-0123456789ab"  # a PNG job A is about to rename
    inside, release = threading.Event(), threading.Event()
    real_prepare = dbatch.prepare_rows

    def stalled_prepare(cfg, manifest):
        if threading.current_thread().name == "job-a":  # job A is running: hold it there
            in_flight.write_bytes(b"\x89PNG being written")
            inside.set()
            release.wait(30)
        return real_prepare(cfg, manifest)

    monkeypatch.setattr(dbatch, "prepare_rows", stalled_prepare)
    errors: list[BaseException] = []

    def job_a():
        try:
            run_batch_job(config)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    a = threading.Thread(target=job_a, name="job-a")
    a.start()
    try:
        assert inside.wait(30)
        with pytest.raises(CLIError, match=r"is in use by another batch job \(pid \d+\)"):
            run_batch_job(config)
        assert in_flight.is_file()  # job B did not remove job A's temporary PNG
    finally:
        release.set()
        a.join(30)
    assert not errors
    assert run_batch_job(config).skipped == 1  # the lock went with job A


def _write_lora(path: Path, seed: int) -> Path:
    lora = nonzero_lora(demo.tiny_transformer(), preset("full", rank=2), seed=seed, up_seed=seed, scale=1.0)
    return save_lora(path, lora)


def _image(runner: RowRunner, row: RowSpec) -> np.ndarray:
    return np.asarray(runner.run(row, []).result.images[0])


def test_a_replaced_lora_file_is_read_again(tmp_path):
    loras = tmp_path / "loras"
    loras.mkdir()
    _write_lora(loras / "style.safetensors", 1)
    runner = RowRunner(ModelSpec(demo=True, lora_dir=loras))
    row = RowSpec(id="r", prompt="a fox", width=64, height=64, steps=1, seed=5, loras=(("style", 1.0),))
    first = _image(runner, row)
    time.sleep(0.02)  # a later modification time than the first file's
    _write_lora(loras / "style.safetensors", 2)  # the user updates the LoRA the replica serves
    again = _image(runner, row)
    fresh = _image(RowRunner(ModelSpec(demo=True, lora_dir=loras)), row)
    assert not np.array_equal(first, again)
    assert np.array_equal(again, fresh)  # what a worker started after the update makes


def test_the_lora_cache_is_bounded(tmp_path):
    loras = tmp_path / "loras"
    loras.mkdir()
    _write_lora(loras / "s0.safetensors", 1)
    for i in range(1, 12):
        shutil.copyfile(loras / "s0.safetensors", loras / f"s{i}.safetensors")
    runner = RowRunner(ModelSpec(demo=True, lora_dir=loras))
    for i in range(12):  # what run() does around the forward, without the forward
        runner._apply_loras(RowSpec(id=f"r{i}", loras=((f"s{i}", 1.0),))).remove()
    assert len(runner._loras) <= 8  # a long-running replica does not keep every LoRA it ever saw
