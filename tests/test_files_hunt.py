"""Regressions found hunting bugs in the model-file loaders (klein_core/files)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

import klein_core as kc
from klein_core.testing import tiny_transformer

SHARDS = ("diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors")
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _sharded_transformer(folder):
    """A tiny transformer in the diffusers layout, in two shards; returns (reference state, weight_map)."""
    from klein_core.files.transformer_layout import bfl_to_diffusers

    model = tiny_transformer()
    sd = {k: v.contiguous() for k, v in bfl_to_diffusers(model.state_dict(), model.config).items()}
    keys = sorted(sd)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    folder.mkdir(parents=True)
    weight_map = {}
    for shard, part in zip(SHARDS, halves):
        save_file({k: sd[k] for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map |= {k: shard for k in part}
    return model.state_dict(), weight_map, halves


def _write_index(folder, weight_map):
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_listing_a_tensor_under_another_shard_still_loads(tmp_path, caplog):
    """diffusers and transformers read every shard whole, so an index whose weight_map puts a tensor
    under the wrong shard loads there; it was refused as "not in the shards", which was untrue."""
    folder = tmp_path / "repo" / "transformer"
    reference, weight_map, halves = _sharded_transformer(folder)
    moved = halves[0][0]  # stored in shard 1, listed under shard 2
    weight_map[moved] = SHARDS[1]
    _write_index(folder, weight_map)
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        model = kc.load_transformer(tmp_path / "repo")
    got = model.state_dict()
    assert got.keys() == reference.keys()
    for k in reference:
        assert torch.equal(got[k], reference[k]), k
    assert moved in caplog.text and SHARDS[0] in caplog.text


def test_index_listing_a_tensor_no_shard_holds_names_it_and_its_shard(tmp_path):
    folder = tmp_path / "transformer"
    _, weight_map, _ = _sharded_transformer(folder)
    weight_map["transformer_blocks.0.attn.lost.weight"] = SHARDS[1]
    _write_index(folder, weight_map)
    with pytest.raises(kc.WeightFormatError, match=r"no shard holds .*'transformer_blocks\.0\.attn\.lost\.weight' in "
                                                   r"diffusion_pytorch_model-00002-of-00002\.safetensors"):
        kc.load_transformer(folder)
