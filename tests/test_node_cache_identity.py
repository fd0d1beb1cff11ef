"""The pack's model cache (nodes/cache.py) beyond its happy path: a model file replaced under the same
name must be loaded again, not served from the cache (the file's modification time is part of the
key); the unchanged file is served without a reload."""

from __future__ import annotations

import importlib
import os

import torch
from safetensors.torch import save_file

from klein_core.testing.tiny import tiny_vae


def _write_vae(path, seed: int) -> None:
    save_file({k: v.contiguous() for k, v in tiny_vae(seed).state_dict().items()}, str(path))


def test_a_replaced_model_file_is_loaded_again(comfy_pack, tmp_path):
    cache = importlib.import_module(f"{comfy_pack.pack.__name__}.cache")
    path = tmp_path / "flux2-vae.safetensors"
    _write_vae(path, seed=0)

    def get():
        return cache.acquire(cache.model_ref("vae", str(path), path.name, torch.device("cpu"), torch.float32))

    try:
        first = get()
        loads = cache.loads["vae"]
        before = {k: v.clone() for k, v in first.state_dict().items()}
        assert get() is first and cache.loads["vae"] == loads  # unchanged file: served from the cache
        mtime = path.stat().st_mtime_ns
        _write_vae(path, seed=1)  # another VAE under the same name
        os.utime(path, ns=(mtime + 2_000_000_000, mtime + 2_000_000_000))  # newer, whatever the clock
        again = get()
        assert cache.loads["vae"] == loads + 1, "the replaced file was served from the cache"
        after = again.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "the old weights are still in use"
    finally:
        cache.release_all("test_node_cache_identity done")
