"""Regressions from a bug hunt in klein_core.memory / quant / distributed.

The distributed ones need no Ray: the batch driver checks its rows (``prepare_rows``) and the server
parses its requests (``parse_request``) before Ray is involved, and that is where they failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from klein_core.distributed.batch import BatchConfig, prepare_rows
from klein_core.distributed.manifest import Entry, Manifest, image_path, write_atomic
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import RowError
from klein_core.distributed.serve import parse_request


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _prepare(src: Path, out: Path):
    """One job's driver-side pass: rows checked, bad rows appended to the manifest, as run_batch_job does."""
    manifest = Manifest(out)
    todo, bad, skipped, total = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), manifest)
    manifest.append(bad)
    return manifest, todo, bad, skipped


def _finish(manifest: Manifest, out: Path, row_id: str) -> None:
    """What a worker and the driver record for a finished row: its PNG, then its entry."""
    path = image_path(out, row_id)
    write_atomic(path, b"png")
    manifest.append([Entry(row_id, str(path.relative_to(out)), 0, 0.1, "worker")])


def _parse(body: bytes):
    return parse_request(body, kind="distilled", max_tokens=512, lora_dir=None)


def test_reference_path_the_os_refuses_is_a_bad_row_not_the_end_of_the_job(tmp_path):
    # A NUL byte in a path made os.stat raise a bare ValueError out of the driver's row checks:
    # the whole job stopped before any row ran, instead of recording the row and going on.
    src = _write(tmp_path / "rows.jsonl", [json.dumps({"id": "a", "references": ["bad\u0000.png"]}),
                                           json.dumps({"id": "b", "prompt": "a fox"})])
    _, todo, bad, _ = _prepare(src, tmp_path / "out")
    assert [r.id for r in todo] == ["b"]
    assert [e.id for e in bad] == ["a"]
    assert "row 1 (id 'a'): references[1]" in bad[0].error and "not a usable file path" in bad[0].error


def test_deeply_nested_json_line_is_a_bad_row(tmp_path):
    # json's decoder recurses per nesting level: RecursionError is not a ValueError, and stopped the job.
    src = _write(tmp_path / "rows.jsonl", ["[" * 100_000 + "]" * 100_000, json.dumps({"id": "ok", "prompt": "x"})])
    _, todo, bad, _ = _prepare(src, tmp_path / "out")
    assert [r.id for r in todo] == ["ok"]
    assert len(bad) == 1 and bad[0].error == "row 1: JSON nested too deeply"


def test_deeply_nested_request_body_is_a_400():
    # parse_request turns RowError into a 400; anything else became a 500 from the replica.
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        with pytest.raises(RowError, match="nested too deeply"):
            _parse(body)


@pytest.mark.parametrize("key", ["width", "height"])
def test_absurd_size_is_refused_as_the_rows_fault(tmp_path, key):
    # 1e308 is an integral float, so it passed as an int; the size rules then overflowed formatting
    # their megapixel message (OverflowError): a 500 over HTTP, and the end of a batch job.
    row = {"width": 64, "height": 64, key: 1e308}
    with pytest.raises(RowError, match=f"{key} 1e\\+308 is far too large"):
        _parse(json.dumps(row).encode())
    src = _write(tmp_path / "rows.jsonl", [json.dumps({"id": "big", **row}), json.dumps({"id": "ok", "prompt": "x"})])
    _, todo, bad, _ = _prepare(src, tmp_path / "out")
    assert [r.id for r in todo] == ["ok"]
    assert [e.id for e in bad] == ["big"] and "far too large" in bad[0].error


def test_bad_row_without_an_id_never_marks_a_real_row_named_like_it_failed(tmp_path):
    # Bad rows without an id were recorded as "row-N", a valid id: a real row "row-2" that had finished
    # was marked failed by the next run (the last entry of an id wins), and redone on the run after.
    src = _write(tmp_path / "rows.jsonl", [json.dumps({"id": "row-2", "prompt": "a fox"}),
                                           json.dumps({"prompt": "no id"})])
    out = tmp_path / "out"
    manifest, todo, bad, _ = _prepare(src, out)
    assert [r.id for r in todo] == ["row-2"] and len(bad) == 1
    _finish(manifest, out, "row-2")
    for _ in range(2):  # two reruns: nothing to redo either time
        manifest, todo, bad, skipped = _prepare(src, out)
        assert todo == [] and skipped == 1
        assert Manifest(out).done("row-2")
    assert bad[0].id != "row-2" and "id is missing" in bad[0].error


def test_failed_duplicate_never_marks_the_first_rows_image_failed(tmp_path):
    # A later row reusing a finished row's id, with a bad field too, was recorded under that id and so
    # overwrote the finished row's entry; the duplicate's error must go under a name of its own.
    src = _write(tmp_path / "rows.jsonl", [json.dumps({"id": "cat", "prompt": "a cat"}),
                                           json.dumps({"id": "cat", "width": "wide"})])
    out = tmp_path / "out"
    manifest, todo, bad, _ = _prepare(src, out)
    assert [r.id for r in todo] == ["cat"] and len(bad) == 1
    _finish(manifest, out, "cat")
    manifest, todo, bad, skipped = _prepare(src, out)
    assert todo == [] and skipped == 1
    assert Manifest(out).done("cat")
    assert bad[0].id != "cat" and "width must be an integer" in bad[0].error
