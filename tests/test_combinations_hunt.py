"""Bug hunt: features that each work alone (and have their own tests) but break in combination.

Every test composes two or three features and checks the result against a reference built from the
parts: the same request with one feature switched off, a fresh computation instead of a cached one,
or the path another front end (the CLI) takes for the same combination. Areas: caches keyed on the
weights (the 9B-KV reference keys/values, the prompt embeddings of an encoder built in memory) x
in-place weight updates x memory modes that stream or copy the weights; row LoRAs of the Ray
batch/serve runner x quantised weight formats x memory modes; and, pinned, memory modes x reference
modes x inpainting x CFG, and batches against single runs.

Tiny random models on the CPU; the CPU stands in for the GPU where a memory mode streams blocks
(``BlockOffloader`` copies each block per forward on the CPU too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import klein_core as kc
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.pipeline.sampling import make_noise
from klein_core.testing import (
    build_tiny_components,
    tiny_text_encoder,
    tiny_transformer,
    write_tiny_model_files,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


# ----- caches keyed on the weights x in-place updates x streamed memory modes -------------------------


def test_kv_cache_is_not_served_stale_keys_after_load_state_dict_and_a_streamed_run(tmp_path):
    """Was a bug: a 9B-KV edit returns an image made with the reference keys/values of the *previous* weights.

    docs/kv.md: an entry "is served only to the model it was made for, with the weights it had ...
    so reloading weights, ``load_state_dict`` and a merged LoRA all compute the keys/values anew".
    Seen with ``memory="blocks"`` (what "auto" picks on a card smaller than the model): edit a
    reference; load new weights into the same model in place (``load_state_dict``); run any
    generation; edit the same reference again -> the cache hits and the latents differ from the same
    edit without the cache (the references' keys/values are the old weights'). Each step alone is
    tested (test_kv_hostile: load_state_dict misses; test_kv_cache_hunt: streamed runs hit).

    Cause: the key holds each weight's version counter (``weights_state``), and every streamed (or
    copied-in) stage puts the weights back as new ``nn.Parameter`` objects wrapping ``.data``
    (memory/placement.py ``_set``), whose version counters start again at 0: after the in-place
    write and one streamed run the token is again the one the old entry was stored under.
    """
    paths = write_tiny_model_files(tmp_path, dtype=torch.float32)
    tr = kc.load_transformer(paths["klein_4b"], dtype=torch.float32)  # a file's weights: version counters 0
    te = kc.load_text_encoder(paths["qwen_4b"], dtype=torch.float32)
    ref = torch.randn(1, 128, 4, 5, generator=torch.Generator().manual_seed(1))
    cache = ReferenceKVCache()
    common = {"seed": 1, "width": 64, "height": 64, "steps": 2, "output": "latent", "cache": None, "memory": "blocks"}
    edit = dict(prompt="make it night", reference_latents=[ref], ref_mode="kv", **common)
    kc.generate(tr, te, None, kv_cache=cache, **edit)  # the first edit: keys/values stored
    tr.load_state_dict(tiny_transformer(seed=5).state_dict())  # new weights, written in place
    kc.generate(tr, te, None, prompt="a fox", **common)  # any other run, streamed like the edits
    again = kc.generate(tr, te, None, kv_cache=cache, **edit).latents
    fresh = kc.generate(tr, te, None, kv_cache=None, **edit).latents
    assert torch.equal(again, fresh), (
        f"the cache served the old weights' reference keys/values (hits {cache.hits}); the edit is "
        f"{(again - fresh).abs().max().item():.3g} off the same edit without the cache")


def test_prompt_cache_is_not_served_old_embeddings_after_load_state_dict_and_a_streamed_run():
    """Was a bug: a prompt encoded before new text-encoder weights were loaded is served again afterwards.

    docs/python.md: "An encoder built in memory (no file) is cached by its weights: a
    load_state_dict or any write in place into it is seen, and its old embeddings are not served".
    Seen with ``memory="minimum"`` (the text encoder streamed block by block): encode a prompt;
    ``load_state_dict`` new weights into the encoder; encode another prompt; encode the first prompt
    again -> the old weights' embeddings (a cache hit), not the new weights'.

    Cause: as the KV test above: the cache key is ``weights_state`` (storage, address, version
    counter), and the streamed stage re-wraps every weight in a new ``nn.Parameter``
    (memory/placement.py ``_set``), resetting the version counters the in-place write had moved.
    """
    te = tiny_text_encoder(seed=0)
    cache = kc.PromptCache()
    engine = kc.Engine(None, te, None, prompt_cache=cache, memory="minimum")
    engine.encode_prompts(["an earlier prompt"])  # the session's first run
    engine.encode_prompts(["a red fox"])
    te.load_state_dict(tiny_text_encoder(seed=7).state_dict())  # new weights, written in place
    engine.encode_prompts(["another prompt"])
    hits = cache.hits
    served = engine.encode_prompts(["a red fox"]).positive
    fresh = kc.Engine(None, te, None, prompt_cache=None).encode_prompts(["a red fox"]).positive
    assert torch.equal(served, fresh), (
        f"{cache.hits - hits} cache hit(s) served the old encoder's embedding, "
        f"{(served - fresh).abs().max().item():.3g} off the new weights' one")


# ----- the Ray runner's row LoRAs x weight formats x memory modes ------------------------------------


def _nvfp4_transformer_file(path, model) -> None:
    """``model``'s block Linears in NVFP4 (comfy-kitchen's quantisation), the rest bf16, as ComfyUI writes them."""
    from test_nvfp4 import _nvfp4_file

    _nvfp4_file(path, model, "comfy_quant")


def test_ray_row_lora_on_an_nvfp4_transformer_runs(tmp_path):
    """Was a bug: a Ray batch row (or a served request) with ``loras`` fails on an NVFP4 transformer.

    docs/ray.md: rows take ``loras`` (``NAME[:STRENGTH]``); NVFP4 files load everywhere; LoRAs run
    on NVFP4 layers as branches (docs/lora.md), which ``klein-generate --lora`` does
    (test_lora_hunt). Seen: the row fails with NotImplementedError "holds NVFP4 blocks, which a LoRA
    cannot be merged into exactly; apply the LoRA as a branch", so every LoRA row of such a job is a
    failed row. Cause: ``RowRunner._apply_loras`` (distributed/runner.py) merges unless the
    transformer has GGUF layers; the CLI also takes branches for NVFP4 layers (and for packed layers
    in the text encoder).
    """
    pytest.importorskip("comfy_kitchen")
    from klein_core.distributed.models import ModelSpec
    from klein_core.distributed.rows import RowSpec
    from klein_core.distributed.runner import RowRunner

    paths = write_tiny_model_files(tmp_path)
    model = tiny_transformer().float()
    nvfp4 = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    _nvfp4_transformer_file(nvfp4, model)
    name = "double_blocks.0.img_attn.qkv"
    layer = model.get_submodule(name)
    g = torch.Generator().manual_seed(3)
    loras = tmp_path / "loras"
    save_file({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, layer.in_features, generator=g),
               f"diffusion_model.{name}.lora_B.weight": torch.randn(layer.out_features, 4, generator=g)},
              str(loras / "style.safetensors"))
    spec = ModelSpec(nvfp4, paths["qwen_4b"], paths["vae"], device="cpu", lora_dir=loras,
                     names={"transformer": nvfp4.name, "text_encoder": "qwen_3_4b.safetensors",
                            "vae": "flux2-vae.safetensors"})
    runner = RowRunner(spec)
    row = RowSpec(id="r", prompt="a fox", width=64, height=64, steps=1, seed=5)
    plain = np.asarray(runner.run(row, []).result.images[0])
    styled = runner.run(dataclasses.replace(row, loras=(("style", 1.0),)), [])
    assert styled.params["loras"] == ["style:1"]
    assert not np.array_equal(np.asarray(styled.result.images[0]), plain)  # the LoRA took effect


@pytest.mark.parametrize("memory", ["blocks", "minimum"])
def test_ray_worker_memory_mode_keeps_streamed_weights_in_cpu_memory(tmp_path, monkeypatch, memory):
    """Was a bug: ``python -m klein_core batch/serve --memory blocks`` (or ``minimum``) streams nothing on a GPU.

    docs/memory.md: to let the engine stream or copy a component in, it must be loaded on the CPU;
    the loader node does so (``weights_home``). The Ray worker loads every model straight onto its
    GPU whatever ``--memory`` says, so the engine then logs "transformer is already on cuda, so it
    runs there as it is" each run and no memory is saved: a model larger than the card fails at
    load, though the job asked for streaming. Cause: ``distributed/models.py`` ``open_engine``
    passes ``spec.memory`` to the Engine but loads with ``device=device``.

    Shown without a GPU: ``as_device`` answers ``cuda:0`` for "cuda" and the loaders record the
    device they are asked to load on (returning tiny CPU models); the Engine is not built.
    """
    from klein_core.distributed import models as ray_models
    from klein_core.distributed.models import ModelSpec, open_engine
    from klein_core.files import loaders
    from klein_core.pipeline import request

    paths = write_tiny_model_files(tmp_path)
    real_as_device = request.as_device
    monkeypatch.setattr(request, "as_device",
                        lambda d: torch.device("cuda", 0) if str(d) == "cuda" else real_as_device(d))
    tiny = dict(zip(("transformer", "text_encoder", "vae"), build_tiny_components(), strict=True))
    asked: dict[str, torch.device] = {}

    def loader(component):
        def load(source, *, device=None, dtype=None, **kw):
            asked[component] = torch.device(device)
            return tiny[component]
        return load

    for component in tiny:
        monkeypatch.setattr(loaders, f"load_{component}", loader(component))
    monkeypatch.setattr(ray_models, "Engine", lambda *models, **kw: kw)  # stop before the engine needs CUDA
    for mode in ("resident", memory):
        asked.clear()
        spec = ModelSpec(paths["klein_4b"], paths["qwen_4b"], paths["vae"], device="cuda", memory=mode)
        assert open_engine(spec)["memory"] == mode
        if mode == "resident":
            assert asked["transformer"].type == "cuda"  # the control: resident loads onto the GPU
    assert asked["transformer"].type == "cpu", (
        f"--memory {memory}: the worker loaded the transformer onto {asked['transformer']}, where the engine "
        "cannot stream it")


# ----- pinned: compositions that hold ----------------------------------------------------------------


def test_streamed_memory_modes_equal_resident_across_reference_modes_inpainting_and_cfg():
    """Pinned: ``memory="blocks"`` and ``"minimum"`` (blocks copied in per forward, the text encoder
    streamed) give the resident run's latents bit for bit, for each reference mode (joint,
    timestep_zero, kv), inpainting with the picture as a reference, and base-model CFG run as two
    forwards (a negative of its own length). docs/memory.md: streaming copies weights, never
    converts them."""
    ref, picture = _picture(64, 80, 1), _picture(64, 64, 2)
    mask = Image.fromarray(np.pad(np.full((32, 32), 255, np.uint8), 16))
    cases = {
        "joint": {"references": [ref]},
        "timestep_zero": {"references": [ref], "ref_mode": "timestep_zero"},
        "kv": {"references": [ref], "ref_mode": "kv"},
        "inpaint": {"image": picture, "mask": mask},
        "cfg two passes": {"kind": "base", "steps": 3, "negative_prompt": "blurry, dark and far too long " * 3,
                           "text": kc.COMFYUI_TEXT},
    }
    tr, te, vae = build_tiny_components()
    for name, kw in cases.items():
        run = dict(prompt="a fox", seed=3, width=64, height=64, output="latent", cache=None, kv_cache=None, **kw)
        if "steps" not in kw:
            run["steps"] = 2
        resident = kc.generate(tr, te, vae, memory="resident", **run).latents
        for memory in ("blocks", "minimum"):
            got = kc.generate(tr, te, vae, memory=memory, **run).latents
            assert torch.equal(got, resident), f"{name}: memory {memory} differs from resident"


def test_a_batch_of_prompts_with_cfg_equals_each_image_run_alone_with_its_noise_row():
    """Pinned: two prompts x batch_size 2 on a base model with CFG and references equal the four
    images each run alone with the matching row of the batch's noise (the batch's seed draws the
    noise together: ``make_noise(seed, 4, ...)``). Not bit for bit: a fused forward rounds
    differently (docs/ray.md measured 1/255), so within 1e-5 (measured 2.1e-6)."""
    tr, te, vae = build_tiny_components()
    ref = _picture(64, 80, 4)
    common = {"width": 64, "height": 64, "steps": 3, "kind": "base", "negative_prompt": "blurry",
              "references": [ref], "output": "latent", "cache": None}
    prompts = ["a fox", "a cat in the snow"]
    batch = kc.generate(tr, te, vae, prompt=prompts, batch_size=2, seed=9, **common).latents
    noise = make_noise(9, 4, 128, 4, 4)
    for i, prompt in enumerate(p for p in prompts for _ in range(2)):
        alone = kc.generate(tr, te, vae, prompt=prompt, noise=noise[i:i + 1], **common).latents
        assert (alone[0] - batch[i]).abs().max().item() < 1e-5, i


def test_kv_cache_serves_a_second_inpaint_edit_under_streaming_bit_for_bit(tmp_path):
    """Pinned: 9B-KV inpainting (the picture joins as the first reference, in KV mode) with the
    transformer streamed: a second edit of the same picture with another prompt and seed skips the
    reference pass (one hit) and gives the latents of the same edit without the cache, bit for bit
    (docs/kv.md: "bit-identical latents, in every memory mode")."""
    paths = write_tiny_model_files(tmp_path, dtype=torch.float32)
    tr, te, vae = (kc.load_transformer(paths["klein_9b_kv"], dtype=torch.float32),
                   kc.load_text_encoder(paths["qwen_8b"], dtype=torch.float32),
                   kc.load_vae(paths["vae"], dtype=torch.float32))
    picture, mask = _picture(64, 80, 5), Image.fromarray(np.pad(np.full((32, 48), 255, np.uint8), 16))
    cache = ReferenceKVCache()
    common = {"image": picture, "mask": mask, "steps": 2, "output": "latent", "cache": None, "memory": "blocks"}
    kc.generate(tr, te, vae, prompt="a vase", seed=1, kv_cache=cache, **common)
    second = dict(prompt="a bowl of fruit", seed=2, **common)
    got = kc.generate(tr, te, vae, kv_cache=cache, **second).latents
    assert (cache.hits, cache.misses) == (1, 1)
    assert torch.equal(got, kc.generate(tr, te, vae, kv_cache=None, **second).latents)


def test_text_encoder_lora_with_comfyui_text_is_the_same_streamed_and_resident(tmp_path):
    """Pinned: a text-encoder LoRA on a bf16 encoder computing in fp32 (``COMFYUI_TEXT``: each
    layer's weights cast inside its hooks, the LoRA factors with them), merged, as branches and as a
    ``with_loras`` copy: with the encoder streamed (``memory="minimum"``) each gives the resident
    embeddings bit for bit, and merged and branch agree within bf16 rounding of the merged weight."""
    paths = write_tiny_model_files(tmp_path)
    te = kc.load_text_encoder(paths["qwen_4b"], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(0, 27, 3):
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            out, inn = te.get_submodule(f"layers.{i}.{name}").weight.shape
            sd[f"text_encoder.model.layers.{i}.{name}.lora_A.weight"] = torch.randn(4, inn, generator=g) * 0.1
            sd[f"text_encoder.model.layers.{i}.{name}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.1
    lora = kc.load_lora(sd)
    plain = kc.Engine(None, te, None, prompt_cache=None, text=kc.COMFYUI_TEXT).encode_prompts(["a fox"]).positive
    got = {}
    for how in ("merge", "branch", "copy"):
        for memory in ("resident", "minimum"):
            handle = None if how == "copy" else kc.apply_loras(te, [(lora, 1.0)], mode=how)
            model = kc.with_loras(te, [(lora, 1.0)]) if how == "copy" else te
            try:
                engine = kc.Engine(None, model, None, prompt_cache=kc.PromptCache(), text=kc.COMFYUI_TEXT,
                                   memory=memory)
                got[how, memory] = engine.encode_prompts(["a fox"], "blurry").positive.float()
            finally:
                if handle is not None:
                    handle.remove()
        assert torch.equal(got[how, "minimum"], got[how, "resident"]), how
    assert torch.equal(got["copy", "resident"], got["branch", "resident"])
    merged, branch = got["merge", "resident"], got["branch", "resident"]
    effect = (branch - plain.float()).norm() / plain.float().norm()
    assert (merged - branch).norm() / branch.norm() < 0.1 * effect  # measured 7.2e-4 against an effect of 0.14
