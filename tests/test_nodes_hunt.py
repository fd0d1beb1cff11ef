"""Node bugs found by hunting, each pinned by a test that failed before its fix.

* A model file replaced under the same name must change ComfyUI's cache key of the loader, the
  encoder and every node after them (the host's own signature code decides, as when a prompt is
  queued); an untouched file must leave the keys as they were.
* The latent's ``noise_mask`` (core Set Latent Noise Mask) inpaints as the sampler's mask input does.
* Native CONDITIONING options that ComfyUI's samplers apply and the Klein Sampler cannot
  (timestep range, area, strength...) are refused by name instead of being ignored.
* Latent and mask batches that do not fit batch_size are refused naming the node, input and fix.

Nodes run in ComfyUI 0.3.75's modules with tiny models (the ``comfy`` fixture of test_nodes.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from test_nodes import M4B, Q4B, VAE, _encode, _load, comfy  # noqa: F401 (fixture)


def _core_nodes():
    """ComfyUI's own ``nodes.py`` (its core nodes and NODE_CLASS_MAPPINGS), loaded by path: in the
    tests the name ``nodes`` is this repository's package."""
    name = "klein_hunt_comfy_core_nodes"
    if name not in sys.modules:
        import folder_paths  # a module at the top of ComfyUI's folder, next to nodes.py

        spec = importlib.util.spec_from_file_location(name, Path(folder_paths.__file__).parent / "nodes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _sample(comfy, model, cond, **kw):  # noqa: F811
    args = {"width": 0, "height": 0, "steps": 1, "guidance": 0.0, "seed": 7, "batch_size": 1, **kw}
    with torch.inference_mode():
        return comfy.pack.KleinSampler.execute(model, cond, **args).args[0]["samples"]


# ----- cache identity: files replaced under the same name -------------------------------------------------

GRAPH = {
    "1": {"class_type": "KleinModelLoader", "inputs": {
        "model_name": M4B, "vae_name": VAE, "weight_dtype": "bf16", "model_kind": "auto", "memory_mode": "auto",
        "speed": "fast"}},
    "2": {"class_type": "KleinTextEncode", "inputs": {
        "text_encoder": Q4B, "prompt": "a red fox", "negative_prompt": "", "precision": "model dtype",
        "max_tokens": "512", "lora_name": "none", "lora_strength": 1.0, "speed": "fast"}},
    "3": {"class_type": "KleinSampler", "inputs": {
        "model": ["1", 0], "conditioning": ["2", 0], "width": 64, "height": 64, "steps": 1, "guidance": 0.0,
        "seed": 1, "batch_size": 1}},
    "4": {"class_type": "KleinVAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 1]}},
}


def _cache_keys(comfy, monkeypatch) -> dict[str, object]:  # noqa: F811
    """ComfyUI's output-cache key of every node of GRAPH, computed by the host's own code (the
    fingerprints included) as it does when the prompt is queued: equal keys = cached output reused."""
    import copy

    nodes = _core_nodes()
    monkeypatch.setitem(sys.modules, "nodes", nodes)  # what the host's modules import as nodes
    import execution
    from comfy_execution import caching
    from comfy_execution.caching import CacheKeySetInputSignature
    from comfy_execution.graph import DynamicPrompt

    monkeypatch.setattr(execution, "nodes", nodes)
    monkeypatch.setattr(caching, "nodes", nodes)
    for node in comfy.pack.NODES:
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.define_schema().node_id, node)
    prompt = DynamicPrompt(copy.deepcopy(GRAPH))

    async def keys():
        changed = execution.IsChangedCache("hunt", prompt, None)
        key_set = CacheKeySetInputSignature(prompt, list(GRAPH), changed)
        await key_set.add_keys(list(GRAPH))
        return {node_id: key_set.get_data_key(node_id) for node_id in GRAPH}

    return asyncio.run(keys())


def _touch(path, seconds: int) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


@pytest.mark.parametrize("file, first", [("klein_4b", "1"), ("vae", "1"), ("qwen_4b", "2")])
def test_a_replaced_model_file_changes_the_cache_key_of_its_node_and_all_after_it(comfy, monkeypatch, file, first):  # noqa: F811
    before = _cache_keys(comfy, monkeypatch)
    assert _cache_keys(comfy, monkeypatch) == before  # unchanged files: every output may be reused
    path = comfy.paths[file]
    _touch(path, 5)  # a new file under the same name (a re-download, a conversion)
    try:
        after = _cache_keys(comfy, monkeypatch)
    finally:
        _touch(path, -5)
    stale = [n for n in (first, "3", "4") if after[n] == before[n]]
    assert not stale, f"nodes {stale} would serve their cached output made from the old {path.name}"
    untouched = {"1": "2", "2": "1"}[first]  # the other branch does not read the file
    assert after[untouched] == before[untouched]


def test_a_deleted_model_file_is_fingerprinted_without_raising(comfy):  # noqa: F811
    loader = comfy.pack.KleinModelLoader
    assert loader.fingerprint_inputs(model_name="gone.safetensors", vae_name=VAE)[0] == ("gone.safetensors", None, None)


# ----- Set Latent Noise Mask ----------------------------------------------------------------------------


def test_the_latents_noise_mask_inpaints_like_the_mask_input(comfy):  # noqa: F811
    nodes = _core_nodes()
    model, vae = _load(comfy)
    cond = _encode(comfy)
    with torch.inference_mode():
        image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
        latent = comfy.pack.KleinVAEEncode.execute(image, vae).args[0]
    mask = torch.zeros(1, 64, 64)
    mask[:, :, 32:] = 1.0  # repaint the right half
    (masked_latent,) = nodes.SetLatentNoiseMask().set_mask(latent, mask)
    with_input = _sample(comfy, model, cond, latent=latent, mask=mask)
    with_noise_mask = _sample(comfy, model, cond, latent=masked_latent)
    unmasked = _sample(comfy, model, cond, latent=latent)
    assert not torch.equal(with_input, unmasked)
    assert torch.equal(with_noise_mask, with_input), "Set Latent Noise Mask's mask was ignored"
    with pytest.raises(ValueError, match=r"Klein Sampler: latent's noise_mask \(Set Latent Noise Mask\): .*empty"):
        _sample(comfy, model, cond, latent=nodes.SetLatentNoiseMask().set_mask(latent, torch.zeros(1, 64, 64))[0])


# ----- native conditioning options ---------------------------------------------------------------------


@pytest.mark.parametrize("node, args, option", [
    ("ConditioningSetTimestepRange", {"start": 0.5, "end": 1.0}, "start_percent"),
    ("ConditioningSetAreaStrength", {"strength": 0.2}, "strength"),
    ("ConditioningSetAreaPercentage", {"width": 0.5, "height": 0.5, "x": 0.0, "y": 0.0, "strength": 1.0}, "area"),
])
def test_conditioning_options_the_sampler_cannot_apply_are_refused(comfy, node, args, option):  # noqa: F811
    nodes = _core_nodes()
    model, _ = _load(comfy)
    with torch.inference_mode():
        positive = comfy.pack.KleinTextEncode.execute(Q4B, "a red fox", "").args[1]
    core = nodes.NODE_CLASS_MAPPINGS[node]()
    (changed,) = getattr(core, core.FUNCTION)(positive, **args)
    with pytest.raises(ValueError, match=rf"Klein Sampler: conditioning has '{option}' .* \(set by .*{node}"):
        _sample(comfy, model, changed, width=64, height=64)
    with pytest.raises(ValueError, match=rf"Klein Sampler: negative has '{option}'"):
        _sample(comfy, model, positive, width=64, height=64, negative=changed)
    # the node's defaults change nothing, so they are accepted and sample as without the node
    (full_range,) = nodes.ConditioningSetTimestepRange().set_range(positive, 0.0, 1.0)
    assert torch.equal(_sample(comfy, model, full_range, width=64, height=64),
                       _sample(comfy, model, positive, width=64, height=64))


# ----- batches ------------------------------------------------------------------------------------------


def test_latent_and_mask_batches_that_do_not_fit_are_refused_by_input(comfy):  # noqa: F811
    model, _ = _load(comfy)
    cond = _encode(comfy)
    latent = {"samples": torch.randn(2, 128, 4, 4)}
    with pytest.raises(ValueError, match=r"Klein Sampler: latent holds 2 images but batch_size is 1: set "
                                         r"batch_size to 2"):
        _sample(comfy, model, cond, latent=latent, denoise=0.5)
    masks = torch.ones(3, 64, 64)
    with pytest.raises(ValueError, match=r"Klein Sampler: mask holds 3 masks for 2 output image\(s\)"):
        _sample(comfy, model, cond, latent=latent, mask=masks, batch_size=2)
    out = _sample(comfy, model, cond, latent=latent, denoise=0.5, batch_size=2)  # the fix the message names
    assert out.shape == (2, 128, 4, 4)
