"""Resource leak and unbounded growth hunt: a long ComfyUI session or a Ray Serve replica that runs
for days must not leak.

What is checked here, with tiny random models on the CPU:

* models kept alive after their owner let them go: weak registries whose values hold their own key
  (merged LoRAs), LoRA copies that hold the model they were made from;
* files kept open or memory-mapped after a read (a mapping keeps the file busy on Windows, follows
  any rewrite of the file, and kills the process with SIGBUS when the file is cut short);
* Pinned: weight loads (good and failed) leave no descriptor or mapping behind; a generation and a
  cancelled one leave the models collectable and no thread running.

The node test runs inside the real ComfyUI 0.3.75 modules (the ``comfy_pack`` fixture of conftest.py).
"""

from __future__ import annotations

import gc
import importlib
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch
from gguf_files import write_tiny_gguf_transformer
from PIL import Image
from safetensors.torch import save_file

import klein_core as kc
from klein_core.accel.speed import apply_speed
from klein_core.errors import GenerationCancelled
from klein_core.lora import load_lora
from klein_core.testing import build_tiny_components, tiny_transformer, write_tiny_model_files
from klein_core.train.data import TensorCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: threads only contend

PACK = "klein_pack_nodes"  # how the comfy_pack fixture (conftest.py) imports nodes/


def _lora() -> kc.LoRA:
    """A rank-4 LoRA on one linear of the tiny 4B transformer (in memory)."""
    g = torch.Generator().manual_seed(5)
    return load_lora({"transformer.single_blocks.0.linear1.lora_A.weight": torch.randn(4, 64, generator=g),
                      "transformer.single_blocks.0.linear1.lora_B.weight": torch.randn(576, 4, generator=g)})


def _open_files() -> set[str]:
    """What this process has open: the targets of its descriptors, and the files it has mapped."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    with open("/proc/self/maps") as fh:
        out |= {line.split(maxsplit=5)[5].strip() for line in fh if len(line.split(maxsplit=5)) == 6}
    return out


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc")


# ----- models kept alive -------------------------------------------------------------------------


def test_a_model_with_merged_loras_is_freed_when_its_owner_lets_it_go():
    """Was a bug: ``kc.apply_loras(model, lora)`` (merge, the default mode) registers the handle in a weak
    registry keyed by the model, but the handle itself holds the model (and the original weights it
    keeps as a backup), so the registry's value keeps its own key alive: a model that ever had a LoRA
    merged in is never freed. A script or service that loads a model, merges a LoRA, drops it and loads
    the next one keeps every earlier model (and its backup weights) in memory for the life of the process."""
    model = tiny_transformer()
    handle = kc.apply_loras(model, _lora())
    assert handle.active and handle.mode == "merge"
    alive = weakref.ref(model)
    del model, handle
    gc.collect()
    freed = alive() is None
    assert freed, "a model with a merged LoRA stays alive after its owner dropped it and the handle"


def test_the_lora_loaders_copy_of_a_compiled_model_does_not_pin_it(comfy_pack):
    """Was a bug: Klein LoRA Loader's handle keeps the patched copy per base model in a weak dictionary, so
    that "when the pack's model cache drops the base model the copy goes too (it never pins the
    weights)". Under speed "compile" the copy's blocks carry compiled forwards whose compile group
    holds the base model (its compile-failure fallback closes over it), so the copy pins its key: after
    POST /free (or a switch to another model) the transformer and its weights stay in memory (on the
    GPU, no longer known to ComfyUI's model management, which cannot offload them) for as long as
    ComfyUI keeps the LoRA loader's output."""
    lora_mod = importlib.import_module(f"{PACK}.lora")

    class Ref:  # a lazy model handle, as the pack's cache.ModelRef
        name = "tiny.safetensors"

        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def get(self) -> torch.nn.Module:
            return self.model

    holder = Ref(tiny_transformer())
    apply_speed(holder.model, None, "compile")  # as a Klein Sampler run with speed "compile" leaves it
    handle = lora_mod.LoRAModelRef(holder, [(_lora(), 1.0)])
    assert handle.get() is not holder.model  # the LoRA'd copy, cached in the handle
    alive = weakref.ref(holder.model)
    holder.model = None  # the pack's cache releases the transformer (POST /free)
    gc.collect()
    freed = alive() is None
    assert freed, "the LoRA loader's copy of a compiled model pins the released base model"


# ----- files kept open or mapped -----------------------------------------------------------------


@needs_proc
def test_a_training_cache_hit_does_not_keep_the_entry_file_mapped(tmp_path):
    """Was a bug: the training data cache (``TensorCache.get``, the latents and prompt embeddings every
    LoRA training run reads back) returns ``safetensors.safe_open(...).get_tensor``, a tensor backed
    by a memory map of the cache file, held by the training samples for the whole run. The file stays
    mapped (on Windows it cannot be deleted or replaced, e.g. ComfyUI's temp folder being cleaned), a
    rewrite of the file in place changes the training data under the run, and a file cut short kills
    the process with SIGBUS: what klein_core's own safetensors reader is written to avoid."""
    cache = TensorCache(tmp_path / "latents", "vae:test")
    cache.get("a.png", (64, 64), lambda: torch.zeros(1, 128, 8, 8))
    latents = cache.get("a.png", (64, 64), lambda: torch.ones(1, 128, 8, 8))  # read back from the file
    assert cache.hits == 1 and torch.equal(latents, torch.zeros(1, 128, 8, 8))
    (entry,) = (tmp_path / "latents").glob("*.safetensors")
    mapped = str(entry) in _open_files()
    assert not mapped, f"{entry.name} stays mapped while its tensor is in use"
    with open(entry, "r+b") as fh:  # rewritten in place (its size unchanged): the data is the file's tail
        fh.seek(-latents.nbytes, os.SEEK_END)
        fh.write(torch.ones(latents.numel()).numpy().tobytes())
    assert torch.equal(latents, torch.zeros(1, 128, 8, 8)), "the tensor read from the cache changed with its file"


# ----- pinned --------------------------------------------------------------------------------------


@needs_proc
def test_loads_and_failed_loads_leave_no_file_open_or_mapped(tmp_path):
    """Pinned: every weight read (a model, a LoRA, a GGUF file, a disk prompt cache entry), and every
    read that fails (a truncated file, a file of the wrong component, a GGUF file cut short), closes
    its file: nothing of it stays open or mapped, even before a garbage collection."""
    paths = write_tiny_model_files(tmp_path / "models")
    data = paths["klein_4b"].read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    gguf = write_tiny_gguf_transformer(tmp_path / "t.gguf")
    (tmp_path / "cut.gguf").write_bytes(gguf.read_bytes()[: gguf.stat().st_size * 2 // 3])
    g = torch.Generator().manual_seed(1)
    save_file({"diffusion_model.single_blocks.0.linear1.lora_A.weight": torch.randn(2, 64, generator=g),
               "diffusion_model.single_blocks.0.linear1.lora_B.weight": torch.randn(576, 2, generator=g)},
              str(tmp_path / "l.safetensors"))
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    ours = [str(p) for p in (*paths.values(), tmp_path / "cut.safetensors", gguf, tmp_path / "cut.gguf",
                             tmp_path / "l.safetensors")]
    gc.disable()
    try:
        models = [kc.load_transformer(paths["klein_4b"]), kc.load_text_encoder(paths["qwen_4b"]),
                  kc.load_vae(paths["vae"]), kc.load_transformer(gguf), kc.load_lora(tmp_path / "l.safetensors")]
        for bad, load in ((tmp_path / "cut.safetensors", kc.load_transformer), (paths["vae"], kc.load_transformer),
                          (tmp_path / "cut.gguf", kc.load_transformer), (paths["klein_4b"], kc.load_vae)):
            with pytest.raises((ValueError, OSError)):
                load(bad)
        disk.put("id", "a fox", 4, kc.TextOptions(), torch.randn(1, 4, 96))
        assert disk.get("id", "a fox", 4, kc.TextOptions()) is not None
        held = _open_files()
        assert not [p for p in ours if p in held], "a weight file stays open or mapped"
        assert not [p for p in held if str(tmp_path / "prompts") in p], "a prompt cache entry stays open"
        assert all(m is not None for m in models)
    finally:
        gc.enable()


def test_models_of_finished_and_cancelled_runs_are_freed_and_no_thread_is_left():
    """Pinned: after generations through the default prompt and reference key/value caches (the fast
    path, streamed blocks, a KV edit with a reference, a run cancelled by its callback), deleting the
    models frees them: no cache, callback or plan keeps them, and no thread is left running."""
    threads = set(threading.enumerate())
    picture = Image.new("RGB", (64, 64), (200, 40, 10))
    runs = [({"speed": "fast"}, {}), ({"memory": "blocks"}, {}), ({"kind": "kv"}, {"references": [picture]}),
            ({}, {"callback": lambda step, total, latents: False})]
    for engine_kw, run_kw in runs:
        models = build_tiny_components()
        alive = [weakref.ref(m) for m in models]
        try:
            kc.generate(*models, prompt="a fox in the snow", width=64, height=64, steps=1, seed=1,
                        **engine_kw, **run_kw)
        except GenerationCancelled:
            assert "callback" in run_kw
        del models
        gc.collect()
        assert [a() is None for a in alive] == [True] * 3, f"models kept alive after a run with {engine_kw or run_kw}"
    assert set(threading.enumerate()) <= threads, "a run left a thread running"
