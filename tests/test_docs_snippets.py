"""The Python examples in the docs run as written, on tiny random models, and do what they say.

The ```python blocks of README.md, docs/python.md, docs/inpaint.md and docs/speed.md are read from the
files at test time (so an edit of the docs is tested) and executed in order, the blocks of one file in
one namespace (later blocks continue earlier ones), each file in its own. They run in a temporary
working directory holding the tiny model files under the names the snippets use and the small pictures
they open (photo.jpg, room.jpg, mask.png). After each block a check looks at its effect (the file it
saves, the size of the images, the shape of the latents), so a test cannot pass by doing nothing.

The snippets are written for a GPU. Without one, the only changes made to a block's text are its
device string ("cuda" -> "cpu") and its dtype name ``dtype="bf16"`` -> ``dtype="fp32"``, what the CLI
picks on a CPU: bf16 convolutions on a CPU without AVX-512 BF16 run about 45 times slower than fp32
(one 32-channel 256² convolution: 3.3 s against 0.07 s, measured on a 2-core AMD EPYC CI machine),
and the README's 1024² decode took 380 s there in bf16. A block that picks its device itself
(``torch.cuda.is_available()``) is run unchanged. Names a fragment uses without defining them are predefined, each with a comment.

Left out: the HTTP/websocket script in docs/comfyui.md, which needs a running ComfyUI server (a real
server is tested elsewhere, in the end-to-end tests), not a Python API on tiny models.
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import klein_core
from klein_core.testing import write_tiny_model_files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/python.md", "docs/inpaint.md", "docs/speed.md")
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# The files the snippets load, by the names they use, and the tiny model each is a copy of.
MODEL_FILES = {"flux-2-klein-4b.safetensors": "klein_4b", "qwen_3_4b.safetensors": "qwen_4b",
               "flux2-vae.safetensors": "vae"}
PHOTO_SIZE = (96, 64)  # photo.jpg, room.jpg and mask.png: small, sides multiples of 16, at least 64
SMALL_MASK_BOX = (40, 24, 55, 39)  # the white square of mask.png and of the predefined `small_mask`

_BLOCK = re.compile(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block of ``doc``, read now."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, textwrap.dedent(m.group(1))) for m in _BLOCK.finditer(text)]


def for_this_machine(code: str) -> str:
    """The block's text with its device string "cuda" made "cpu" and ``dtype="bf16"`` made
    ``dtype="fp32"`` when there is no GPU (the only changes made to a snippet; see the module's
    docstring); a block that chooses its own device by ``torch.cuda.is_available()`` is kept."""
    if HAS_CUDA or "torch.cuda.is_available()" in code:
        return code
    return code.replace('"cuda"', '"cpu"').replace('dtype="bf16"', 'dtype="fp32"')


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny random model files, written once for the module."""
    return write_tiny_model_files(tmp_path_factory.mktemp("tiny_models"))


def _picture(size: tuple[int, int], seed: int) -> Image.Image:
    w, h = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return Image.fromarray((0.6 * ramp + 0.4 * rng.integers(0, 256, (h, w, 3))).astype(np.uint8))


def _mask(size: tuple[int, int]) -> Image.Image:
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).rectangle(SMALL_MASK_BOX, fill=255)
    return mask


@pytest.fixture
def workdir(tmp_path, tiny_files, monkeypatch) -> Iterator[Path]:
    """A working directory with the model files and the pictures the snippets name; HOME points into it
    (docs/python.md makes a prompt cache under "~/.cache"), and the root logger is restored afterwards
    (docs/python.md calls logging.basicConfig)."""
    for name, key in MODEL_FILES.items():
        (tmp_path / name).symlink_to(tiny_files[key])
    _picture(PHOTO_SIZE, 0).save(tmp_path / "photo.jpg")
    _picture(PHOTO_SIZE, 1).save(tmp_path / "room.jpg")
    _mask(PHOTO_SIZE).save(tmp_path / "mask.png")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield tmp_path
    root.setLevel(level)
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)


@pytest.fixture
def generate_calls(monkeypatch) -> list[tuple[dict, Any]]:
    """Every ``kc.generate`` call the snippets make, (keyword arguments, result): several snippets
    discard the result, and their effect is checked on it. The call itself is the real one."""
    calls: list[tuple[dict, Any]] = []
    real = klein_core.generate

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append((kwargs, result))
        return result

    monkeypatch.setattr(klein_core, "generate", recording)
    return calls


def _tiny_models() -> tuple[Any, Any, Any]:
    """The three tiny models loaded from the working directory, as docs/python.md loads them here."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    return (klein_core.load_transformer("flux-2-klein-4b.safetensors", device=DEVICE, dtype=dtype),
            klein_core.load_text_encoder("qwen_3_4b.safetensors", device=DEVICE, dtype=dtype),
            klein_core.load_vae("flux2-vae.safetensors", device=DEVICE, dtype=dtype))


def _predefined(doc: str) -> dict[str, Any]:
    """The names a file's fragments use without defining them."""
    if doc == "docs/inpaint.md":
        # docs/inpaint.md continues docs/python.md: `kc`, `Image` and the models `tr`, `te`, `vae` (the
        # README's names) come from there; `photo` and `small_mask` stand for any picture and a small mask
        # on it, which the page does not make.
        tr, te, vae = _tiny_models()
        return {"kc": klein_core, "Image": Image, "tr": tr, "te": te, "vae": vae,
                "photo": Image.open("photo.jpg"), "small_mask": _mask(PHOTO_SIZE)}
    if doc == "docs/speed.md":
        # docs/speed.md's block uses the models docs/python.md loads, by its names.
        transformer, text_encoder, vae = _tiny_models()
        return {"transformer": transformer, "text_encoder": text_encoder, "vae": vae}
    return {}


# ---------------------------------------------------------------------------------------------
# What each block does, checked after it ran: check(namespace, working directory, generate calls)


def _saved_image(path: Path, size: tuple[int, int]) -> None:
    assert path.is_file(), f"{path.name} was not saved"
    with Image.open(path) as image:
        image.load()
        assert image.size == size


def _check_readme(ns, wd, calls) -> None:
    assert len(calls) == 1 and calls[0][0]["seed"] == 7
    _saved_image(wd / "fox.png", (1024, 1024))  # the default size
    # dtype="bf16" as a name (on a GPU; "fp32" on the CPU, see for_this_machine)
    assert ns["tr"].img_in.weight.dtype == (torch.bfloat16 if HAS_CUDA else torch.float32)


def _check_generate(ns, wd, calls) -> None:
    assert len(calls) == 3
    _saved_image(wd / "fox.png", (1024, 1024))
    edit = ns["result"]
    assert edit is calls[1][1] and edit.images[0].size == PHOTO_SIZE  # the size of the first reference
    assert edit.reference_sizes == [PHOTO_SIZE]
    base = calls[2][1]
    assert (base.steps, base.guidance) == (50, 4.0)  # kind="base": 50 steps, CFG 4
    assert base.images is None and base.pixels is None  # output="latent"
    assert ns["latents"] is base.latents and tuple(ns["latents"].shape) == (1, 128, 64, 64)


def _check_stages(ns, wd, calls) -> None:
    w, h = PHOTO_SIZE
    cond = ns["cond"]
    assert isinstance(cond, klein_core.Conditioning) and cond.negative is None
    assert cond.positive.shape[:2] == (1, 512)
    refs = ns["refs"]
    assert len(refs) == 1 and tuple(refs[0].shape) == (1, 128, h // 16, w // 16)
    assert tuple(ns["latents"].shape) == (1, 128, h // 16, w // 16)  # the size of the reference
    pixels = ns["pixels"]
    assert tuple(pixels.shape) == (1, 3, h, w)
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0
    result = ns["result"]
    assert result.images[0].size == (1024, 1024) and result.seed == 7


def _check_request(ns, wd, calls) -> None:
    w, h = PHOTO_SIZE
    result = ns["result"]
    assert ns["request"].ref_mode == "timestep_zero"
    assert result.images[0].size == PHOTO_SIZE and tuple(result.latents.shape) == (1, 128, h // 16, w // 16)


def _check_text_options(ns, wd, calls) -> None:
    assert isinstance(klein_core.COMFYUI_TEXT, klein_core.TextOptions)
    assert ns["engine"].text == klein_core.TextOptions(trim=64)  # the last of the three


def _check_prompt_cache(ns, wd, calls) -> None:
    cache, engine = ns["cache"], ns["engine"]
    folder = wd / "home" / ".cache" / "klein-prompts"
    assert cache.disk.folder == folder and folder.is_dir()  # "~" is the home folder
    assert ns["identity"].startswith("qwen_3_4b.safetensors:")
    assert ns["identity"].endswith(f"|bfloat16|None|{DEVICE}")
    assert ns["cond"] is None  # nothing cached yet
    # The snippet's engine writes what it encodes to that folder, and an engine without models reads it.
    encoded = engine.encode_prompts(["a red fox"])
    assert any(folder.glob("*.safetensors"))
    identity = klein_core.pipeline.prompts.loaded_encoder_identity(engine.text_encoder, engine.device)
    cached = klein_core.Engine(prompt_cache=cache).cached_prompts(["a red fox"], identity=identity)
    assert cached is not None and torch.equal(cached.positive.cpu(), encoded.positive.cpu())


def _check_inpaint(ns, wd, calls) -> None:
    w, h = PHOTO_SIZE
    assert len(calls) == 4
    sizes = [result.images[0].size for _, result in calls]
    assert sizes == [PHOTO_SIZE, PHOTO_SIZE, (w + 256, h), PHOTO_SIZE]
    assert ns["canvas"].size == (w + 256, h) and ns["new_area"].size == (w + 256, h)
    # the outpaint mask is the new area: black over the picture, white on the right
    new_area = np.asarray(ns["new_area"].convert("L"))
    assert new_area[:, :w - 16].max() == 0 and new_area[:, w + 16:].min() == 255
    # with a mask (and composite, the default) every unmasked pixel is the original's, bit for bit
    keep = np.asarray(ns["mask"].convert("L")) == 0
    room = np.asarray(Image.open("room.jpg").convert("RGB"))
    painted = np.asarray(calls[0][1].images[0].convert("RGB"))
    assert np.array_equal(painted[keep], room[keep]) and not np.array_equal(painted, room)
    photo = np.asarray(ns["photo"].convert("RGB"))
    ring = np.asarray(calls[3][1].images[0].convert("RGB"))
    assert np.array_equal(ring[keep], photo[keep]) and not np.array_equal(ring, photo)
    # image to image: a strength and no mask, at the picture's size (checked above)
    assert calls[1][0]["strength"] == 0.6 and "mask" not in calls[1][0]


def _check_speed(ns, wd, calls) -> None:
    from klein_core.accel import speed_of

    assert len(calls) == 1 and calls[0][1].images[0].size == (1024, 1024)
    assert speed_of(ns["vae"]) == "compile"  # apply_speed(..., "compile") in place
    settings = ns["transformer"].ops.settings  # enable_fast_paths replaced the transformer's fast paths
    assert settings.attention == "sdpa" and settings.fused_rope is False and settings.compile is False


CHECKS: dict[str, list[Callable[[dict, Path, list], None]]] = {
    "README.md": [_check_readme],
    "docs/python.md": [_check_generate, _check_stages, _check_request, _check_text_options,
                       _check_prompt_cache],
    "docs/inpaint.md": [_check_inpaint],
    "docs/speed.md": [_check_speed],
}


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_of_the_docs_run_and_do_what_they_say(doc, workdir, generate_calls):
    """Each ```python block of ``doc`` runs (device string made "cpu" without a GPU; blocks in order,
    one namespace) and its effect is there; a failure names the file, the block and its line."""
    blocks = python_blocks(doc)
    checks = CHECKS[doc]
    assert len(blocks) == len(checks), (
        f"{doc} has {len(blocks)} python blocks, this test checks {len(checks)}: add a check for the new one")
    ns: dict[str, Any] = {"__name__": "__docs_snippet__", **_predefined(doc)}
    for index, ((line, code), check) in enumerate(zip(blocks, checks)):
        where = f"{doc} block {index} (line {line})"
        generate_calls.clear()
        try:
            exec(compile(for_this_machine(code), f"<{where}>", "exec"), ns)  # noqa: S102 (the docs' own code)
        except Exception as exc:
            raise AssertionError(f"{where} fails: {type(exc).__name__}: {exc}") from exc
        try:
            check(ns, workdir, generate_calls)
        except Exception as exc:
            raise AssertionError(
                f"{where} ran but did not do what it says: {type(exc).__name__}: {exc}") from exc


def test_docs_have_the_blocks_this_test_runs():
    """The four files exist and each has a python block (a moved or renamed page would make the test
    above vacuous); docs/comfyui.md's HTTP script is the python block left out on purpose."""
    for doc in DOCS:
        assert python_blocks(doc), f"{doc} has no python block"
    assert python_blocks("docs/comfyui.md")
