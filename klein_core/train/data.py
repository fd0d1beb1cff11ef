"""Training data: a folder of images with ``.txt`` captions, or a JSONL of rows (``{"image": ...,
"caption": ...}``, edit pairs add ``"references": [...]`` and use the caption as the
instruction); aspect-ratio buckets; and caches of latents and prompt embeddings keyed by the
file's content hash and the encoding model's identity.

Bad input fails before any model work, naming what is wrong: an empty folder, images without a
caption (all named), a distilled model as the base, more reference tokens than the sequence
limit. An unreadable image is skipped and reported by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageOps
from safetensors import safe_open
from safetensors.torch import save_file

from ..pipeline.images import high_bit_to_rgb8, levels_mode, oriented_size
from ..pipeline.request import guess_model_kind
from ..pipeline.tokenizer import count_tokens
from .trainer import TrainSample

logger = logging.getLogger(__name__)

IMAGE_EXTS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PIXELS_PER_TOKEN = 16  # VAE /8, then 2x2 patches
MAX_SEQUENCE_TOKENS = 52_000  # Klein's sequence limit (text + image + reference tokens)
JSONL_FIELDS = frozenset({"image", "caption", "instruction", "references"})


class DatasetError(ValueError):
    """The dataset cannot be used as given; the message says what to fix."""


@dataclass(frozen=True)
class DataItem:
    """One training example: the target ``image``, its ``caption`` (for edit pairs the
    instruction) and any ``references`` (edit pairs)."""

    image: Path
    caption: str
    references: tuple[Path, ...] = ()


@dataclass(frozen=True)
class DatasetScan:
    """Usable items and, by file, the ones skipped with the reason."""

    items: tuple[DataItem, ...]
    skipped: dict[str, str] = field(default_factory=dict)


# What Windows writes into picture folders: never training data, not worth a warning.
_SYSTEM_FILES = frozenset({"thumbs.db", "desktop.ini"})


def _readable(path: Path) -> str | None:
    """None when PIL can decode ``path`` and its pixels can be read as training reads them (a float
    picture with NaN pixels cannot), else the reason."""
    try:
        with Image.open(path) as im:
            im.load()
            if levels_mode(im):  # what load_pixels does that can fail (NaN in a float picture): found now, named
                _upright_rgb(im)
        return None
    except Exception as exc:  # noqa: BLE001 - any decode failure means: skip this file
        return f"unreadable image ({type(exc).__name__}: {exc})"


def _read_caption(path: Path) -> str:
    """The caption text: UTF-8, a byte-order mark (Windows editors write one) dropped."""
    return path.read_text(encoding="utf-8-sig").strip()


def _scan_folder(folder: Path) -> list[DataItem]:
    # Hidden files are never training data: macOS writes "._name.png" resource forks beside copied
    # images, which are not images and have no caption.
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    images = [p for p in entries if p.is_file() and p.suffix.lower() in IMAGE_EXTS]
    if not images:
        raise DatasetError(f"{folder}: the folder holds no images ({', '.join(IMAGE_EXTS)}); "
                           "put the training images and a .txt caption beside each there.")
    # Captions by stem, the extension in any case (IMG_1.TXT from a camera card or Windows); an exact
    # ".txt" wins over another spelling of the same name.
    exact: dict[str, Path] = {}
    for p in entries:
        if p.is_file() and p.suffix.lower() == ".txt" and (p.suffix == ".txt" or p.stem not in exact):
            exact[p.stem] = p
    # A stem in another case (Photo.png, photo.txt) as the case-insensitive file systems of macOS and
    # Windows find it: the same folder trains the same everywhere.
    folded = {stem.casefold(): p for stem, p in reversed(list(exact.items()))}
    caption_files = {p.stem: c for p in images if (c := exact.get(p.stem) or folded.get(p.stem.casefold()))}
    missing = [p.name for p in images if p.stem not in caption_files]
    if missing:
        raise DatasetError(f"{folder}: {len(missing)} image(s) have no caption file: "
                           f"{', '.join(missing)}; add a .txt with the same name beside each.")
    # What is not trained on is said, not silently dropped: captions whose image is missing or in an
    # unsupported format, and subfolders (only the folder's own files are read).
    used = set(caption_files.values())
    orphans = [p.name for p in entries if p.is_file() and p.suffix.lower() == ".txt" and p not in used]
    if orphans:
        logger.warning("%s: %d caption(s) have no image beside them (%s) and are not used: %s", folder,
                       len(orphans), ", ".join(IMAGE_EXTS), ", ".join(orphans))
    subfolders = [p.name for p in entries if p.is_dir()]
    if subfolders:
        logger.warning("%s: subfolders are not read (only the folder's own images): %s", folder,
                       ", ".join(subfolders))
    others = [p.name for p in entries if p.is_file() and p.suffix.lower() not in (*IMAGE_EXTS, ".txt")
              and p.name.lower() not in _SYSTEM_FILES]
    if others:  # a .heic or .gif without a caption would otherwise vanish from the run unsaid
        logger.warning("%s: %d file(s) are not images of a supported format (%s) and are not used: %s", folder,
                       len(others), ", ".join(IMAGE_EXTS), ", ".join(others))
    sharing: dict[Path, list[str]] = {}
    for p in images:
        sharing.setdefault(caption_files[p.stem], []).append(p.name)
    shared = [f"{c.name} ({', '.join(names)})" for c, names in sharing.items() if len(names) > 1]
    if shared:  # a.jpg and a.png both train with a.txt: said, as it is rarely meant
        logger.warning("%s: %d caption file(s) are used by more than one image: %s", folder, len(shared),
                       "; ".join(shared))
    captions, bad = [], []
    for p in images:
        try:
            captions.append(_read_caption(caption_files[p.stem]))
        except UnicodeDecodeError as exc:
            bad.append(f"{caption_files[p.stem].name} ({exc.reason} at byte {exc.start})")
    if bad:
        raise DatasetError(f"{folder}: {len(bad)} caption file(s) are not UTF-8 text: {', '.join(bad)}; "
                           "save them as UTF-8.")
    empty = [caption_files[p.stem].name for p, c in zip(images, captions) if not c]
    if empty:
        logger.warning("%s: %d caption file(s) are empty; those images train with an empty caption: %s",
                       folder, len(empty), ", ".join(empty))
    return [DataItem(p, c) for p, c in zip(images, captions)]


def _scan_jsonl(file: Path) -> list[DataItem]:
    items = []
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    unknown: dict[str, int] = {}
    seen: dict[tuple, int] = {}
    repeated: list[str] = []
    # "\n" only: splitlines() also splits at U+2028 / U+0085, which JSON strings may hold unescaped
    # (json.dumps(ensure_ascii=False) writes them so). read_text made "\r\n" and "\r" "\n" already.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{file}:{n}: not valid JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str):
            raise DatasetError(f"{file}:{n}: each row needs an \"image\" path")
        caption = row.get("caption", row.get("instruction"))
        if "caption" in row and "instruction" in row:
            logger.warning("%s:%d: both \"caption\" and \"instruction\"; the caption is used, the instruction "
                           "is not", file, n)
        if not isinstance(caption, str) or not caption.strip():
            raise DatasetError(f"{file}:{n}: image {row['image']} has no \"caption\" (or \"instruction\")")
        refs = row.get("references", [])
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise DatasetError(f"{file}:{n}: \"references\" must be a list of image paths")
        for key in row.keys() - JSONL_FIELDS:
            unknown.setdefault(key, n)
        item = DataItem(file.parent / row["image"], caption.strip(), tuple(file.parent / r for r in refs))
        key = (item.image, item.caption, item.references)
        if key in seen:
            repeated.append(f"line {n} (as line {seen[key]})")
        seen.setdefault(key, n)
        items.append(item)
    if unknown:  # a misspelt field (e.g. "reference") would otherwise silently train without it
        logger.warning("%s: unknown field(s) not used: %s; a row's fields are %s", file,
                       ", ".join(f"{k!r} (first on line {n})" for k, n in sorted(unknown.items(), key=lambda kv: kv[1])),
                       ", ".join(sorted(JSONL_FIELDS)))
    if repeated:  # kept (repeating a row is a way to weight it), but said: a pasted-twice file is common
        logger.warning("%s: %d row(s) repeat an earlier row (same image, caption and references) and train it "
                       "again: %s", file, len(repeated), ", ".join(repeated))
    if not items:
        raise DatasetError(f"{file}: the JSONL file holds no rows")
    return items


def scan_dataset(source: str | os.PathLike) -> DatasetScan:
    """The items of a folder (images + ``.txt`` captions) or a ``.jsonl`` file. Unreadable images
    (targets or references) are skipped and reported; every other problem raises
    :class:`DatasetError`."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    items = _scan_folder(path) if path.is_dir() else _scan_jsonl(path)
    good, skipped = [], {}
    reasons: dict[Path, str | None] = {}  # each file read once, however many items share it

    def unreadable(p: Path) -> str | None:
        if p not in reasons:
            reasons[p] = _readable(p)
        return reasons[p]

    for item in items:
        bad = next(((p, r) for p in (item.image, *item.references) if (r := unreadable(p)) is not None), None)
        if bad is None:
            good.append(item)
        else:  # by the example dropped (a reference shared by several rows drops each of them)
            reason = bad[1] if bad[0] == item.image else f"reference {bad[0]}: {bad[1]}"
            key = str(item.image)  # rows sharing a target: every reason kept
            skipped[key] = f"{skipped[key]}; {reason}" if key in skipped and reason not in skipped[key] else reason
    for name, reason in skipped.items():
        logger.warning("skipped %s: %s", name, reason)
    if not good:
        raise DatasetError(f"{path}: no usable images; skipped {len(skipped)}: "
                           + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return DatasetScan(tuple(good), skipped)


def bucket_size(width: int, height: int, area: int = 1024 * 1024) -> tuple[int, int]:
    """The bucket ``(width, height)`` in pixels for an image: multiples of 16 with the image's
    aspect ratio and about ``area`` pixels (never more)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    # floor(width * sqrt(area / (width * height))) in integers: the float product gave 1023 for many
    # squares at 1024² (1040, 1232, 2080 px...), so they fell into the 1008 bucket.
    w = max(1, math.isqrt(area * width // height) // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN
    h = max(1, math.isqrt(area * height // width) // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN
    # A very thin image has its short side raised to one token (16 px); the long side then gives
    # back what that added, so the bucket stays within ``area``.
    if w * h > area:
        if w >= h:
            w = max(PIXELS_PER_TOKEN, area // h // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
        else:
            h = max(PIXELS_PER_TOKEN, area // w // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
    return w, h


def _orientation(im: Image.Image) -> int:
    try:
        return int(im.getexif().get(0x0112, 1) or 1)
    except (OSError, ValueError, SyntaxError, TypeError):  # unreadable EXIF: the pixels as stored
        return 1


def _upright_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB, upright, as inference reads references (:mod:`klein_core.pipeline.images`): the
    EXIF orientation applied (phone photos store portraits sideways) and 16/32-bit and float pictures
    scaled to 8 bits by their white level (Pillow's convert("RGB") clips them: a 16-bit mid grey
    comes out white)."""
    try:
        im = ImageOps.exif_transpose(im)
    except (OSError, ValueError, SyntaxError, TypeError):  # unreadable EXIF: as stored, as _orientation says
        pass
    return high_bit_to_rgb8(im).convert("RGB")


def pixels_rule(im: Image.Image) -> str | None:
    """A cache-key part for an image whose pixels an earlier version read differently (a rotated
    EXIF orientation, a 16/32-bit or float mode), so that its old cache entries are not reused; None else."""
    orientation = _orientation(im)
    tags = ([f"exif-orientation-{orientation}"] if orientation != 1 else []) + \
        ([f"mode-{im.mode}"] if levels_mode(im) else [])
    return "+".join(tags) or None


def load_pixels(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """``[1, 3, H, W]`` float32 in [-1, 1]: the image (upright, 8-bit RGB) scaled to cover ``size``
    and centre-cropped."""
    with Image.open(path) as im:
        im = _upright_rgb(im)
        w, h = size
        s = max(w / im.width, h / im.height)
        im = im.resize((max(w, round(im.width * s)), max(h, round(im.height * s))), Image.Resampling.LANCZOS)
        left, top = (im.width - w) // 2, (im.height - h) // 2
        im = im.crop((left, top, left + w, top + h))
        t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).reshape(h, w, 3)
    return (t.permute(2, 0, 1).float() / 127.5 - 1.0)[None]


def content_hash(path: Path) -> str:
    """sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dataset_hash(items: Sequence[DataItem]) -> str:
    """sha256 over every item's content hashes and caption: names the data a LoRA was trained on."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([content_hash(it.image), it.caption, [content_hash(r) for r in it.references]]).encode())
    return h.hexdigest()


class TensorCache:
    """A folder of ``<key>.safetensors`` entries, one tensor each, keyed by ``sha256(identity, parts)``.

    ``identity`` names the encoding model (file, dtype...). An entry whose stored identity or
    source does not match, or that cannot be read, is stale and is rebuilt.
    """

    def __init__(self, folder: str | os.PathLike, identity: str) -> None:
        self.folder = Path(folder)
        self.identity = identity
        self.hits = self.builds = 0

    def get(self, source: str, parts: Sequence[object], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The cached tensor for ``source`` (a content hash or the text) and ``parts``, else
        ``build()`` stored."""
        key = hashlib.sha256(json.dumps([self.identity, source, list(map(str, parts))]).encode()).hexdigest()
        path = self.folder / f"{key}.safetensors"
        if path.is_file():
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("identity") == self.identity and meta.get("source") == source:
                        self.hits += 1
                        # An owned copy: the tensor safetensors returns maps the file, which would
                        # then stay mapped for the whole run (a rewritten entry changing it under the
                        # run, one cut short a SIGBUS; on Windows it could not be replaced).
                        return f.get_tensor("value").clone()
                logger.info("cache entry %s is stale; rebuilding", path.name)
            except Exception as exc:  # noqa: BLE001 - a corrupt entry is rebuilt
                logger.warning("cache entry %s cannot be read (%s); rebuilding", path.name, exc)
        value = build()
        self.builds += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        # A name of this process's own: processes building one cache together (data-parallel training
        # under torchrun) would otherwise interleave their bytes in one temporary file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file({"value": value.detach().cpu().contiguous()}, str(tmp),
                      metadata={"identity": self.identity, "source": source})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return value


def require_base_model(source: str | os.PathLike) -> None:
    """Refuse a distilled (or KV) Klein model as the base: LoRAs are trained on the base model."""
    kind = guess_model_kind(source)
    if kind != "base":
        raise DatasetError(
            f"{source}: this is a {kind} Klein model; LoRAs are trained on the base model (e.g. "
            "flux-2-klein-base-4b), because step distillation bakes the sampling schedule into the weights "
            "and a LoRA trained on it does not transfer. Use the base model file.")


def check_token_budget(item: DataItem, size: tuple[int, int], ref_sizes: Sequence[tuple[int, int]],
                       text_tokens: int, limit: int = MAX_SEQUENCE_TOKENS) -> int:
    """The sequence length of one example (text + target + reference tokens); raises when it is
    over ``limit``, naming the reference count."""
    tokens = text_tokens + sum((w // PIXELS_PER_TOKEN) * (h // PIXELS_PER_TOKEN) for w, h in (size, *ref_sizes))
    if tokens > limit:
        raise DatasetError(
            f"{item.image}: {len(ref_sizes)} reference(s) make {tokens} tokens with the target and text, over "
            f"the {limit}-token limit; use fewer references or a smaller reference area.")
    return tokens


@dataclass(frozen=True)
class Encoders:
    """What turns files into training tensors: ``image(pixels [1, 3, H, W]) -> latents [1, C, H/16,
    W/16]`` and ``text(caption) -> [1, L, D]``, each with the identity its cache is keyed by. With
    ``tokens(caption) -> (ids, mask)`` (``[1, L]`` each; a text-encoder LoRA is trained) captions
    are tokenized instead, and ``text`` is not used."""

    image: Callable[[torch.Tensor], torch.Tensor]
    text: Callable[[str], torch.Tensor] | None
    image_identity: str
    text_identity: str
    tokens: Callable[[str], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.text is None and self.tokens is None:
            raise ValueError("Encoders need text (prompt embeddings) or tokens")


def build_samples(scan: DatasetScan, encoders: Encoders, cache_dir: str | os.PathLike, *,
                  area: int = 1024 * 1024, reference_area: int | None = None, text_tokens: int = 512,
                  token_limit: int = MAX_SEQUENCE_TOKENS, shard: tuple[int, int] = (0, 1),
                  gather: Callable[[str | None], Sequence[str | None]] | None = None,
                  on_encode: Callable[[int, int], None] | None = None) -> list[TrainSample]:
    """Encode every item (through the caches) into :class:`TrainSample` s. The token budget of every
    item is checked first, before anything is encoded.

    ``shard=(rank, world)`` with ``gather`` (data-parallel training, every process calling with the
    same dataset and cache folder): process ``rank`` first encodes items ``rank``, ``rank + world``,
    ... into the caches, then ``gather(error or None)`` (an all-gather: it waits for every process)
    says how the others did; after it, the other items are read from the caches (a process that
    cannot see the others' files encodes them itself). A process that failed raises its error; the
    others raise a :class:`DatasetError` naming it, rather than waiting for it forever.

    ``on_encode(done, total)`` is called after each item is encoded or read from the caches (its own
    share first, in a shard), for progress.
    """
    plans = []
    rules: dict[Path, str | None] = {}
    for item in scan.items:
        with Image.open(item.image) as im:
            size = bucket_size(*oriented_size(im), area)  # the bucket of the image as it is seen (EXIF)
            rules[item.image] = pixels_rule(im)
        ref_sizes = []
        for r in item.references:
            with Image.open(r) as im:
                ref_sizes.append(bucket_size(*oriented_size(im), reference_area or area))
                rules[r] = pixels_rule(im)
        check_token_budget(item, size, ref_sizes, text_tokens, token_limit)
        if (n := count_tokens(item.caption)) > text_tokens:  # said by its file, cached or not
            logger.warning("%s: its caption is %d tokens after the chat template; truncated to max_length=%d, "
                           "as at inference (%d tokens cut from the end)", item.image.name, n, text_tokens,
                           n - text_tokens)
        plans.append((item, size, ref_sizes))
    latents = TensorCache(Path(cache_dir) / "latents", encoders.image_identity)
    texts = TensorCache(Path(cache_dir) / "prompts", encoders.text_identity)

    def enc(path: Path, sz: tuple[int, int]) -> torch.Tensor:
        parts = sz if rules[path] is None else (*sz, rules[path])  # unchanged keys for plain images
        return latents.get(content_hash(path), parts, lambda: encoders.image(load_pixels(path, sz)))

    done = 0

    def sample(item: DataItem, size: tuple[int, int], ref_sizes: list[tuple[int, int]]) -> TrainSample:
        nonlocal done
        lat = enc(item.image, size)
        refs = tuple(enc(r, s) for r, s in zip(item.references, ref_sizes))
        if encoders.tokens is not None:  # tokenizing is cheap: not cached
            out = TrainSample(lat, None, refs, tokens=encoders.tokens(item.caption))
        else:
            txt = texts.get(item.caption, (), lambda c=item.caption, f=encoders.text: f(c))  # type: ignore[misc]
            out = TrainSample(lat, txt, refs)
        done += 1
        if on_encode is not None:
            on_encode(done, len(plans))
        return out

    rank, world = shard
    own: dict[int, TrainSample] = {}
    if world > 1:
        if gather is None or not 0 <= rank < world:
            raise ValueError(f"shard {shard}: a shard needs a rank below the world size, and gather")
        error: Exception | None = None
        try:
            for i in range(rank, len(plans), world):
                own[i] = sample(*plans[i])
        except Exception as exc:  # noqa: BLE001 - said to the other processes, then raised here
            error = exc
        reports = gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise DatasetError(f"process {r} of {world} failed while encoding its share of the dataset: {e}")
    out = [own[i] if i in own else sample(*plan) for i, plan in enumerate(plans)]
    logger.info("encoded %d samples (latents: %d cached, %d built; prompts: %d cached, %d built)", len(out),
                latents.hits, latents.builds, texts.hits, texts.builds)
    return out
