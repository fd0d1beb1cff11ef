"""The model kind (distilled, base, Klein 9B-KV) guessed from what lies where the transformer is: its
file name, and for a diffusers repo its model_index.json and its folder's name. Explicit choices win."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import klein_core as kc
from klein_core import cli
from klein_core.pipeline.engine import Engine
from klein_core.pipeline.request import guess_model_kind
from klein_core.testing import write_tiny_model_files


@pytest.mark.parametrize("name, kind", [
    # plain file names: as before
    ("flux-2-klein-4b.safetensors", "distilled"),
    ("flux-2-klein-9b-fp8.safetensors", "distilled"),
    ("flux-2-klein-base-4b.safetensors", "base"),
    ("flux-2-klein-base-9b-fp8.safetensors", "base"),
    ("flux-2-klein-9b-kv.safetensors", "kv"),
    ("flux-2-klein-9b-kv-fp8.safetensors", "kv"),
    ("Flux2-Klein-9B-KV-Q8_0.gguf", "kv"),
    ("kvasir-klein.safetensors", "distilled"),  # "kv" only as a word of its own
    ("klein/flux-2-klein-4b.safetensors", "distilled"),
    ("/base/kv/models/diffusion_models/flux-2-klein-4b.safetensors", "distilled"),  # other folders: not read
    ("/models/base/flux-2-klein-9b-kv.safetensors", "kv"),
    ("", "distilled"),
    ("<in-memory transformer state dict>", "distilled"),
    # diffusers layouts: the repo folder's name (the parent of transformer/)
    ("FLUX.2-klein-9b-kv/transformer/diffusion_pytorch_model.safetensors", "kv"),
    ("/hf/FLUX.2-klein-9b-kv/transformer/diffusion_pytorch_model-00001-of-00002.safetensors", "kv"),
    ("/hf/FLUX.2-klein-9b-kv/transformer", "kv"),
    ("/hf/FLUX.2-klein-9b-kv/transformer/", "kv"),
    ("/hf/FLUX.2-klein-base-9B/transformer/diffusion_pytorch_model-00002-of-00002.safetensors", "base"),
    ("/hf/FLUX.2-klein-4B/transformer/diffusion_pytorch_model.safetensors", "distilled"),
    ("/hf/FLUX.2-klein-9B/transformer", "distilled"),
    ("/cache/hub/models--black-forest-labs--FLUX.2-klein-9b-kv/snapshots/0123abcd/transformer/"
     "diffusion_pytorch_model-00001-of-00002.safetensors", "kv"),
    ("/cache/hub/models--black-forest-labs--FLUX.2-klein-base-4B/snapshots/0123abcd/transformer", "base"),
    ("/cache/hub/models--black-forest-labs--FLUX.2-klein-4B/snapshots/0123abcd/transformer", "distilled"),
    ("/data/database/transformer/diffusion_pytorch_model.safetensors", "distilled"),  # "base" as a word only
])
def test_names(name, kind):
    assert guess_model_kind(name) == kind
    assert guess_model_kind(Path(name)) == kind


def _repo(root: Path, model_index: dict | str | None, sharded: bool = False) -> Path:
    """A diffusers repo skeleton: model_index.json and a transformer/ folder (weights not needed)."""
    tr = root / "transformer"
    tr.mkdir(parents=True)
    (tr / "config.json").write_text(json.dumps({"_class_name": "Flux2Transformer2DModel", "num_layers": 8}))
    if sharded:
        (tr / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {}}')
    if model_index is not None:
        (root / "model_index.json").write_text(model_index if isinstance(model_index, str) else json.dumps(model_index))
    return root


KV_INDEX = {"_class_name": "Flux2KleinKVPipeline", "_diffusers_version": "0.37.0",
            "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}


@pytest.mark.parametrize("index, kind", [
    (KV_INDEX, "kv"),
    ({"_class_name": "Flux2KleinPipeline", "is_distilled": False}, "base"),
    ({"_class_name": "Flux2KleinPipeline", "is_distilled": True}, "distilled"),
])
def test_model_index_says_the_kind_whatever_the_folder_is_called(tmp_path, index, kind):
    root = _repo(tmp_path / "my-klein", index, sharded=True)
    for source in (root / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors",
                   root / "transformer", str(root / "transformer") + os.sep, root):
        assert guess_model_kind(source) == kind, source
    assert guess_model_kind(str(root / "transformer")) == kind


def test_model_index_wins_over_the_folder_name(tmp_path):
    root = _repo(tmp_path / "FLUX.2-klein-base-9B", {"_class_name": "Flux2KleinPipeline", "is_distilled": True})
    assert guess_model_kind(root / "transformer") == "distilled"


@pytest.mark.parametrize("index", [None, "{not json", "[1, 2]", '{"_class_name": "Flux2KleinPipeline"}', "\xff"])
def test_silent_or_broken_model_index_falls_back_to_the_names(tmp_path, index):
    root = _repo(tmp_path / "FLUX.2-klein-9b-kv", index)
    assert guess_model_kind(root / "transformer") == "kv"
    other = _repo(tmp_path / "klein", index)
    assert guess_model_kind(other / "transformer") == "distilled"


def test_odd_model_index_never_raises(tmp_path):
    root = tmp_path / "FLUX.2-klein-9b-kv"
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").mkdir()  # a folder, not a file
    assert guess_model_kind(root / "transformer") == "kv"
    fifo = tmp_path / "r" / "model_index.json"
    if hasattr(os, "mkfifo"):
        (tmp_path / "r" / "transformer").mkdir(parents=True)
        os.mkfifo(fifo)  # opening it would wait forever: it is not read
        assert guess_model_kind(tmp_path / "r" / "transformer") == "distilled"
    assert guess_model_kind("a\0b/transformer/x.safetensors") == "distilled"


# -- through the loaders, the engine and the command line -------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kind")
    paths = write_tiny_model_files(d)
    # A diffusers-layout KV repo: the tiny 9B transformer in two shards with an index, no "kv" in any file name.
    repo = d / "FLUX.2-klein-9b-kv"
    tr = repo / "transformer"
    tr.mkdir(parents=True)
    state = load_file(paths["klein_9b_kv"])
    keys = sorted(state)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:]), 1):
        name = f"diffusion_pytorch_model-0000{i}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, tr / name)
        weight_map.update({k: name for k in part})
    (tr / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # The same weights in a single file, in a repo whose only hint is its model_index.json.
    other = d / "my-klein" / "transformer"
    other.mkdir(parents=True)
    save_file(state, other / "diffusion_pytorch_model.safetensors")
    (d / "my-klein" / "model_index.json").write_text(json.dumps(KV_INDEX))
    return paths, repo, d / "my-klein"


def test_engine_reads_the_kind_of_a_diffusers_kv_folder(files):
    paths, repo, other = files
    for source in (repo, repo / "transformer", other, other / "transformer" / "diffusion_pytorch_model.safetensors"):
        transformer = kc.load_transformer(source, dtype=torch.float32)
        engine = Engine(transformer)
        assert engine.kind == "kv" and engine.ref_mode == "kv", (source, transformer.source)
        chosen = Engine(transformer, kind="distilled", ref_mode="joint")  # explicit choices win
        assert chosen.kind == "distilled" and chosen.ref_mode == "joint"
        assert Engine(transformer, kind="base").ref_mode == "joint"


def _args(paths, transformer, tmp_path, *extra):
    return ["--transformer", str(transformer), "--text-encoder", str(paths["qwen_8b"]), "--vae", str(paths["vae"]),
            "--prompt", "x", "--width", "64", "--height", "64", "--steps", "1", "--out", str(tmp_path / "o.png"),
            "-q", *extra]


class _Stop(Exception):
    pass


def test_cli_runs_a_diffusers_kv_folder_in_kv_mode(files, tmp_path):
    """A sharded diffusers folder loads and runs as Klein 9B-KV (tests/test_cli.py runs KV with references)."""
    paths, repo, _ = files
    assert cli.main(_args(paths, repo / "transformer", tmp_path)) == 0
    meta = json.loads(Image.open(tmp_path / "o.png").text["parameters"])
    assert meta["ref_mode"] == "kv" and meta["model_kind"] == "kv" and meta["guidance"] == 1.0


@pytest.mark.parametrize("where, extra, distilled, ref_mode", [
    ("repo", (), True, "kv"),
    ("repo/transformer", (), True, "kv"),
    ("other/file", (), True, "kv"),
    ("repo/transformer", ("--ref-mode", "joint"), True, "joint"),  # the user's choices win
    ("repo/transformer", ("--base",), False, "kv"),
])
def test_cli_choices_for_a_diffusers_kv_folder(files, tmp_path, monkeypatch, where, extra, distilled, ref_mode):
    paths, repo, other = files
    source = {"repo": repo, "repo/transformer": repo / "transformer",
              "other/file": other / "transformer" / "diffusion_pytorch_model.safetensors"}[where]
    seen = {}

    def generate(*args, **kwargs):  # what the command line asks the engine for; the run itself is not needed
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(cli, "generate", generate)
    with pytest.raises(_Stop):
        cli.main(_args(paths, source, tmp_path, *extra))
    assert seen["kind"] == ("kv" if distilled else "base") and seen["ref_mode"] == ref_mode
