"""Hostile GGUF files (issue #28): files changed on disk after they were opened, headers whose counts
claim more than the file holds, malformed metadata, and a Qwen3 file labelled "flux".

The dangerous cases run in a child process, so a SIGBUS or a hang fails the test, not pytest."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from extras import require
from gguf_files import hf_to_llama, write_gguf, write_tiny_gguf_transformer

import klein_core as kc
from klein_core.files.identify import probe
from klein_core.files.opening import open_weights
from klein_core.testing import tiny_text_encoder, tiny_transformer

gguf = require("gguf")
HERE = Path(__file__).resolve().parent


def _child(code: str, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (tests/ on its path) and return what it did."""
    prelude = f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
    try:
        return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], capture_output=True,
                              text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung (still running after {timeout} s)")


# ----- 1, 2. files changed on disk after they were opened ---------------------------------------

CHANGED = """
import os, sys
from pathlib import Path
import klein_core as kc
from klein_core.files.opening import open_weights
from gguf_files import write_tiny_gguf_transformer

path, how = Path(sys.argv[1]), sys.argv[2]
write_tiny_gguf_transformer(path)
src = open_weights(path, component="transformer")
model = kc.load_transformer(path)
size = path.stat().st_size
if how == "truncate":
    os.truncate(path, size // 4)
elif how == "truncate to nothing":
    os.truncate(path, 0)
else:  # rewritten in place: same inode and size, other bytes (a download restarting)
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(os.urandom(size - size // 2))
    os.utime(path, ns=(0, 12345))  # a coarse clock could leave the modification time as it was
refused = 0
for key in src.keys():
    try:
        src.get(key)
    except kc.WeightFormatError as exc:
        assert str(path) in str(exc) and "changed on disk after it was opened" in str(exc), exc
        refused += 1
assert refused == len(src), f"{len(src) - refused} tensors were read from the changed file"
try:
    kc.load_transformer(path)  # a new load of the changed file: a clear error (or, rewritten, a load)
except (kc.WeightFormatError, ValueError) as exc:
    assert str(path) in str(exc), exc
print("ok")
"""


@pytest.mark.parametrize("how", ["truncate", "truncate to nothing", "rewrite in place"])
def test_a_gguf_changed_after_it_was_opened_is_refused(tmp_path, how):
    done = _child(CHANGED, str(tmp_path / "klein-Q8_0.gguf"), how)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"return code {done.returncode} (-7 is SIGBUS): {done.stderr[-2000:]}")


def test_a_gguf_read_after_open_is_unchanged_when_the_file_is(tmp_path):
    path = write_tiny_gguf_transformer(tmp_path / "m.gguf")
    src = open_weights(path, component="transformer")
    again = open_weights(path, component="transformer")
    for key in src.keys():
        assert torch.equal(src.get(key), again.get(key))


# ----- 3. counts beyond the file's size: refused at once, naming the file and the field ----------


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _header(kvs: list[bytes], tensors: list[bytes], n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
    return out + b"".join(kvs) + b"".join(tensors)


def _kv_array(key: str, itype: int, count: int, items: bytes = b"") -> bytes:
    return _s(key) + struct.pack("<IIQ", 9, itype, count) + items


def _tensor(name: str, dims: list[int], qtype: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (_s(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", qtype, offset))


ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("flux")
SPARSE = {"array past the metadata cap": 1 << 24, "2^20 tensors, room for them": 25 << 20}  # zeros after
HOSTILE = {  # name -> (file bytes, words the message must hold)
    "array of 2^32 uint8": (_header([ARCH, _kv_array("tokenizer.ggml.scores", 0, 2**32)], []),
                            ["tokenizer.ggml.scores"]),
    "array of 2^32 strings": (_header([_kv_array("tokenizer.ggml.tokens", 8, 2**32, _s("a"))], []),
                              ["tokenizer.ggml.tokens"]),
    "array of 2^32 arrays": (_header([_kv_array("nested", 9, 2**32, struct.pack("<IQ", 0, 1) + b"x")], []),
                             ["nested"]),
    "inner array of 2^40": (_header([_kv_array("nested", 9, 1, struct.pack("<IQ", 4, 2**40))], []), ["nested"]),
    "array past the metadata cap": (_header([_kv_array("big", 0, 1 << 23)], []), ["big"]),
    "key of 2^60 bytes": (_header([struct.pack("<Q", 2**60) + b"general.name"], []), ["key of metadata field 0"]),
    "value string of 2^62 bytes": (_header([_s("general.name") + struct.pack("<IQ", 8, 2**62)], []),
                                   ["general.name"]),
    "2^40 key-values": (_header([ARCH], [], n_kv=2**40), ["key-value count"]),
    "2^40 tensors": (_header([ARCH], [], n_tensors=2**40), ["tensor count"]),
    "2^20 tensors, room for them": (_header([ARCH], [], n_tensors=1 << 20), ["tensor count"]),
    "2^31 dimensions": (_header([ARCH], [_tensor("img_in.weight", [], n_dims=2**31)]), ["img_in.weight"]),
    "dimensions past the file": (_header([ARCH], [_tensor("img_in.weight", [2**31, 2**31])]), ["img_in.weight"]),
    "offset past the file": (_header([ARCH], [_tensor("img_in.weight", [4], offset=2**50)]), ["img_in.weight"]),
    "unknown value type": (_header([_s("weird") + struct.pack("<I", 77)], []), ["weird"]),
    "bad alignment": (_header([_s("general.alignment") + struct.pack("<II", 4, 3)], []), ["general.alignment"]),
    "version 1": (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), ["version 1"]),
}

COUNTS = """
import sys, time
from pathlib import Path
import klein_core as kc
from klein_core.files.identify import probe

for path in sys.argv[1:]:
    t = time.perf_counter()
    for load in (kc.load_transformer, kc.load_text_encoder):
        try:
            load(path)
        except kc.WeightFormatError as exc:
            print(path, "|", str(exc).replace(chr(10), " "))
        else:
            raise SystemExit(f"{path} was loaded")
    assert probe(path).kind == "unknown"
    assert time.perf_counter() - t < 5, f"{path}: took {time.perf_counter() - t:.1f} s"
print("ok")
"""


def test_counts_beyond_the_file_are_refused_at_once(tmp_path):
    paths = {}
    for i, (name, (data, _)) in enumerate(HOSTILE.items()):
        paths[name] = tmp_path / f"hostile_{i}.gguf"
        paths[name].write_bytes(data)
        if name in SPARSE:  # room for what the counts claim, as a sparse file
            os.truncate(paths[name], SPARSE[name])
    assert len(HOSTILE["array of 2^32 uint8"][0]) < 176 + 8  # the issue's 176-byte file, or as small
    done = _child(COUNTS, *map(str, paths.values()), timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    messages = {}
    for line in done.stdout.splitlines():
        if " | " in line:
            p, msg = line.split(" | ", 1)
            messages.setdefault(p, msg)
    for name, (_, words) in HOSTILE.items():
        msg = messages[str(paths[name])]
        assert str(paths[name]) in msg and all(w in msg for w in words), (name, msg)


def test_a_valid_file_with_large_metadata_arrays_still_loads(tmp_path):
    path = write_gguf(tmp_path / "tok.gguf", {"img_in.weight": (torch.zeros(4, 32).numpy(), "F32")}, "flux",
                      {"tokenizer.ggml.tokens": [f"t{i}" for i in range(20000)],
                       "tokenizer.ggml.scores": [float(i) for i in range(20000)]})
    src = open_weights(path, component="weights")
    assert src.shape("img_in.weight") == (4, 32) and torch.equal(src.get("img_in.weight"), torch.zeros(4, 32))


# ----- 4. malformed metadata names the file and the field ----------------------------------------


def _flat_transformer(tmp_path, name: str, orig_shape) -> Path:
    """The tiny transformer with img_in.weight stored flattened (as ComfyUI-GGUF stores 5-D weights),
    its true shape in ``comfy.gguf.orig_shape.img_in.weight``."""
    sd = {k: v.float().numpy() for k, v in tiny_transformer().state_dict().items()}
    tensors = {k: (v.reshape(-1) if k == "img_in.weight" else v, "F16" if v.ndim > 1 else "F32")
               for k, v in sd.items()}
    fields = {} if orig_shape is None else {"comfy.gguf.orig_shape.img_in.weight": orig_shape}
    return write_gguf(tmp_path / name, tensors, "flux", fields)


def test_orig_shape_restores_a_flattened_tensor(tmp_path):
    shape = list(tiny_transformer().state_dict()["img_in.weight"].shape)
    model = kc.load_transformer(_flat_transformer(tmp_path, "ok.gguf", shape), dtype=torch.float32)
    assert list(model.img_in.weight.shape) == shape


@pytest.mark.parametrize("value", ["64,128", ["64", "128"], [1.5, 2.0], [3, 5], [-64, -128]])
def test_malformed_orig_shape_names_the_file_and_field(tmp_path, value):
    path = _flat_transformer(tmp_path, "bad.gguf", value)
    for call in (lambda: kc.load_transformer(path), lambda: open_weights(path, component="transformer")):
        with pytest.raises(kc.WeightFormatError) as exc:
            call()
        assert str(path) in str(exc.value) and "comfy.gguf.orig_shape.img_in.weight" in str(exc.value)
    assert probe(path).kind == "unknown"


def test_non_string_name_fields_are_named(tmp_path):
    path = write_gguf(tmp_path / "n.gguf", {"img_in.weight": (torch.zeros(4, 32).numpy(), "F32")}, "flux",
                      {"general.name": ["a", "b"]})
    with pytest.raises(kc.WeightFormatError, match="general.name") as exc:
        open_weights(path, component="transformer")
    assert str(path) in str(exc.value)


# ----- 5. a Qwen3 file whose architecture field says "flux" --------------------------------------


def test_a_qwen3_gguf_labelled_flux_loads_as_qwen3(tmp_path, caplog):
    """Its tensors are llama.cpp's Qwen3 names, which no Klein transformer uses: they decide, and the
    whole file is read in Hugging Face names (it was half renamed, then refused for a missing tensor)."""
    sd = {"model." + k: v.float().numpy() for k, v in tiny_text_encoder().state_dict().items()}
    tensors = {hf_to_llama(k): (v, "F32" if v.ndim == 1 else "Q8_0") for k, v in sd.items()}
    right = write_gguf(tmp_path / "qwen3.gguf", tensors, "qwen3")
    wrong = write_gguf(tmp_path / "labelled_flux.gguf", tensors, "flux")
    assert gguf.GGUFReader(wrong).get_field("general.architecture").contents() == "flux"
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING"):
        te = kc.load_text_encoder(wrong, dtype=torch.float32)
    assert any("general.architecture" in r.getMessage() and "flux" in r.getMessage() for r in caplog.records)
    ref = kc.load_text_encoder(right, dtype=torch.float32)
    assert torch.equal(te.encode(ids, torch.ones_like(ids)), ref.encode(ids, torch.ones_like(ids)))
    assert probe(wrong).kind == "text_encoder"
    with pytest.raises(ValueError, match="labelled_flux.gguf"):  # and as a transformer: named, not half read
        kc.load_transformer(wrong)
