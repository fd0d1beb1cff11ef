"""Every public Klein file loads: files with the exact headers of the published checkpoints.

The files are written from ``tests/data/real_layouts`` (see ``layout_files.py``) at their full size
but sparse, with zero data; they are loaded through the public loaders on the meta device, which
reads no tensor data (only fp8 scales and ComfyUI's small JSON markers), and through the checks the
loader node and the CLI make. Reading a file's header must never depend on its first bytes: the
official 4B fp8 file starts with 0x80, a pickle's first opcode.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from layout_files import header_bytes, manifests, write_layout, write_safetensors
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files import identify as catalog
from klein_core.files.safetensors import SafetensorsFile, open_safetensors
from klein_core.models import variants
from klein_core.quant.fp8 import fp8_layers

MANIFESTS = manifests()

# Published sizes (SPEC §1.1, §2.1): hidden, double blocks, single blocks, heads, text width.
KLEIN_4B = (3072, 5, 20, 24, 7680)
KLEIN_9B = (4096, 8, 24, 32, 12288)
TRANSFORMERS = {
    "bfl_flux-2-klein-4b": (KLEIN_4B, 0),
    "bfl_flux-2-klein-4b-fp8": (KLEIN_4B, 80),
    "bfl_flux-2-klein-base-4b-fp8": (KLEIN_4B, 78),  # two double-block Linears stay BF16
    "bfl_flux-2-klein-9b": (KLEIN_9B, 0),
    "bfl_flux-2-klein-9b-fp8": (KLEIN_9B, 112),
    "bfl_flux-2-klein-base-9b-fp8": (KLEIN_9B, 108),  # four stay BF16
    "synthetic_prefixed_klein-4b": (KLEIN_4B, 0),
    "diffusers_FLUX.2-klein-4B_transformer": (KLEIN_4B, 0),
    "diffusers_FLUX.2-klein-9B_transformer": (KLEIN_9B, 0),
}
QWEN_4B, QWEN_8B = ("Qwen3-4B", 2560, 7680), ("Qwen3-8B", 4096, 12288)
TEXT_ENCODERS = {
    "comfy_qwen_3_4b": QWEN_4B,
    "comfy_qwen_3_8b": QWEN_8B,
    "diffusers_FLUX.2-klein-4B_text_encoder": QWEN_4B,
    "diffusers_FLUX.2-klein-9B_text_encoder": QWEN_8B,
    **{stem: QWEN_8B for stem in MANIFESTS if stem.startswith("comfy_qwen_3_8b_fp8mixed")},
}
VAES = {  # stem -> layout klein_core reports
    "comfy_flux2-vae": "diffusers",  # ComfyUI's flux2-vae.safetensors is in the diffusers layout
    "diffusers_FLUX.2-klein_vae": "diffusers",
    "bfl_ae_FLUX.2-dev": "BFL",
    "synthetic_comfy_layout_vae": "BFL with top-level quant convs",
}


def test_every_manifest_is_covered():
    assert set(MANIFESTS) == set(TRANSFORMERS) | set(TEXT_ENCODERS) | set(VAES)
    pinned = {stem for stem, m in MANIFESTS.items() if m["size_match"] is True}
    assert len(pinned) == 9  # the published files whose exact byte size the layouts reproduce


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_layouts")
    return {stem: write_layout(stem, m, root) for stem, m in MANIFESTS.items()}


@pytest.fixture
def reads(monkeypatch):
    """Bytes of tensor data read from files while the test runs."""
    log: list[tuple[str, int]] = []
    real = SafetensorsFile.read

    def read(self, key):
        log.append((key, self.tensors[key].nbytes))
        return real(self, key)

    monkeypatch.setattr(SafetensorsFile, "read", read)
    return log


def test_the_official_fp8_file_starts_like_a_pickle(written):
    # The reason this test file exists: 36,480 = 0x8E80, so the first byte is 0x80.
    assert written["bfl_flux-2-klein-4b-fp8"].read_bytes()[:2] == b"\x80\x8e"
    assert open_safetensors(written["bfl_flux-2-klein-4b-fp8"]).header_bytes == 36480


@pytest.mark.parametrize("stem", sorted(TRANSFORMERS))
def test_transformer_layouts_load(written, reads, stem):
    (hidden, depth, single, heads, width), n_fp8 = TRANSFORMERS[stem]
    model = kc.load_transformer(written[stem], device="meta")
    c = model.config
    assert (c.hidden_size, c.depth, c.depth_single, c.num_heads, c.context_dim) == (hidden, depth, single, heads, width)
    assert c.variant == ("Klein 4B" if hidden == 3072 else "Klein 9B")
    assert len(fp8_layers(model)) == n_fp8
    assert sum(n for _, n in reads) < 4096  # only scalar fp8 scales were read, no weights
    if n_fp8:
        layer = model.get_submodule(fp8_layers(model)[0])
        assert layer.weight.dtype == torch.float8_e4m3fn and model.dtype == torch.bfloat16


@pytest.mark.parametrize("stem", sorted(TEXT_ENCODERS))
def test_text_encoder_layouts_load(written, reads, stem):
    variant, hidden, width = TEXT_ENCODERS[stem]
    model = kc.load_text_encoder(written[stem], device="meta")
    c = model.config
    assert (c.variant, c.hidden_size, c.text_dim, c.num_layers_in_file) == (variant, hidden, width, 36)
    # fp8 layers: the manifest's float8 Linears among the 27 layers Klein runs (counted independently).
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    expected = sum(1 for k, (_, dt) in MANIFESTS[stem]["tensors"].items() if k.endswith(".weight")
                   and dt.startswith("F8") and (m := layer.match(k)) and int(m.group(1)) < 27)
    assert len(fp8_layers(model)) == expected
    assert sum(n for _, n in reads) < 64 * 1024  # scales and comfy_quant markers only


@pytest.mark.parametrize("stem", sorted(VAES))
def test_vae_layouts_load(written, reads, stem, caplog):
    with caplog.at_level("INFO", logger="klein_core"):
        model = kc.load_vae(written[stem], device="meta")
    c = model.config
    assert c.z_channels == 32 and c.latent_channels == 128 and c.downscale == 16
    assert c.block_channels == (128, 256, 512, 512) and c.variant == "FLUX.2 VAE"
    assert f"({VAES[stem]} layout)" in caplog.text
    assert not reads


@pytest.mark.parametrize("stem", sorted(MANIFESTS))
def test_header_probe_names_each_file(written, stem):
    """The check the loader node and the CLI make before loading (safetensors header only)."""
    path = written[stem]
    if path.is_dir():
        pytest.skip("folders are loaded by path, not picked in a model folder")
    info = catalog.probe(path)
    if stem in TRANSFORMERS:
        assert (info.kind, info.text_width) == ("transformer", TRANSFORMERS[stem][0][4])
    elif stem in TEXT_ENCODERS:
        assert (info.kind, info.text_width) == ("text_encoder", TEXT_ENCODERS[stem][2])
    else:
        assert info.kind == "vae"


def test_loader_node_accepts_the_public_files(comfy_pack, written, monkeypatch):
    """Klein Model Loader's and the encoder node's file check, with the files in ComfyUI model folders."""
    import importlib

    common = importlib.import_module(f"{comfy_pack.pack.__name__}.common")
    folder_paths = comfy_pack.folder_paths
    kinds = {"transformer": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}
    checked = 0
    for stem, path in written.items():
        if path.is_dir():
            continue
        kind = "transformer" if stem in TRANSFORMERS else "text_encoder" if stem in TEXT_ENCODERS else "vae"
        folder = kinds[kind]
        monkeypatch.setitem(folder_paths.folder_names_and_paths, folder,
                            ([str(path.parent)], folder_paths.supported_pt_extensions))
        folder_paths.filename_list_cache.clear()
        assert common.model_file("Klein Model Loader", "model_name", folder, path.name, expect=kind) == str(path)
        checked += 1
    folder_paths.filename_list_cache.clear()
    assert checked == 18  # every manifest but the 4 sharded Hugging Face folders


# ---------------------------------------------------------------------------------------------
# The sweep: one valid file, every way its first bytes can fall


def _rewrite_with_header_length(src: Path, dst: Path, length: int) -> None:
    """``src`` re-written with its header padded with spaces to ``length`` bytes (same tensors)."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].rstrip(b" ")
    assert length >= len(header)
    dst.write_bytes(struct.pack("<Q", length) + header + b" " * (length - len(header)) + raw[8 + n :])


def _sweep_lengths(minimum: int) -> dict[str, int]:
    out = {}
    for residue in range(0, 256, 8):  # safetensors pads headers to multiples of 8: 32 first bytes
        length = residue + 256 * (minimum // 256 + 1)
        out[f"first byte 0x{residue:02x}"] = length
    # Header lengths whose first two bytes read "PK" (zip) and "GG" (GGUF's magic).
    out["PK"] = 0x4B50 if 0x4B50 >= minimum else 0x4B50 + 65536
    out["GG"] = 0x4747 if 0x4747 >= minimum else 0x4747 + 65536
    return out


@pytest.mark.parametrize("component", ["transformer", "LoRA"])
def test_header_length_sweep(tmp_path, component):
    from klein_core.testing import tiny_transformer

    if component == "transformer":
        state = tiny_transformer().state_dict()
        load = lambda p: kc.load_transformer(p).state_dict()  # noqa: E731
    else:
        state = {"transformer.single_transformer_blocks.0.attn.to_out.lora_A.weight": torch.randn(4, 192),
                 "transformer.single_transformer_blocks.0.attn.to_out.lora_B.weight": torch.randn(64, 4)}
        load = lambda p: {f"{i}.{k}": t for i, patch in enumerate(kc.load_lora(p).patches)  # noqa: E731
                          for k, t in patch.tensors.items()}
    original = tmp_path / "original.safetensors"
    save_file(state, original)
    reference = load(original)
    (n,) = struct.unpack("<Q", original.read_bytes()[:8])
    lengths = _sweep_lengths(n)
    assert len(lengths) == 34
    for label, length in lengths.items():
        path = tmp_path / f"swept_{length}.safetensors"
        _rewrite_with_header_length(original, path, length)
        head = path.read_bytes()[:2]
        if label in ("PK", "GG"):
            assert head == label.encode()
        else:
            assert head[0] == int(label[-2:], 16)
        got = load(path)
        assert got.keys() == reference.keys(), label
        for k in reference:
            assert torch.equal(got[k], reference[k]), (label, k)


def test_refused_only_for_what_they_are(tmp_path):
    """Not safetensors: named by content; a safetensors file named .pt still loads."""
    import pickle
    import zipfile

    from klein_core.testing import tiny_vae

    (tmp_path / "p.safetensors").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with zipfile.ZipFile(tmp_path / "z.safetensors", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"a": 1}))
    (tmp_path / "g.safetensors").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    for name, match in (("p", "Python pickle"), ("z", "zipped PyTorch checkpoint"), ("g", "GGUF")):
        with pytest.raises(kc.WeightFormatError, match=match):
            kc.load_vae(tmp_path / f"{name}.safetensors")
    save_file(tiny_vae().state_dict(), tmp_path / "vae.pt")  # valid safetensors, odd suffix
    assert kc.load_vae(tmp_path / "vae.pt").config.z_channels == 32


def test_header_bytes_match_the_writer(tmp_path):
    """layout_files serialises headers exactly as safetensors does (so the manifests' lengths hold)."""
    state = {"b.weight": torch.zeros(3, 2, dtype=torch.bfloat16), "a.scale": torch.zeros((), dtype=torch.float32),
             "c": torch.zeros(5, dtype=torch.uint8)}
    save_file(state, tmp_path / "real.safetensors", metadata={"format": "pt"})
    raw = (tmp_path / "real.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}
    ours, _ = header_bytes({k: [list(v.shape), dtypes[v.dtype]] for k, v in state.items()}, {"format": "pt"})
    assert json.loads(ours) == json.loads(raw[8 : 8 + n]) and len(ours) == n
    write_safetensors(tmp_path / "ours.safetensors", {k: [list(v.shape), dtypes[v.dtype]] for k, v in state.items()},
                      {"format": "pt"})
    assert (tmp_path / "ours.safetensors").stat().st_size == len(raw)


@pytest.mark.parametrize("variant, transformer, encoder", [
    (variants.KLEIN_4B, "bfl_flux-2-klein-4b", "comfy_qwen_3_4b"),
    (variants.KLEIN_9B, "bfl_flux-2-klein-9b", "comfy_qwen_3_8b")])
def test_full_size_configs_are_the_published_shapes(variant, transformer, encoder):
    """The benchmarks and the GPU tests build their full-size random models from these configs."""
    from klein_core.testing.fill import full_size_configs

    class Shapes(dict):  # the ShapeSource protocol over a manifest: names and shapes, no data
        name = encoder

        def shape(self, key: str) -> tuple[int, ...]:
            return self[key]

    tr, te, _ = full_size_configs(variant)
    shapes = {k: tuple(v[0]) for k, v in MANIFESTS[transformer]["tensors"].items()}
    assert tr == kc.TransformerConfig.from_shapes(shapes)
    assert te == kc.Qwen3Config.from_source(Shapes({k: tuple(v[0]) for k, v in MANIFESTS[encoder]["tensors"].items()}))
