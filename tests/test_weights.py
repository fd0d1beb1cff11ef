"""The weight-source layer: header validation, folders and shards, plans, strict materialisation."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from klein_core.errors import WeightFormatError
from klein_core.files.key_map import Cat, KeyMap, Reshape, SwapHalves, Take, build_key_map
from klein_core.files.materialize import materialize
from klein_core.files.opening import open_weights
from klein_core.files.source import read_safetensors_header


def _write_raw(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_header_read_without_data(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "x.safetensors",
              metadata={"k": "v"})
    tensors, meta = read_safetensors_header(tmp_path / "x.safetensors")
    assert tensors["a"].shape == (2, 3) and tensors["b"].dtype == torch.bfloat16 and meta == {"k": "v"}


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: p.write_bytes(b"abc"), "only 3 bytes"),
        (lambda p: p.write_bytes(struct.pack("<Q", 10**12) + b"{}"), "header claims"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"nope"), "not valid JSON"),
        (lambda p: _write_raw(p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
         "points outside the file"),
        (lambda p: _write_raw(p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 16),
         "wrong byte size"),
        (lambda p: _write_raw(p, {"t": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
         "unsupported dtype"),
        (lambda p: _write_raw(p, {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "negative"),
        (lambda p: _write_raw(p, {"t": {"shape": [1]}}), "malformed"),
        (lambda p: _write_raw(p, [1, 2]), "not a JSON object"),
    ],
)
def test_corrupt_headers_are_named(tmp_path, make, match):
    p = tmp_path / "bad.safetensors"
    make(p)
    with pytest.raises(WeightFormatError, match=match) as exc:
        open_weights(p, component="VAE")
    assert str(p) in str(exc.value)


def test_truncated_real_file(tmp_path):
    p = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(64, 64)}, p)
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(WeightFormatError, match="truncated"):
        open_weights(p, component="transformer")


def test_refuses_pickles_gguf_and_quantised(tmp_path):
    for name, data, match in [("m.pt", b"\x80\x04", "pickles"), ("m.bin", b"PK\x03\x04", "pickles"),
                              ("m.gguf", b"GGUF", "GGUF"), ("m.safetensors", b"GGUF....", "GGUF"),
                              ("m2.safetensors", b"PK\x03\x04junk", "pickled")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(WeightFormatError, match=match):
            open_weights(tmp_path / name, component="transformer")
    for extra, match in [({"x.scale_weight": torch.ones(1)}, "scaled_fp8"),
                         ({"x.weight_scale_2": torch.ones(1)}, "NVFP4 layer 'x' lacks"),
                         ({"x.weight_scale": torch.ones(1)}, "weight_scale")]:
        with pytest.raises(WeightFormatError, match=match):  # scales without a weight, nvfp4
            open_weights({"a": torch.zeros(1), **extra}, component="transformer")
    # fp8 files load (issue 6): plain float8 opens as stored, scale 1 (tests/test_quant.py has the rest).
    src = open_weights({"a": torch.zeros(1), "x.weight": torch.zeros(2, dtype=torch.float8_e4m3fn)},
                       component="transformer")
    assert src.dtype("x.weight") == torch.float8_e4m3fn
    with pytest.raises(FileNotFoundError):
        open_weights(tmp_path / "absent.safetensors", component="VAE")
    with pytest.raises(WeightFormatError, match="no tensors"):
        open_weights({}, component="VAE")


def test_folder_shards_index_and_subfolder(tmp_path):
    repo = tmp_path / "repo" / "transformer"
    repo.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, repo / "m-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, repo / "m-00002-of-00002.safetensors")
    idx = {"weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}}
    (repo / "m.safetensors.index.json").write_text(json.dumps(idx))
    src = open_weights(tmp_path / "repo", component="transformer", subfolder="transformer")
    assert sorted(src.keys()) == ["a", "b"] and torch.equal(src.get("b"), torch.zeros(3))
    (repo / "m-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightFormatError, match="missing"):
        open_weights(tmp_path / "repo", component="transformer", subfolder="transformer")
    with pytest.raises(WeightFormatError, match="no .safetensors"):
        open_weights(tmp_path, component="VAE")


def test_ops_shapes_without_reading():
    reads = []
    sd = {"q": torch.randn(2, 3), "k": torch.randn(2, 3), "f": torch.randn(4, 3), "c": torch.randn(5, 5, 1, 1)}
    src = open_weights(sd, component="x")
    orig = src._reader
    src._reader = lambda k: (reads.append(k), orig(k))[1]
    assert Cat(("q", "k")).shape(src) == (4, 3) and SwapHalves("f").shape(src) == (4, 3)
    assert Reshape("c", (5, 5)).shape(src) == (5, 5) and Reshape("c", (6, 5)).shape(src) == (-1,)
    assert reads == []
    assert torch.equal(SwapHalves("f").load(src), torch.cat([sd["f"][2:], sd["f"][:2]]))
    assert torch.equal(Cat(("q", "k")).load(src), torch.cat([sd["q"], sd["k"]]))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, bias=False)
        self.norm = nn.LayerNorm(2)


def test_materialize_strict_and_dtype():
    sd = {"lin.weight": torch.randn(2, 3), "norm.weight": torch.ones(2, dtype=torch.bfloat16),
          "norm.bias": torch.zeros(2, dtype=torch.bfloat16)}
    src = open_weights(sd, component="tiny")
    plan = build_key_map(src, lambda k: k)
    m = materialize(_Tiny, plan, src, component="tiny")
    assert {p.dtype for p in m.parameters()} == {torch.float32}  # mixed file -> one dtype (the dominant)
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    m = materialize(_Tiny, plan, src, component="tiny", dtype=torch.bfloat16, keep_fp32=lambda n: n.startswith("norm"))
    assert m.lin.weight.dtype == torch.bfloat16 and m.norm.weight.dtype == torch.float32
    bad = dict(sd, **{"lin.weight": torch.randn(2, 4)})
    src = open_weights(bad, component="tiny")
    with pytest.raises(ValueError, match=r"lin\.weight \(file \[2, 4\], model \[2, 3\]\)"):
        materialize(_Tiny, build_key_map(src, lambda k: k), src, component="tiny")
    with pytest.raises(ValueError, match="Missing 1 tensors: 'norm.bias'"):
        partial = {k: v for k, v in sd.items() if k != "norm.bias"}
        s2 = open_weights(partial, component="tiny")
        materialize(_Tiny, build_key_map(s2, lambda k: k), s2, component="tiny")


def test_duplicate_targets_refused():
    src = open_weights({"quant_conv.weight": torch.ones(1), "encoder.quant_conv.weight": torch.ones(1)},
                       component="VAE")
    with pytest.raises(ValueError, match="two copies"):
        build_key_map(src, lambda k: k.replace("encoder.", ""))
    assert isinstance(KeyMap().ops, dict) and Take("a").sources() == ["a"]
