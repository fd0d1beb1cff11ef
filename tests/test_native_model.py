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
from script_module import load_script
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
    # ComfyUI's block patches run on the streamed blocks too (nodes/model_patches.py)
    import comfy_extras.nodes_slg as slg

    def skipping(native):
        with torch.inference_mode():
            return slg.SkipLayerGuidanceDiT.execute(native, scale=3.0, start_percent=0.0, end_percent=1.0,
                                                    double_layers="0", single_layers="1").args[0]

    skipped_whole = _core(host, skipping(_bridge(host, model)), pos)
    skipped_streamed = _core(host, skipping(_bridge(host, streamed_model)), pos)
    assert _diff(skipped_whole, whole) > 1e-3
    assert _diff(skipped_streamed, skipped_whole) <= 1e-6


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


# ----- ComfyUI's FLUX model patches on the bridged MODEL (nodes/model_patches.py) ------------------------
# In the real ComfyUI 0.3.75 host: block replacements, ControlNet residuals and attention-output patches change the bridged
# model exactly as they change ComfyUI's own FLUX.2 model (``comfy.ldm.flux.model.Flux``, built by
# benchmarks/comfy_peer.py on the same tensors), in fp32 on tiny random weights; the core
# SkipLayerGuidanceDiT node gives the same latents on both; patches the Klein model cannot apply are
# refused by name, and ones it leaves alone are said once.
#
# 0.3.75's FLUX does not apply ``attn1_output_patch`` (current ComfyUI's does, which its NAGuidance node
# needs): the reference for it is 0.3.75's FLUX with its attention function wrapped to apply the patches
# where current ComfyUI's blocks do (after the joint attention, ``img_slice`` = [text tokens, L]).

PATCH_TOL_REL = 1e-5  # float32 rounding between two implementations of the same blocks


@pytest.fixture(scope="module")
def peer(host):
    setup = load_script("klein_unit_setup_host", REPO / "tests" / "e2e" / "setup_host.py")
    mod = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    return mod, mod.import_comfy(setup.host_paths(setup.HOST_DIR)["comfyui"], cpu=True)


def _pair(h, peer, name=M4B, kind="auto"):
    """(the bridged MODEL, ComfyUI's own FLUX.2 MODEL) over the same fp32 tensors."""
    mod, comfy = peer
    model, _ = _load(h, name, kind)
    bridged = _bridge(h, model)
    dm = bridged.model.diffusion_model
    with torch.inference_mode():  # the loader's tensors are inference tensors
        native_dm = mod.build_comfy_flux2(model.ref.get(), host=comfy)
    import comfy.model_management as mm

    nodes_host = importlib.import_module(f"{PACK}.host")
    native = nodes_host.native_flux2_model(native_dm, h.native.unet_config(dm.transformer.config), torch.float32,
                                           mm.get_torch_device())
    return bridged, native


def _inputs(dm, batch=2, grid=(4, 6), text=16, refs=((2, 4),), seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = dm.transformer.config
    x = torch.randn(batch, cfg.in_channels, *grid, generator=g)
    context = torch.randn(batch, text, cfg.context_dim, generator=g)
    ref_latents = [torch.randn(1, cfg.in_channels, *r, generator=g) for r in refs]
    return x, torch.full((batch,), 0.7), context, ref_latents


def _run(dm, x, t, context, refs, options, control=None):
    with torch.inference_mode():
        out = dm(x, t, context, ref_latents=[r.expand(x.shape[0], -1, -1, -1) for r in refs] or None,
                 control=control, transformer_options=options)
    return out.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _both(bridged, native, make_options, control=None, **kw):
    """The velocity of both diffusion models for the same inputs, each with its own fresh options."""
    dm, ndm = bridged.model.diffusion_model, native.model.diffusion_model
    x, t, context, refs = _inputs(dm, **kw)
    ours = _run(dm, x, t, context, refs, make_options(), control)
    theirs = _run(ndm, x, t, context, refs, make_options(), control)
    plain = _run(dm, x, t, context, refs, {})
    assert _rel(_run(ndm, x, t, context, refs, {}), plain) < PATCH_TOL_REL  # the pair agrees without patches
    return ours, theirs, plain


def test_block_replacements_match_comfyuis_flux(host, peer, parity):
    """A double block whose output a patch changes (through original_block), a skipped single block and a
    block patch that reads transformer_options: the bridged model equals ComfyUI's FLUX, and each patch
    changes the result."""
    bridged, native = _pair(host, peer)
    seen: list[list] = []
    slices: list = []

    def scaled(args, extra):
        out = extra["original_block"](args)
        seen[-1].append((args["transformer_options"]["block_type"], args["transformer_options"]["block_index"],
                         args["transformer_options"]["total_blocks"]))
        return {"img": out["img"] * 1.5, "txt": out["txt"] - 0.25}

    def skipped(args, extra):
        opts = args["transformer_options"]
        seen[-1].append((opts["block_type"], opts["block_index"], opts["total_blocks"]))
        slices.append(opts.get("img_slice"))  # current ComfyUI sets it for the single blocks; 0.3.75 does not
        return {"img": args["img"]}

    def options():
        seen.append([])
        return {"patches_replace": {"dit": {("double_block", 0): scaled, ("single_block", 1): skipped}}}

    ours, theirs, plain = _both(bridged, native, options)
    assert seen[0] == seen[1] == [("double", 0, 1), ("single", 1, 2)], seen  # called alike, same block info
    assert slices[0] == [16, 16 + 4 * 6 + 2 * 4]  # text tokens, then image and reference tokens
    d = parity("native MODEL block patches vs ComfyUI's FLUX (rel L2, fp32)", _rel(ours, theirs))
    assert d < PATCH_TOL_REL, d
    assert _rel(ours, plain) > 1e-3  # the patches changed the result (100x the rounding above)


def test_controlnet_residuals_match_comfyuis_flux(host, peer, parity):
    bridged, native = _pair(host, peer)
    dm = bridged.model.diffusion_model
    hidden, tokens = dm.transformer.config.hidden_size, 4 * 6
    g = torch.Generator().manual_seed(3)
    control = {"input": [None, torch.randn(2, tokens, hidden, generator=g)],
               "output": [torch.randn(2, tokens - 4, hidden, generator=g)]}
    ours, theirs, plain = _both(bridged, native, dict, control=control)
    d = parity("native MODEL ControlNet residuals vs ComfyUI's FLUX (rel L2, fp32)", _rel(ours, theirs))
    assert d < PATCH_TOL_REL, d
    assert _rel(ours, plain) > 1e-3


def _nag(scale=4.0, alpha=0.5, tau=2.5):
    """Normalized attention guidance on the image part of the attention output, written from its paper
    (arXiv:2505.21179) in the form ComfyUI's NAGuidance node applies it: the cond rows extrapolated
    away from the uncond rows, the L1 norm ratio capped at tau, blended with the cond rows by alpha."""
    calls = []

    def patch(out, extra):
        calls.append((extra["block_type"], extra["block_index"], tuple(extra["img_slice"])))
        order = extra["cond_or_uncond"]
        a, b = extra["img_slice"]
        n = out.shape[0] // len(order)
        pos = out[n * order.index(0):n * (order.index(0) + 1), a:b]
        neg = out[n * order.index(1):n * (order.index(1) + 1), a:b]
        guided = pos * scale - neg * (scale - 1.0)
        ratio = guided.abs().sum(-1, keepdim=True).clamp_min(1e-6) / pos.abs().sum(-1, keepdim=True).clamp_min(1e-6)
        mixed = guided * (ratio.clamp(max=tau) / ratio) * alpha + pos * (1.0 - alpha)
        out = out.clone()
        out[:, a:b] = mixed.repeat(len(order), 1, 1)
        return out

    return patch, calls


@pytest.fixture
def flux_applies_output_patches(peer, monkeypatch):
    """0.3.75's FLUX blocks made to apply attn1_output_patch as current ComfyUI's do."""
    from comfy.ldm.flux import layers

    plain = layers.attention
    state = SimpleNamespace(text_tokens=16)

    def attention(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
        out = plain(q, k, v, pe=pe, mask=mask, transformer_options=transformer_options)
        patches = transformer_options.get("patches", {}).get("attn1_output_patch", ())
        if patches:
            extra = transformer_options.copy()
            extra["img_slice"] = [state.text_tokens, out.shape[1]]
            for p in patches:
                out = p(out, extra)
        return out

    monkeypatch.setattr(layers, "attention", attention)
    return state


def test_attention_output_patch_nag_matches_comfyuis_flux(host, peer, flux_applies_output_patches, parity):
    """NAG as an attn1_output_patch (what current ComfyUI's NAGuidance sets): a batch of cond and uncond
    rows, every block patched after its joint attention; equal to ComfyUI's FLUX applying the same patch."""
    bridged, native = _pair(host, peer)
    flux_applies_output_patches.text_tokens = 16
    patch, calls = _nag()
    ours, theirs, plain = _both(bridged, native, lambda: {"patches": {"attn1_output_patch": [patch]},
                                                          "cond_or_uncond": [0, 1]})
    cfg = bridged.model.diffusion_model.transformer.config
    blocks = cfg.depth + cfg.depth_single
    assert len(calls) == 2 * blocks and calls[:blocks] == calls[blocks:], calls  # the same places on both
    assert [c[0] for c in calls[:blocks]] == ["double"] * cfg.depth + ["single"] * cfg.depth_single
    assert calls[0][2] == (16, 16 + 4 * 6 + 2 * 4)  # text, then image and reference tokens
    d = parity("native MODEL NAG attention patch vs ComfyUI's FLUX (rel L2, fp32)", _rel(ours, theirs))
    assert d < PATCH_TOL_REL, d
    assert _rel(ours, plain) > 1e-3


def test_nag_in_the_sampler_gives_a_distilled_model_its_negative(host, peer, flux_applies_output_patches, parity):
    """What current ComfyUI's NAGuidance node does, by hand on 0.3.75 (which lacks the node): the patch, and
    the uncond rows kept at CFG 1. The distilled model's latents then depend on the negative prompt, and
    equal ComfyUI's FLUX with the same patch."""
    bridged, native = _pair(host, peer)
    cond = _encode(host, negative="blurry, low quality")
    flux_applies_output_patches.text_tokens = cond.positive.shape[1]
    pos, neg = _native_cond(host, cond.positive), _native_cond(host, cond.negative)

    def nag(model):
        m = model.clone()
        m.set_model_attn1_output_patch(_nag()[0])
        m.model_options["disable_cfg1_optimization"] = True  # NAGuidance's disable_model_cfg1_optimization()
        return _core(host, m, pos, neg, cfg=1.0)

    ours, theirs = nag(bridged), nag(native)
    d = parity("native MODEL NAG in the sampler vs ComfyUI's FLUX (max abs, fp32)", (ours - theirs).abs().max().item())
    assert d <= 1e-5 * ours.abs().max().item(), d
    without = _core(host, bridged, pos, neg, cfg=1.0)  # CFG 1: the negative is not even run
    assert (ours - without).abs().max() > 1e-3


def test_skip_layer_guidance_node_matches_comfyuis_flux(host, peer, parity, caplog):
    """The core SkipLayerGuidanceDiT node on a base model (CFG 2 with a negative): the bridged MODEL's
    latents equal those of ComfyUI's own FLUX.2 MODEL, and differ from sampling without it. Layers the
    model does not have (the node's default "7, 8, 9") are said once and change nothing, as on the
    native model."""
    import comfy_extras.nodes_slg as slg

    bridged, native = _pair(host, peer, M4B_BASE, "base")
    cond = _encode(host, negative="blurry")
    pos, neg = _native_cond(host, cond.positive), _native_cond(host, cond.negative)

    def guided(model, double="0", single="1"):
        with torch.inference_mode():
            patched = slg.SkipLayerGuidanceDiT.execute(model, scale=3.0, start_percent=0.0, end_percent=1.0, double_layers=double, single_layers=single, rescaling_scale=0.0).args[0]
        return _core(host, patched, pos, neg, cfg=2.0)

    ours, theirs = guided(bridged), guided(native)
    d = parity("native MODEL SkipLayerGuidanceDiT vs ComfyUI's FLUX (max abs, fp32)", (ours - theirs).abs().max().item())
    assert d <= 1e-5 * ours.abs().max().item(), d
    assert (ours - _core(host, bridged, pos, neg, cfg=2.0)).abs().max() > 1e-3
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        far = guided(bridged, "7, 8, 9", "")
    notes = [r.getMessage() for r in caplog.records if "does not have" in r.getMessage()]
    assert len(notes) == 1 and "double_block 7, double_block 8, double_block 9" in notes[0] and "double_block 0-0" in notes[0], notes
    # only the rounding of a batch of one against one of two (SkipLayerGuidance runs the cond alone again)
    assert (far - _core(host, bridged, pos, neg, cfg=2.0)).abs().max() <= 1e-5 * far.abs().max()


@pytest.mark.parametrize("kind", ["attn1_patch", "post_input"])
def test_patches_the_klein_model_cannot_apply_are_refused_by_name(host, peer, kind):
    bridged, _ = _pair(host, peer)
    dm = bridged.model.diffusion_model
    x, t, context, refs = _inputs(dm)

    def my_patch(*args, **kwargs):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=rf"'{kind}' \(.*my_patch\).*Remove the node"):
        _run(dm, x, t, context, refs, {"patches": {kind: [my_patch]}})
    assert _run(dm, x, t, context, refs, {}).abs().max() > 0  # the model stays usable


def test_a_block_patch_that_needs_comfyuis_vec_layout_is_named(host, peer):
    bridged, _ = _pair(host, peer)
    dm = bridged.model.diffusion_model
    x, t, context, refs = _inputs(dm)

    def reads_vec(args, extra):
        args["vec"][0].shift  # ComfyUI's FLUX passes ModulationOut objects here  # noqa: B018
        return extra["original_block"](args)

    with pytest.raises(RuntimeError, match=r"reads_vec for dit double_block 0 failed.*AttributeError.*'vec'"):
        _run(dm, x, t, context, refs, {"patches_replace": {"dit": {("double_block", 0): reads_vec}}})


def test_patches_flux_never_reads_are_said_once(host, peer, caplog):
    bridged, _ = _pair(host, peer)
    dm = bridged.model.diffusion_model
    x, t, context, refs = _inputs(dm)
    plain = _run(dm, x, t, context, refs, {})
    options = {"patches": {"input_block_patch": [lambda h, e: h * 0]}, "optimized_attention_override": object(),
               "patches_replace": {"attn1": {("input", 1): lambda *a: None}}}
    with caplog.at_level(logging.WARNING):
        first = _run(dm, x, t, context, refs, dict(options))
        second = _run(dm, x, t, context, refs, dict(options))
    said = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(said) == 3, said  # each said once, not once per step
    assert any("input_block_patch" in s for s in said) and any("'attn1'" in s for s in said)
    assert any("attention override" in s for s in said)
    assert torch.equal(first, plain) and torch.equal(second, plain)
