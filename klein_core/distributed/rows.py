"""Request rows: read from JSONL / CSV / Parquet, checked one by one into :class:`RowSpec`.

A row is one image: ``id`` (required; letters, digits, ``._-``), ``prompt``, ``negative_prompt``,
``width``, ``height``, ``steps``, ``guidance``, ``seed`` (default 0), ``references`` (image paths, or
base64 images over HTTP) and ``loras`` (``NAME[:STRENGTH]`` in the job's LoRA folder). In CSV, a list
cell is a JSON list or ``|``-separated. A row that cannot run raises :class:`RowError` with the
message the CLI gives for the same mistake; the caller records it and goes on.
"""

from __future__ import annotations

import base64
import binascii
import csv
import decimal
import io
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from ..cli import CLIError, lora_arg, open_image
from ..pipeline.images import oriented_size, reference_size, refuse_bomb
from ..pipeline.request import MAX_STEPS, Resolved, Settings, resolve
from ..pipeline.sampling import MAX_SEED
from ..pipeline.tokenizer import count_tokens

logger = logging.getLogger(__name__)

FIELDS: tuple[str, ...] = ("id", "prompt", "negative_prompt", "width", "height", "steps", "guidance", "seed",
                           "references", "loras")
MAX_ID_LENGTH = 128
MAX_REFERENCES = 10
MAX_WHOLE_TOKENS = 8192  # with whole prompts (--max-tokens whole): a guard against runaway rows
# Far beyond any size the engine accepts (4 MP with sides of at least 64 px), yet small enough for
# the size rules' arithmetic: a width of 1e308 made their message overflow (OverflowError), which no
# caller treats as the row's fault, so one such row stopped a whole batch job.
MAX_SIDE = 1 << 20
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RowError(ValueError):
    """A row that cannot run; ``str()`` is the user-facing message, ``row_id`` its id if it had one."""

    def __init__(self, message: str, row_id: str | None = None) -> None:
        super().__init__(message)
        self.row_id = row_id


@dataclass(frozen=True)
class RowSpec:
    """One checked row. ``references``: paths (batch) or base64 strings (serve); ``loras``: (name,
    strength) pairs; None sizes / steps / guidance: the model kind's defaults."""

    id: str
    prompt: str = ""
    negative_prompt: str = ""
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    references: tuple[str, ...] = ()
    loras: tuple[tuple[str, float], ...] = ()

    def settings(self) -> Settings:
        """The sampler settings of this row (one image)."""
        return Settings(self.width, self.height, self.steps, self.guidance, self.seed, 1)

    def shape_key(self) -> tuple:
        """Rows with equal keys run the same shapes (sorted together so a worker's batch shares them)."""
        return (self.width or 0, self.height or 0, self.steps or 0, len(self.references), self.loras)

    def to_json(self) -> str:
        """This row as one JSON object (seeds stay exact: JSON integers are unbounded)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RowSpec:
        """The inverse of :meth:`to_json`."""
        d = json.loads(text)
        d["references"] = tuple(d["references"])
        d["loras"] = tuple((n, float(s)) for n, s in d["loras"])
        return cls(**d)


# -- reading files ----------------------------------------------------------------------------------

_WHOLE_FIELDS = ("seed", "width", "height", "steps")


def _number(key: str, value: Any) -> Any:
    """A field as parsed with ``parse_float=Decimal``, made plain: a whole-number field keeps its
    exact Decimal (the row reads it exactly, or refuses a fraction) unless it is an astronomically
    large whole number, which goes on as a float (refused as far too large, as a batch row's is);
    every other number is a float again, also inside lists."""
    if isinstance(value, list):
        return [_number("", v) for v in value]
    if not isinstance(value, decimal.Decimal):
        return value
    if key in _WHOLE_FIELDS and not (value.is_finite() and value == value.to_integral_value()
                                     and value.adjusted() > 25):
        return value
    return float(value)


def exact_numbers(obj: dict) -> dict:
    """A JSON object parsed with ``parse_float=Decimal`` (a served request, a JSONL batch row), its
    numbers made plain by :func:`_number`: whole-number fields exact, every other number a float."""
    return {k: _number(k, v) for k, v in obj.items()}


def read_rows(path: str | Path) -> Iterator[tuple[int, dict | RowError]]:
    """``(row number from 1, raw dict or RowError)`` for each row of a ``.jsonl`` / ``.json`` (one object
    a line), ``.csv`` or ``.parquet`` file. A line that is not a JSON object is a RowError, not the end."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        raise CLIError(f"input {path}: no such file")
    if suffix in (".jsonl", ".json", ".ndjson"):
        # utf-8-sig: a byte order mark (Windows editors) is not part of the first row; surrogateescape:
        # bytes that are not UTF-8 come through as lone surrogates, so such a line is its row's error
        # (any line ending is one, as in text mode)
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
            n = 0
            for line in fh:
                if not line.strip():
                    continue
                n += 1
                bad = next((i for i, ch in enumerate(line) if "\udc80" <= ch <= "\udcff"), None)
                if bad is not None:
                    yield n, RowError(f"row {n}: not valid UTF-8 text (byte {ord(line[bad]) - 0xDC00:#04x} at "
                                      f"character {bad})")
                    continue
                try:
                    # fractions and exponents as Decimal, as a served request's: a seed 9007199254740993.0
                    # is read exactly (or refused), not rounded by a binary float to another seed
                    obj = json.loads(line, parse_float=decimal.Decimal)
                except ValueError as exc:
                    yield n, RowError(f"row {n}: not valid JSON ({exc})")
                    continue
                except RecursionError:  # json's decoder recurses per level: a line of "[[[[..." stops it
                    yield n, RowError(f"row {n}: JSON nested too deeply")
                    continue
                yield n, exact_numbers(obj) if isinstance(obj, dict) else RowError(
                    f"row {n}: must be a JSON object, got {type(obj).__name__}")
    elif suffix == ".csv":
        try:  # utf-8-sig: Excel's "CSV UTF-8" starts with a byte order mark, which would join the first name
            with open(path, encoding="utf-8-sig", newline="") as fh:
                for n, rec in enumerate(csv.DictReader(fh), 1):
                    extra = rec.get(None)  # DictReader files cells beyond the header under None
                    if extra and any(str(v).strip() for v in extra):
                        row_id = str(rec.get("id") or "").strip() or None
                        where = f"row {n} (id {row_id!r})" if row_id else f"row {n}"
                        yield n, RowError(f"{where}: {len(extra)} more cell(s) than the header has names "
                                          f"({', '.join(map(repr, extra))}); quote a value holding a comma",
                                          row_id)
                        continue
                    yield n, {k: v for k, v in rec.items() if k is not None and v not in ("", None)}
        except UnicodeDecodeError as exc:
            raise CLIError(f"input {path}: not valid UTF-8 text ({exc.reason} at byte {exc.start}); save it "
                           "as UTF-8") from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # comes with ray[data]

        n = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for rec in batch.to_pylist():
                n += 1
                yield n, {k: v for k, v in rec.items() if v is not None}
    else:
        raise CLIError(f"input {path}: use a .jsonl, .csv or .parquet file (got {suffix or 'no suffix'})")


# -- one row's fields ---------------------------------------------------------------------------------

def _int(raw: Mapping, key: str, where: str) -> int | None:
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, decimal.Decimal):  # a JSON number with a fraction or exponent (Serve reads them exactly)
        v = str(v)
    if isinstance(v, str):
        try:  # exact: "96.0" (pandas writes optional integer columns so) is 96; "1.5", "1e-999" are not
            d = decimal.Decimal(v.strip())
            # adjusted(): the exponent of the leading digit; past 25 (far above 2^64) it is refused before
            # int() would build a number of that many digits ("1e999999999" took minutes and gigabytes)
            ok = d.is_finite() and d.adjusted() <= 25 and d == d.to_integral_value()
        except (decimal.InvalidOperation, ValueError):
            ok = False
        if not ok:
            shown = str(raw[key]) if isinstance(raw[key], decimal.Decimal) else repr(raw[key])
            raise RowError(f"{where}: {key} must be an integer, got {shown}")
        v = int(d)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RowError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def _float(raw: Mapping, key: str, where: str) -> float | None:
    v = raw.get(key)
    if v is None:
        return None
    try:
        if isinstance(v, bool):
            raise ValueError
        return float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON integer of 400 digits
        raise RowError(f"{where}: {key} must be a number, got {v!r}") from None


def _str(raw: Mapping, key: str, where: str) -> str:
    v = raw.get(key, "")
    if not isinstance(v, str):
        raise RowError(f"{where}: {key} must be a string, got {type(v).__name__}")
    return v


def _list(raw: Mapping, key: str, where: str) -> list[str]:
    v = raw.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            try:
                v = json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the decoder's depth
                raise RowError(f"{where}: {key} is not a valid JSON list: {text[:80]!r}") from None
        else:
            v = [p.strip() for p in text.split("|") if p.strip()]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise RowError(f"{where}: {key} must be a list of strings, got {v!r}"[:300])
    return list(v)


def parse_row(raw: Mapping, number: int | None = None, *, where: str | None = None) -> RowSpec:
    """The fields of one raw row, typed and range-checked (no file is opened). ``number``: the row's
    place in its file; ``where``: how messages name the row (default ``row N (id 'x')``). Raises
    :class:`RowError`."""
    rid = raw.get("id")
    rid = str(rid).strip() if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None
    if where is None:
        where = (f"row {number}" if number is not None else "request") + (f" (id {rid!r})" if rid else "")
    try:
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise RowError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
                           f"{', '.join(FIELDS)}")
        if not rid:
            raise RowError(f"{where}: id is missing (a string naming the output file)")
        if len(rid) > MAX_ID_LENGTH or not _ID.match(rid):
            raise RowError(f"{where}: id must be 1 to {MAX_ID_LENGTH} letters, digits, '.', '_' or '-' "
                           "(it names the output file), starting with a letter or digit")
        for key in ("width", "height"):
            side = _int(raw, key, where)
            if side is not None and side > MAX_SIDE:
                shown = str(raw[key]) if isinstance(raw[key], decimal.Decimal) else repr(raw[key])
                raise RowError(f"{where}: {key} {shown} is far too large; FLUX.2 Klein supports at most 4 "
                               "megapixels (e.g. 2048x2048)")
        steps, seed = _int(raw, "steps", where), _int(raw, "seed", where)
        if steps is not None and not 1 <= steps <= MAX_STEPS:
            raise RowError(f"{where}: steps must be from 1 to {MAX_STEPS}, got {steps}")
        seed = 0 if seed is None else seed
        if not 0 <= seed <= MAX_SEED:
            raise RowError(f"{where}: seed must be from 0 to 2^64-1, got {seed}")
        refs = _list(raw, "references", where)
        if len(refs) > MAX_REFERENCES:
            raise RowError(f"{where}: {len(refs)} references; at most {MAX_REFERENCES}")
        loras = []
        for text in _list(raw, "loras", where):
            name, strength = lora_arg(text)
            loras.append((str(name), strength))
        return RowSpec(rid, _str(raw, "prompt", where), _str(raw, "negative_prompt", where),
                       _int(raw, "width", where), _int(raw, "height", where), steps,
                       _float(raw, "guidance", where), seed, tuple(refs), tuple(loras))
    except RowError as exc:
        exc.row_id = rid
        raise


# -- what needs files or the tokenizer ----------------------------------------------------------------

_BASE64_LAYOUT = dict.fromkeys(map(ord, " \t\r\n"))


def open_reference(ref: str, index: int, *, base64_data: bool = False, base_dir: Path | None = None) -> Image.Image:
    """Reference ``index`` (from 1) as a fully read PIL image: a path (relative to ``base_dir``) or,
    with ``base64_data``, a base64 image. Raises :class:`RowError` with the CLI's message."""
    label = f"references[{index}]"
    if not base64_data:
        path = Path(ref)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        try:
            return open_image(label, path)
        except CLIError as exc:
            raise RowError(str(exc)) from None
    try:
        text = ref.partition(",")[2] if ref.startswith("data:") else ref
        # Line breaks as `base64` (76 columns) and MIME (CRLF) write them are not data; anything else
        # outside the alphabet is still refused rather than skipped.
        data = base64.b64decode(text.translate(_BASE64_LAYOUT), validate=True)
    except (binascii.Error, ValueError):
        raise RowError(f"{label}: not valid base64 (send the image file's bytes base64-encoded)") from None
    try:
        img = Image.open(io.BytesIO(data))
        refuse_bomb(img)
        img.load()
        return img
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise RowError(f"{label}: too large to read safely ({exc})") from None
    except Image.UnidentifiedImageError:
        raise RowError(f"{label}: not an image file (or a format PIL cannot read)") from None
    except Exception as exc:  # noqa: BLE001 (PIL's decoders raise many kinds for a damaged file)
        raise RowError(f"{label}: the image is damaged ({type(exc).__name__}: {exc})") from None


def check_row(spec: RowSpec, images: Sequence[Image.Image], *, kind: str, max_tokens: int | None,
              lora_dir: Path | None) -> Resolved:
    """Everything about ``spec`` that can fail before a model runs, with its reference ``images``
    opened: the size rules (as the engine applies them), the prompt length, the LoRA files.
    Returns the resolved settings; raises :class:`RowError` (its message without the row's name)."""
    first = reference_size(*oriented_size(images[0])) if images else None
    source = "reference 1 ({}x{} px)".format(*oriented_size(images[0])) if images else None
    try:
        run = resolve(spec.settings(), kind, first, warn=False, size_from=source)
    except (ValueError, TypeError) as exc:
        raise RowError(str(exc), spec.id) from None
    limit = MAX_WHOLE_TOKENS if max_tokens is None else max_tokens
    # the negative prompt only where it is encoded (CFG): a distilled model never reads it, as the CLI
    for key in ("prompt", "negative_prompt") if run.cfg else ("prompt",):
        text = getattr(spec, key)
        try:
            n = count_tokens(text) if len(text) < 40 * limit else None  # a token is at least one character
        except ValueError as exc:  # not valid Unicode text (an unpaired surrogate): this row, not the job
            raise RowError(f"{key}: {exc}", spec.id) from None
        if n is None or n > limit:
            hint = " (or run the job with --max-tokens whole)" if max_tokens is not None else ""
            raise RowError(f"{key} is {'far more than' if n is None else n} tokens; the limit is "
                           f"{limit}{hint}", spec.id)
    for name, _ in spec.loras:
        if lora_dir is None or not lora_path(lora_dir, name).is_file():
            there = f"in {lora_dir}" if lora_dir is not None else "(give --lora-dir)"
            raise RowError(f"LoRA {name!r} not found {there}", spec.id)
    return run


def lora_path(lora_dir: Path, name: str) -> Path:
    """The file of LoRA ``name`` inside ``lora_dir``: the name as given if such a file is there
    (``style.sft``), else with ``.safetensors`` added unless it ends so (``detail_v1.5`` is
    ``detail_v1.5.safetensors``)."""
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        return Path("/nonexistent") / p.name
    if name.lower().endswith(".safetensors") or (lora_dir / name).is_file():
        return lora_dir / name
    return lora_dir / f"{name}.safetensors"
