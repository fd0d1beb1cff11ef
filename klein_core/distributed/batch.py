"""The batch job: checked rows -> Ray Data ``map_batches`` over a pool of model actors -> PNGs + manifest.

The driver reads and checks the rows (bad rows go straight to the manifest), drops the rows already
done, and hands the rest to Ray Data as JSON rows sorted by shape. Each actor (:class:`RowsActor`)
loads the models once and writes each row's PNG atomically; the driver appends the manifest entries
as results stream back, so the manifest has a single writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image

from ..cli import CLIError
from ..errors import GenerationCancelled, KleinOutOfMemory, WeightFormatError
from .manifest import (
    Entry,
    Manifest,
    OutputInUse,
    OutputLock,
    folds_case,
    image_path,
    png_bytes,
    write_atomic,
)
from .models import ModelSpec
from .ray_support import init_ray, require_ray
from .rows import RowError, RowSpec, check_row, open_reference, parse_row, read_rows

logger = logging.getLogger(__name__)

# What a row can raise that is the row's fault (or its size's): recorded, the job goes on.
ROW_ERRORS = (RowError, CLIError, ValueError, TypeError, WeightFormatError, KleinOutOfMemory, GenerationCancelled)


@dataclass(frozen=True)
class BatchConfig:
    """One job. ``actors``: model actors (one per GPU with ``gpus_per_actor=1``); ``batch_size``: rows
    per ``map_batches`` call; ``address``: a Ray cluster (None: ``RAY_ADDRESS``, else a local one)."""

    input: Path
    out_dir: Path
    spec: ModelSpec
    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    batch_size: int = 4
    address: str | None = None
    num_cpus: int | None = None  # for a local cluster started here


@dataclass
class Summary:
    """The outcome of a job: counts, time, images/s, rows per worker."""

    rows: int = 0
    skipped: int = 0
    generated: int = 0
    failed: int = 0
    seconds: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "images_per_s": round(self.images_per_s, 4)}


def prepare_rows(config: BatchConfig, manifest: Manifest) -> tuple[list[RowSpec], list[Entry], int, int]:
    """``(rows to run sorted by shape, error entries of bad rows, rows already done, rows read)``.

    Each row is parsed and checked (sizes, prompt length, references, LoRA files) here, before any
    model loads; a duplicate id is an error for every occurrence after the first."""
    todo: list[RowSpec] = []
    bad: list[Entry] = []
    seen: dict[str, tuple[int, str]] = {}  # id (case folded where names are) -> (its first row, the id there)
    folds = folds_case(config.out_dir)
    skipped = total = 0
    base = config.input.parent
    for number, raw in read_rows(config.input):
        total += 1
        try:
            if isinstance(raw, RowError):
                raise raw
            row = parse_row(raw, number)
            # Where the output's file system does not tell case apart (macOS, Windows), ids that differ
            # only in case name one PNG: one image would replace the other while the manifest lists
            # both as done.
            if (key := row.id.casefold() if folds else row.id) in seen:
                first, first_id = seen[key]
                also = "" if first_id == row.id else (f" (as {first_id!r}: the file system of --out does not tell "
                                                      "case apart)")
                raise RowError(f"row {number}: id {row.id!r} was already used by row {first}{also}")
            seen[key] = (number, row.id)
            if manifest.done(row.id):
                skipped += 1
                continue
            try:
                images = [open_reference(r, i, base_dir=base) for i, r in enumerate(row.references, 1)]
                check_row(row, images, kind=config.spec.kind, max_tokens=config.spec.max_tokens,
                          lora_dir=config.spec.lora_dir)
            except RowError as exc:
                raise RowError(f"row {number} (id {row.id!r}): {exc}", row.id) from None
            todo.append(row)
        except RowError as exc:
            if exc.row_id:
                seen.setdefault(exc.row_id.casefold() if folds else exc.row_id, (number, exc.row_id))
            # The entry goes under the row's own id only if no other row owns it: "the last entry of an
            # id wins", so a failed duplicate recorded under its id marked the first row's finished image
            # failed (and that row was redone on the next run). Rows without an id of their own get a
            # name no valid id can have (it has a space), so they cannot clash with a real row "row-3".
            own = exc.row_id is not None and seen.get(exc.row_id.casefold() if folds else exc.row_id,
                                                      (None,))[0] == number
            bad.append(Entry(exc.row_id if own else f"row {number}", None, None, 0.0, None, str(exc)))
    todo.sort(key=lambda r: (r.shape_key(), r.id))
    return todo, bad, skipped, total


class RowsActor:
    """A Ray Data actor: loads the models once, then generates ``{"row": [RowSpec JSON...]}`` batches
    into ``{"entry": [Entry JSON...]}``, writing each PNG atomically under ``out_dir``."""

    def __init__(self, spec: ModelSpec, out_dir: str, base_dir: str, threads: int = 0) -> None:
        import torch

        from .runner import RowRunner

        if threads > 0 and not torch.cuda.is_available():
            torch.set_num_threads(threads)
        # The worker process is the job's: PIL's bomb warning goes (refuse_bomb names such a reference).
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        self.out_dir = Path(out_dir)
        self.base_dir = Path(base_dir)
        self.runner = RowRunner(spec)

    def __call__(self, batch: dict) -> dict:
        return {"entry": [self._one(RowSpec.from_json(text)).to_json() for text in batch["row"]]}

    def _one(self, row: RowSpec) -> Entry:
        t0 = time.perf_counter()
        try:
            images = [open_reference(r, i, base_dir=self.base_dir) for i, r in enumerate(row.references, 1)]
            out = self.runner.run(row, images)
            path = image_path(self.out_dir, row.id)
            write_atomic(path, png_bytes(out.result.images[0], out.params))
            return Entry(row.id, str(path.relative_to(self.out_dir)), row.seed, round(time.perf_counter() - t0, 4),
                         self.runner.worker)
        except ROW_ERRORS as exc:
            msg = str(exc)
        except Exception as exc:
            logger.exception("row %s failed", row.id)
            msg = f"{type(exc).__name__}: {exc}"
        return Entry(row.id, None, row.seed, round(time.perf_counter() - t0, 4), self.runner.worker, msg)


Progress = Callable[[int, int, int, float], None]  # (finished, to run, failed, seconds so far)


def run_batch_job(config: BatchConfig, progress: Progress | None = None) -> Summary:
    """Run ``config``; returns the :class:`Summary` (also written to ``out_dir/summary.json``).
    Bad rows are recorded, never raised; a missing Ray raises
    :class:`~klein_core.distributed.ray_support.RayMissing`; an output folder another job is writing
    to raises :class:`~klein_core.cli.CLIError`."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(OutputLock(config.out_dir))  # one job per folder: see OutputLock
        except OutputInUse as exc:
            raise CLIError(str(exc)) from None
        except OSError as exc:  # a file where the folder should be, a folder under a file, no permission
            raise CLIError(f"--out {config.out_dir}: cannot use it as the output folder ({exc.strerror or exc})"
                           ) from None
        return _run_locked(config, progress)


def _run_locked(config: BatchConfig, progress: Progress | None) -> Summary:
    t0 = time.perf_counter()
    manifest = Manifest(config.out_dir)
    removed = manifest.clean_temporaries()
    if removed:
        logger.info("removed %d temporary file(s) a stopped job left", removed)
    todo, bad, skipped, total = prepare_rows(config, manifest)
    manifest.append(bad)
    summary = Summary(rows=total, skipped=skipped, failed=len(bad))
    logger.info("%d row(s): %d to run, %d already done, %d bad", total, len(todo), skipped, len(bad))
    if todo:
        data = require_ray("data")
        ray = init_ray(config.address, num_cpus=config.num_cpus)
        ctx = data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = data.from_items([{"row": r.to_json()} for r in todo],
                             override_num_blocks=max(1, math.ceil(len(todo) / config.batch_size)))
        ds = ds.map_batches(
            RowsActor, batch_size=config.batch_size, compute=data.ActorPoolStrategy(size=config.actors),
            fn_constructor_kwargs={"spec": config.spec, "out_dir": str(config.out_dir.resolve()),
                                   "base_dir": str(config.input.parent.resolve()),
                                   "threads": max(1, int(config.cpus_per_actor))},
            num_cpus=config.cpus_per_actor, num_gpus=config.gpus_per_actor or None)
        finished = 0
        t_run = time.perf_counter()
        for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
            entries = [Entry(**json.loads(text)) for text in batch["entry"]]
            manifest.append(entries)
            for e in entries:
                finished += 1
                if e.error is None:
                    summary.generated += 1
                else:
                    summary.failed += 1
                if e.worker:
                    summary.per_worker[e.worker] = summary.per_worker.get(e.worker, 0) + 1
            if progress is not None:
                progress(finished, len(todo), summary.failed, time.perf_counter() - t_run)
        del ray
    summary.seconds = time.perf_counter() - t0
    summary.per_worker = dict(Counter(summary.per_worker).most_common())
    write_atomic(config.out_dir / "summary.json", json.dumps(summary.to_dict(), indent=1).encode())
    return summary
