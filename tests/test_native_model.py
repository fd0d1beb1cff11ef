"""Klein Model to MODEL in the real ComfyUI 0.3.75 host: the bridged MODEL sampled by ComfyUI's own
nodes (SamplerCustomAdvanced, KSamplerSelect, Flux2Scheduler, RandomNoise, CFGGuider / BasicGuider,
ReferenceLatent) equals the Klein Sampler, in fp32 on tiny random weights; other samplers run; bad mixes
are refused naming both nodes.

The core nodes' ``execute`` is called in-process, as tests/test_nodes.py calls the pack's nodes.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_files import nonzero_lora

from klein_core.memory.placement import module_bytes
from klein_core.testing import write_tiny_model_files

PACK = "klein_pack_nodes"  # how the comfy_pack fixture (conftest.py) imports nodes/
M4B, M4B_BASE = "flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"
Q4B, Q8B, VAE = "qwen_3_4b.safetensors", "qwen_3_8b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae")
W, H, STEPS, SEED = 80, 64, 3, 7
TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def host(comfy_pack, tmp_path_factory):
    pack, folder_paths = comfy_pack.pack, comfy_pack.folder_paths
    models = tmp_path_factory.mktemp("native_models")
    write_tiny_model_files(models)
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(models / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    asyncio.run(pack.comfy_entrypoint())
    import comfy_extras.nodes_custom_sampler as cs
    import comfy_extras.nodes_easycache as easycache
    import comfy_extras.nodes_edit_model as edit
    import comfy_extras.nodes_flux as flux

    native = importlib.import_module(f"{PACK}.native_model")
    cache = importlib.import_module(f"{PACK}.cache")
    try:
        yield SimpleNamespace(pack=pack, native=native, cs=cs, easycache=easycache, flux=flux, edit=edit, mm=comfy_pack.mm)
    finally:
        cache.release_all("native model tests done")
        for f in FOLDERS:
            folder_paths.folder_names_and_paths[f] = saved[f]
        folder_paths.filename_list_cache.clear()


def _load(h, name=M4B, kind="auto"):
    """The loader's KLEIN_MODEL and KLEIN_VAE outputs (fp32)."""
    with torch.inference_mode():
        model, vae = h.pack.KleinModelLoader.execute(name, VAE, "fp32", kind).args[:2]  # (later outputs: others')
    return model, vae


def _encode(h, prompt="a red fox in the snow", negative="", encoder=Q4B):
    with torch.inference_mode():
        return h.pack.KleinTextEncode.execute(encoder, prompt, negative).args[0]


def _refs(h, vae):
    refs = None
    for seed, (w, hh) in enumerate(((96, 64), (64, 80))):
        img = np.random.default_rng(seed).random((1, hh, w, 3), dtype=np.float32)
        with torch.inference_mode():
            refs, _ = h.pack.KleinReferenceStacker.execute(torch.from_numpy(img), vae, refs).args
    return refs


def _native_cond(h, embeds: torch.Tensor, ref_latents=()) -> list:
    """Hand-made native CONDITIONING, references chained through the core ReferenceLatent node."""
    cond = [[embeds, {"pooled_output": None}]]
    for lat in ref_latents:
        cond = h.edit.ReferenceLatent.execute(cond, {"samples": lat}).args[0]
    return cond


def _method(h, cond: list, method: str) -> list:
    return h.flux.FluxKontextMultiReferenceLatentMethod.execute(cond, method).args[0]


def _klein(h, model, cond, **kw) -> torch.Tensor:
    kw = {"width": W, "height": H, "steps": STEPS, "guidance": 0.0, "seed": SEED, "batch_size": 1, **kw}
    with torch.inference_mode():
        return h.pack.KleinSampler.execute(model, cond, **kw).args[0]["samples"]


def _core(h, native_model, positive, negative=None, cfg=1.0, sampler="euler", steps=STEPS) -> torch.Tensor:
    """SamplerCustomAdvanced(RandomNoise, CFGGuider or BasicGuider, KSamplerSelect, Flux2Scheduler)."""
    cs = h.cs
    with torch.inference_mode():
        guider = (cs.BasicGuider.execute(native_model, positive) if negative is None else
                  cs.CFGGuider.execute(native_model, positive, negative, cfg)).args[0]
        sigmas = h.flux.Flux2Scheduler.execute(steps, W, H).args[0]
        latent = h.flux.EmptyFlux2LatentImage.execute(W, H, 1).args[0]
        out = cs.SamplerCustomAdvanced.execute(cs.RandomNoise.execute(SEED).args[0], guider,
                                               cs.KSamplerSelect.execute(sampler).args[0], sigmas, latent)
    return out.args[0]["samples"]


def _bridge(h, model):
    with torch.inference_mode():
        return h.native.KleinModelToMODEL.execute(model).args[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_schema(host):
    schema = host.native.KleinModelToMODEL.define_schema()
    assert (schema.node_id, schema.display_name, schema.category) == ("KleinModelToMODEL", "Klein Model to MODEL",
                                                                      "Klein/native")
    assert [o.io_type for o in schema.outputs] == ["MODEL"]


def test_bridged_model_is_a_native_flux2_model_with_its_memory(host):
    model, _ = _load(host)
    patcher = _bridge(host, model)
    import comfy.model_base
    import comfy.model_patcher

    assert isinstance(patcher, comfy.model_patcher.ModelPatcher)
    assert isinstance(patcher.model, comfy.model_base.Flux2)
    transformer = model.ref.get()
    # the pack's weights, not a copy, under their BFL names (what ComfyUI's LoRA loaders map), on a view
    # of the module tree: what ComfyUI sets there does not reach the pack's transformer
    view = patcher.model.diffusion_model.transformer
    assert view is not transformer
    theirs = dict(patcher.model.diffusion_model.named_parameters())
    assert theirs.keys() == dict(transformer.named_parameters()).keys()
    assert all(theirs[k] is p for k, p in transformer.named_parameters())
    assert "diffusion_model.double_blocks.0.img_attn.qkv.weight" in patcher.model.state_dict()
    # what ComfyUI counts: the weights, plus the sigma table of the model_base's flow sampling
    assert patcher.model_size() == module_bytes(transformer) + module_bytes(patcher.model.model_sampling)
    assert module_bytes(transformer) > 10 * module_bytes(patcher.model.model_sampling)
    assert patcher.model.get_dtype() == torch.float32
    host.mm.load_models_gpu([patcher])
    assert any(m.model is patcher for m in host.mm.current_loaded_models)


@pytest.mark.parametrize("case", ["text_to_image", "two_references", "base_cfg"])
def test_core_sampler_equals_the_klein_sampler(host, case, parity):
    kind = "base" if case == "base_cfg" else "auto"
    model, vae = _load(host, M4B_BASE if case == "base_cfg" else M4B, kind)
    cond = _encode(host, negative="blurry" if case == "base_cfg" else "")
    native = _bridge(host, model)
    if case == "text_to_image":
        ours = _klein(host, model, cond)
        theirs = _core(host, native, _native_cond(host, cond.positive))
    elif case == "two_references":
        refs = _refs(host, vae)
        lats = [r.latent for r in refs.items]
        ours = _klein(host, model, cond, references=refs)
        theirs = _core(host, native, _native_cond(host, cond.positive, lats))
    else:
        ours = _klein(host, model, cond, guidance=2.5)
        theirs = _core(host, native, _native_cond(host, cond.positive), _native_cond(host, cond.negative), cfg=2.5)
    diff = parity(f"native MODEL vs Klein Sampler ({case}, fp32)", _diff(ours, theirs))
    assert ours.abs().max() > 0.1  # a real result, not zeros
    assert diff <= TOL, diff


def test_references_change_the_result_and_timestep_zero_runs(host, parity):
    """The references reach the model (a control for the two-reference case), and the
    index_timestep_zero method equals the Klein Sampler's "timestep zero" mode."""
    model, vae = _load(host)
    cond = _encode(host)
    refs = _refs(host, vae)
    native = _bridge(host, model)
    lats = [r.latent for r in refs.items]
    plain = _core(host, native, _native_cond(host, cond.positive))
    with_refs = _core(host, native, _native_cond(host, cond.positive, lats))
    assert _diff(plain, with_refs) > 1e-3
    # 0.3.75's combo predates "index_timestep_zero"; its execute passes the method through as is.
    zero_cond = _method(host, _native_cond(host, cond.positive, lats), "index_timestep_zero")
    zero = _core(host, native, zero_cond)
    ours = _klein(host, model, cond, references=refs, reference_mode="timestep zero")
    assert parity("native MODEL vs Klein Sampler (index_timestep_zero, fp32)", _diff(zero, ours)) <= TOL
    assert _diff(zero, with_refs) > 1e-4


def test_dpmpp_2m_runs_and_differs_from_euler(host, parity):
    model, _ = _load(host)
    native = _bridge(host, model)
    pos = _native_cond(host, _encode(host).positive)
    euler = _core(host, native, pos)
    dpm = _core(host, native, pos, sampler="dpmpp_2m")
    assert torch.isfinite(dpm).all()
    diff = parity("native MODEL dpmpp_2m vs euler (a control, must differ)", _diff(euler, dpm))
    assert diff > 1e-3, diff


def test_9b_conditioning_on_a_4b_model_names_both_nodes(host):
    model, _ = _load(host)
    native = _bridge(host, model)
    wide = _encode(host, encoder=Q8B).positive
    with pytest.raises(ValueError) as err:
        _core(host, native, _native_cond(host, wide))
    msg = str(err.value)
    assert msg.startswith("Klein Model to MODEL: the conditioning is ")
    assert "Qwen3 Layer-Concat Encoder" in msg and M4B in msg and f"{wide.shape[-1]} wide" in msg


def test_unknown_reference_method_is_refused(host):
    model, vae = _load(host)
    native = _bridge(host, model)
    cond = _native_cond(host, _encode(host).positive, [r.latent for r in _refs(host, vae).items])
    cond = _method(host, cond, "offset")
    with pytest.raises(ValueError, match=r"Klein Model to MODEL: reference_latents method 'offset' is not "
                                         r"supported .*index, index_timestep_zero"):
        _core(host, native, cond)



def test_easycache_skips_steps_on_the_bridged_model(host, parity, caplog):
    """EasyCache's DIFFUSION_MODEL wrapper reaches the adapter: it skips steps (its own log says how
    many) and the result stays near the uncached one, yet is not the same."""
    model, _ = _load(host)
    native = _bridge(host, model)
    pos = _native_cond(host, _encode(host).positive)
    plain = _core(host, native, pos, sampler="dpmpp_2m", steps=12)
    with torch.inference_mode():
        cached_model = host.easycache.EasyCacheNode.execute(native, 0.05, 0.15, 0.95, False).args[0]
    with caplog.at_level(logging.INFO):
        cached = _core(host, cached_model, pos, sampler="dpmpp_2m", steps=12)
    skipped = [int(m.group(1)) for r in caplog.records
               if (m := re.search(r"EasyCache - skipped (\d+)/\d+ steps", r.getMessage()))]
    assert skipped and skipped[-1] > 0, skipped
    # Relative mean error: on random tiny weights the velocity changes fast, so max diffs are large.
    rel = ((plain - cached).abs().mean() / plain.abs().mean()).item()
    parity("native MODEL + EasyCache vs uncached (dpmpp_2m, 12 steps; relative mean abs)", rel)
    assert 0 < rel < 0.3, rel


def test_core_sampler_workflow_runs_and_equals_the_klein_sampler(host, parity):
    """example_workflows/api/klein_core_sampler.api.json, node by node in graph order (small size, 3 steps,
    fp32), up to SamplerCustomAdvanced: it equals the Klein Sampler with the same settings."""
    graph = json.loads((REPO / "example_workflows" / "api" / "klein_core_sampler.api.json").read_text())
    classes = {"KleinModelLoader": host.pack.KleinModelLoader, "KleinTextEncode": host.pack.KleinTextEncode,
               "KleinModelToMODEL": host.native.KleinModelToMODEL, "CFGGuider": host.cs.CFGGuider,
               "RandomNoise": host.cs.RandomNoise, "KSamplerSelect": host.cs.KSamplerSelect,
               "Flux2Scheduler": host.flux.Flux2Scheduler, "EmptyFlux2LatentImage": host.flux.EmptyFlux2LatentImage,
               "SamplerCustomAdvanced": host.cs.SamplerCustomAdvanced}
    small = {"width": W, "height": H, "steps": STEPS, "weight_dtype": "fp32"}
    outputs: dict[str, tuple] = {}

    def run(nid: str) -> tuple:
        if nid not in outputs:
            node = graph[nid]
            kw = {k: (run(v[0])[v[1]] if isinstance(v, list) else small.get(k, v)) for k, v in node["inputs"].items()}
            with torch.inference_mode():
                outputs[nid] = classes[node["class_type"]].execute(**kw).args
        return outputs[nid]

    sampler = next(n for n, v in graph.items() if v["class_type"] == "SamplerCustomAdvanced")
    theirs = run(sampler)[0]["samples"]
    assert {v["class_type"] for v in graph.values()} - set(classes) == {"VAEDecode", "SaveImage"}
    loader = next(n for n, v in graph.items() if v["class_type"] == "KleinModelLoader")
    encoder = next(n for n, v in graph.items() if v["class_type"] == "KleinTextEncode")
    cfg = next(v for v in graph.values() if v["class_type"] == "CFGGuider")["inputs"]["cfg"]
    seed = next(v for v in graph.values() if v["class_type"] == "RandomNoise")["inputs"]["noise_seed"]
    ours = _klein(host, run(loader)[0], run(encoder)[0], guidance=cfg, seed=seed)
    diff = parity("klein_core_sampler workflow vs Klein Sampler (fp32)", _diff(ours, theirs))
    assert diff <= TOL, diff


def test_easycache_workflow_runs_with_dpmpp_2m_and_skips_steps(host, caplog):
    """example_workflows/api/klein_base_dpmpp_2m_easycache.api.json node by node (small size, 12 steps):
    the base model through EasyCache and dpmpp_2m gives finite latents of the size asked, and EasyCache
    reports skipped steps."""
    graph = json.loads((REPO / "example_workflows" / "api" / "klein_base_dpmpp_2m_easycache.api.json").read_text())
    classes = {"KleinModelLoader": host.pack.KleinModelLoader, "KleinTextEncode": host.pack.KleinTextEncode,
               "KleinModelToMODEL": host.native.KleinModelToMODEL, "EasyCache": host.easycache.EasyCacheNode,
               "CFGGuider": host.cs.CFGGuider, "RandomNoise": host.cs.RandomNoise,
               "KSamplerSelect": host.cs.KSamplerSelect, "Flux2Scheduler": host.flux.Flux2Scheduler,
               "EmptyFlux2LatentImage": host.flux.EmptyFlux2LatentImage,
               "SamplerCustomAdvanced": host.cs.SamplerCustomAdvanced}
    small = {"width": W, "height": H, "steps": 12, "weight_dtype": "fp32"}
    outputs: dict[str, tuple] = {}

    def run(nid: str) -> tuple:
        if nid not in outputs:
            node = graph[nid]
            kw = {k: (run(v[0])[v[1]] if isinstance(v, list) else small.get(k, v)) for k, v in node["inputs"].items()}
            with torch.inference_mode():
                outputs[nid] = classes[node["class_type"]].execute(**kw).args
        return outputs[nid]

    assert next(v for v in graph.values() if v["class_type"] == "KSamplerSelect")["inputs"]["sampler_name"] == "dpmpp_2m"
    sampler = next(n for n, v in graph.items() if v["class_type"] == "SamplerCustomAdvanced")
    with caplog.at_level(logging.INFO):
        latents = run(sampler)[0]["samples"]
    assert latents.shape == (1, 128, H // 16, W // 16) and torch.isfinite(latents).all()
    skipped = [int(m.group(1)) for r in caplog.records
               if (m := re.search(r"EasyCache - skipped (\d+)/\d+ steps", r.getMessage()))]
    assert skipped and skipped[-1] > 0, skipped


def test_ksampler_path_runs_on_the_bridged_model(host):
    """What the core KSampler node runs (comfy.sample.sample: noise, a sampler and a scheduler of
    ComfyUI's, the model's own sigma shift) works on the bridged MODEL: finite latents of the right
    shape, and the scheduler matters (simple and beta differ)."""
    import comfy.sample

    model, _ = _load(host)
    native = _bridge(host, model)
    pos = _native_cond(host, _encode(host).positive)
    latent = torch.zeros(1, 128, H // 16, W // 16)
    noise = comfy.sample.prepare_noise(latent, SEED)
    outs = {}
    for scheduler in ("simple", "beta"):
        with torch.inference_mode():
            outs[scheduler] = comfy.sample.sample(native, noise, 4, 1.0, "euler", scheduler, pos, pos, latent,
                                                  disable_pbar=True, seed=SEED)
        assert outs[scheduler].shape == latent.shape and torch.isfinite(outs[scheduler]).all()
    assert not torch.equal(outs["simple"], outs["beta"])


def test_torch_compile_model_patch_runs_and_matches(host):
    """ComfyUI's TorchCompileModel (inductor; on the CPU here) on the bridged MODEL: the compiled model
    samples and gives the eager latents within 1e-4 (fp32; the compiler may fuse and reorder)."""
    import comfy_extras.nodes_torch_compile as tc

    model, _ = _load(host)
    native = _bridge(host, model)
    pos = _native_cond(host, _encode(host).positive)
    eager = _core(host, native, pos, steps=2)
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.inference_mode():
        compiled = tc.TorchCompileModel.execute(native, "inductor").args[0]
    got = _core(host, compiled, pos, steps=2)
    assert counters["stats"]["unique_graphs"] > 0  # the compiled module ran, not the eager one
    diff = (got - eager).abs().max().item()
    assert diff <= 1e-4, diff


def test_a_kv_model_with_reference_latents_is_one_clear_error(host):
    """Klein 9B-KV runs references as stored keys/values; ReferenceLatent's methods would put them in the
    sequence, which the model is not made for: refused, naming both nodes and what to use instead.
    Without references it samples as usual."""
    model, vae = _load(host, "flux-2-klein-9b-kv.safetensors")
    assert model.kind == "kv"
    native = _bridge(host, model)
    emb = _encode(host, encoder=Q8B).positive
    latent = _klein(host, *_load(host)[:1], _encode(host), steps=1)  # any 4B latent: only its shape matters
    plain = _core(host, native, _native_cond(host, emb), steps=2)
    assert torch.isfinite(plain).all()
    with pytest.raises(ValueError) as err:
        _core(host, native, _native_cond(host, emb, [torch.zeros_like(latent)]), steps=2)
    msg = str(err.value)
    assert "Klein Model to MODEL" in msg and "ReferenceLatent" in msg and "9B-KV" in msg
    assert "flux-2-klein-9b-kv.safetensors" in msg and "Klein Sampler" in msg


def test_blocks_memory_mode_streams_the_bridged_model_and_gives_the_same_latents(host, monkeypatch, parity):
    """The loader's memory_mode blocks carries over to the native MODEL: each step streams the blocks
    (klein_core's BlockOffloader, here with host-to-host copies), with the same latents as the model
    ComfyUI loads whole."""
    from klein_core.memory import placement

    model, _ = _load(host)
    pos = _native_cond(host, _encode(host).positive)
    whole = _core(host, _bridge(host, model), pos)
    with torch.inference_mode():
        streamed_model = host.pack.KleinModelLoader.execute(M4B, VAE, "fp32", "auto", "blocks").args[0]
    assert streamed_model.memory == "blocks"
    entered = []
    real_enter = placement.BlockOffloader.__enter__
    monkeypatch.setattr(placement.BlockOffloader, "__enter__", lambda self: entered.append(1) or real_enter(self))
    streamed = _core(host, _bridge(host, streamed_model), pos)
    assert len(entered) == STEPS  # once per step
    diff = parity("native MODEL, memory_mode blocks vs whole (fp32)", _diff(streamed, whole))
    assert diff <= 1e-6, diff


def test_rope_tables_are_made_once_per_layout(host, monkeypatch):
    """The adapter makes the RoPE tables once per sequence layout, not every step; another size makes
    them anew (and the tables are the right ones: the parity tests above use them)."""
    native = importlib.import_module(f"{PACK}.native_model")
    calls = []
    real = native.rope_tables
    monkeypatch.setattr(native, "rope_tables", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, _ = _load(host)
    bridged = _bridge(host, model)
    pos = _native_cond(host, _encode(host).positive)
    _core(host, bridged, pos, steps=3)
    assert len(calls) == 1
    _core(host, bridged, pos, steps=3)  # the same layout again: still cached
    assert len(calls) == 1
    with torch.inference_mode():
        latent = host.flux.EmptyFlux2LatentImage.execute(W + 16, H, 1).args[0]
        guider = host.cs.BasicGuider.execute(bridged, pos).args[0]
        host.cs.SamplerCustomAdvanced.execute(host.cs.RandomNoise.execute(SEED).args[0], guider,
                                              host.cs.KSamplerSelect.execute("euler").args[0],
                                              host.flux.Flux2Scheduler.execute(2, W + 16, H).args[0], latent)
    assert len(calls) == 2  # a new size: new tables


def test_comfyuis_own_lora_loader_applies_to_the_bridged_model(host, tmp_path, caplog, parity):
    """A LoRA in ComfyUI names (what Klein LoRA Trainer writes) through ComfyUI's own LoRA loading
    (``comfy.sd.load_lora_for_models``, as LoraLoaderModelOnly runs it) on the bridged MODEL samples as
    the Klein Sampler with the same LoRA through the pack's loader; the pack's transformer is unchanged."""
    import logging

    import comfy.sd
    from safetensors.torch import load_file

    import klein_core as kc
    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    lora_mod = importlib.import_module(f"{PACK}.lora")
    model, _ = _load(host)
    transformer = model.ref.get()
    before = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    lora = nonzero_lora(transformer, preset("full", rank=2))
    path = save_lora(tmp_path / "native.safetensors", lora, fmt="comfyui")
    cond = _encode(host)
    plain = _core(host, _bridge(host, model), _native_cond(host, cond.positive))
    with caplog.at_level(logging.WARNING):
        patched, _ = comfy.sd.load_lora_for_models(_bridge(host, model), None, load_file(str(path)), 1.0, 0)
    assert "not loaded" not in caplog.text, caplog.text
    theirs = _core(host, patched, _native_cond(host, cond.positive))
    ours = _klein(host, lora_mod.patch_model(model, kc.load_lora(path), 1.0), cond)
    assert _diff(plain, ours) > 1e-2  # the LoRA changes the result
    diff = parity("ComfyUI's LoRA loader on the bridged MODEL vs Klein LoRA Loader + Klein Sampler (fp32)",
                  _diff(ours, theirs))
    assert diff <= TOL, diff
    # the pack's transformer never saw ComfyUI's patch: the plain Klein Sampler and bridge are unchanged
    assert all(torch.equal(v, before[k]) for k, v in transformer.state_dict().items())
    assert torch.equal(_core(host, _bridge(host, model), _native_cond(host, cond.positive)), plain)


def test_lora_after_a_compiled_run_takes_effect(host, tmp_path, monkeypatch):
    """Klein Model Loader with ``speed = fast + compile``: a run without a LoRA compiles the cached
    transformer; Klein LoRA Loader then patches a copy of it, and the copy's blocks must run their
    branches (they ran the original's compiled forward before: the LoRA did nothing). Dynamo's eager
    backend here, so compiled and plain give the same bits."""
    import klein_core as kc
    from klein_core.accel import fast, speed
    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    monkeypatch.setattr(speed, "enable_fast_paths", lambda m, compile=False: fast.enable_fast_paths(
        m, compile=compile, compile_backend="eager"))
    monkeypatch.setattr(speed, "enable_fast_vae", lambda v, compile=False: fast.enable_fast_vae(
        v, compile=compile, compile_backend="eager"))
    lora_mod = importlib.import_module(f"{PACK}.lora")
    plain_model, _ = _load(host)
    transformer = plain_model.ref.get()
    lora = nonzero_lora(transformer, preset("style", rank=2), up_seed=5)  # double blocks: the single ones stay shared
    path = save_lora(tmp_path / "style.safetensors", lora)
    cond = _encode(host)
    want = _klein(host, lora_mod.patch_model(plain_model, kc.load_lora(path), 1.0), cond)  # speed fast (CPU: plain)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            compiled_model = host.pack.KleinModelLoader.execute(M4B, VAE, "fp32", "auto", "auto",
                                                                "fast + compile").args[0]
        base = _klein(host, compiled_model, cond)  # compiles the cached transformer
        assert compiled_model.ref.get() is transformer and fast.is_compiled(transformer.double_blocks[0])
        got = _klein(host, lora_mod.patch_model(compiled_model, kc.load_lora(path), 1.0), cond)
        assert _diff(base, want) > 1e-2  # the LoRA matters
        assert torch.equal(got, want)
    finally:
        speed.apply_speed(transformer, None, "plain")
        torch._dynamo.reset()
