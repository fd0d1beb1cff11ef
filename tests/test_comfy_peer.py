"""benchmarks/comfy_peer.py: ComfyUI 0.3.75's own ``Flux`` (``image_model="flux2"``) built with Klein's
sizes on klein_core's tensors is the same model: on the CPU in float32 its velocity matches klein_core's
to rounding, for text-to-image and for edits with two references, and the peer really shares (not
copies) the weights. Uses the ComfyUI copy prepared by ``tests/e2e/setup_host.py``; without it these
tests skip with the reason (under CI they fail, as the other host tests do).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from script_module import load_script

from klein_core.models import Flux2Transformer
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.testing.fill import full_size_configs

REPO = Path(__file__).resolve().parents[1]
TOL_REL = 1e-5  # float32 rounding, measured ~2e-7


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def peer():
    setup = load_script("klein_unit_setup_host", REPO / "tests" / "e2e" / "setup_host.py")
    problem = setup.host_problem(setup.HOST_DIR)
    mod = load_script("klein_comfy_peer", REPO / "benchmarks" / "comfy_peer.py")
    problem = problem or mod.host_problem(setup.host_paths(setup.HOST_DIR)["comfyui"])
    if problem is not None:
        msg = f"ComfyUI host not ready: {problem}. Prepare it with: {sys.executable} tests/e2e/setup_host.py"
        if _in_ci():
            pytest.fail(msg + "  (CI is set, so a missing host fails instead of skipping)", pytrace=False)
        pytest.skip(msg)
    path_before = list(sys.path)
    host = mod.import_comfy(setup.host_paths(setup.HOST_DIR)["comfyui"], cpu=True)
    try:
        yield mod, host
    finally:
        for p in [p for p in sys.path if p not in path_before]:
            sys.path.remove(p)


@pytest.fixture(scope="module")
def tiny(peer):
    mod, host = peer
    tr = mod.random_transformer(mod.TINY_CONFIG, torch.device("cpu"), torch.float32)
    return tr, mod.build_comfy_flux2(tr, host=host)


def _inputs(mod, tr, grid=(3, 5), refs=(), batch=2):
    return mod.make_inputs(tr.config, grid, 16, refs, torch.device("cpu"), torch.float32, batch=batch)


def test_text_to_image_velocity_matches_klein_core(peer, tiny, parity):
    mod, _ = peer
    tr, model = tiny
    noise, txt, _ = _inputs(mod, tr)
    assert not torch.equal(noise[0], noise[1])  # two different batch items
    for sigma in (1.0, 0.7, 0.05):
        d = mod.velocity_diff(model, tr, noise, txt, sigma)
        assert d["finite"] and d["ref_rms"] > 0.1
        assert d["rel_l2"] < TOL_REL and d["max_abs"] < TOL_REL * 10 * d["ref_max_abs"], (sigma, d)
        assert d["sigma_given_to_comfy"] == pytest.approx(sigma, rel=1e-6)  # fp32: nothing to round
    parity("comfy peer t2i rel L2 (tiny fp32)", d["rel_l2"])
    parity("comfy peer t2i max abs (tiny fp32)", d["max_abs"])


def test_two_reference_edit_velocity_matches_klein_core(peer, tiny, parity):
    mod, _ = peer
    tr, model = tiny
    noise, txt, refs = _inputs(mod, tr, refs=[(4, 4), (2, 6)])
    d = mod.velocity_diff(model, tr, noise, txt, 0.6, refs)
    assert d["rel_l2"] < TOL_REL and d["finite"], d
    parity("comfy peer edit 2 refs rel L2 (tiny fp32)", d["rel_l2"])
    with torch.inference_mode():
        v_refs = mod.comfy_step(model, noise, txt, 0.6, refs)
        v_none = mod.comfy_step(model, noise, txt, 0.6)
        # ComfyUI's Kontext-style "offset" positions (t = 1, spatial offsets) are another model input:
        # the match above depends on the references' positions (t = 10, 20 from h = w = 0).
        x = noise.to(torch.float32)
        t = torch.full((2,), 0.6)
        v_offset = model(x, t, context=txt, ref_latents=[r.expand(2, -1, -1, -1) for r in refs],
                         ref_latents_method="offset", transformer_options={}).float()
    assert v_refs.shape == v_none.shape == noise.shape
    assert mod.diff_stats(v_none, v_refs)["rel_l2"] > 1e-2  # the references take part
    assert mod.diff_stats(v_offset, v_refs)["rel_l2"] > 1e-3  # and their positions matter


def test_comfy_takes_sigma_and_multiplies_by_1000_itself(peer, tiny):
    mod, _ = peer
    tr, model = tiny
    noise, txt, _ = _inputs(mod, tr, batch=1)
    with torch.inference_mode():
        v_klein = mod.klein_step(tr, noise, txt, 0.5)
        assert mod.diff_stats(mod.comfy_step(model, noise, txt, 0.5), v_klein)["rel_l2"] < TOL_REL
        assert mod.diff_stats(mod.comfy_step(model, noise, txt, 500.0), v_klein)["rel_l2"] > 1e-2


def test_bf16_timestep_matching(peer):
    mod, _ = peer
    cpu = torch.device("cpu")
    # klein_core (like diffusers) embeds bf16(sigma x 1000): 908.1 -> 908, 750 -> 752 (ties to even)
    assert float(mod.klein_effective_sigma(0.9081, torch.bfloat16, cpu)[0]) * 1000 == pytest.approx(908.0)
    assert float(mod.klein_effective_sigma(0.75, torch.bfloat16, cpu)[0]) * 1000 == pytest.approx(752.0)
    assert float(mod.klein_effective_sigma(0.75, torch.float32, cpu)[0]) == pytest.approx(0.75, rel=1e-7)


def test_weights_are_shared_not_copied(peer, tiny):
    _, _ = peer
    tr, model = tiny
    info = model.klein_peer["weights"]
    assert info["copied"] == 0 and info["shared_with_klein_core"] == info["tensors"] == len(tr.state_dict())
    ours, theirs = tr.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k in ours:
        assert theirs[k].data_ptr() == ours[k].data_ptr(), k
    assert model.klein_peer["operations"] == "comfy.ops.disable_weight_init"
    assert model.klein_peer["attention"] == "attention_sub_quad"  # what ComfyUI picks with --cpu
    assert type(model.double_blocks[0].img_attn.qkv).__module__ == "comfy.ops"


def test_loading_is_strict_and_names_every_bad_key(peer, tiny):
    mod, host = peer
    tr, _ = tiny
    sd = dict(tr.state_dict())
    del sd["single_blocks.1.norm.key_norm.scale"]
    sd["guidance_in.in_layer.weight"] = torch.zeros(64, 256)
    sd["txt_in.weight"] = torch.zeros(64, 95)
    with torch.device("meta"):
        model = host.flux_model.Flux(**mod.comfy_flux2_kwargs(tr.config, host), dtype=torch.float32,
                                     device=torch.device("meta"), operations=host.ops.disable_weight_init)
    with pytest.raises(mod.WeightMismatch) as exc:
        mod.load_bfl_weights(model, sd)
    msg = str(exc.value)
    assert "missing in klein_core's state dict (1): single_blocks.1.norm.key_norm.scale" in msg
    assert "unexpected, not in ComfyUI's Flux (1): guidance_in.in_layer.weight" in msg
    assert "txt_in.weight: klein_core (64, 95) vs ComfyUI (64, 96)" in msg


@pytest.mark.parametrize("variant", [KLEIN_4B, KLEIN_9B], ids=["4b", "9b"])
def test_full_size_constructor_gives_klein_layout(peer, variant):
    """The constructor arguments build, for the published sizes, exactly klein_core's keys and
    shapes (both on the meta device: no memory)."""
    mod, host = peer
    cfg = full_size_configs(variant)[0]
    kwargs = mod.comfy_flux2_kwargs(cfg, host)
    assert (kwargs["hidden_size"], kwargs["num_heads"], kwargs["depth"], kwargs["depth_single_blocks"],
            kwargs["context_in_dim"]) == (variant.hidden, variant.heads, variant.depth, variant.depth_single,
                                          variant.text_width)
    assert kwargs["mlp_ratio"] == 3.0 and kwargs["axes_dim"] == [32, 32, 32, 32] and kwargs["theta"] == 2000
    assert kwargs["guidance_embed"] is False and kwargs["vec_in_dim"] is None and kwargs["ops_bias"] is False
    with torch.device("meta"):
        theirs = host.flux_model.Flux(**kwargs, dtype=torch.bfloat16, device=torch.device("meta"),
                                      operations=host.ops.disable_weight_init).state_dict()
        ours = Flux2Transformer(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in theirs.items()} == {k: tuple(v.shape) for k, v in ours.items()}


def test_timing_helpers(peer, tiny):
    mod, _ = peer
    tr, model = tiny
    noise, txt, refs = _inputs(mod, tr, refs=[(2, 2)], batch=1)
    t = mod.time_comfy_steps(model, noise, txt, 0.9, refs, runs=3, warmup=1)
    assert t["clock"] == "host perf_counter" and len(t["all_ms"]) == 3 and t["warmup"] == 1
    assert 0 < t["min_ms"] <= t["median_ms"] < 10_000
    k = mod.time_klein_steps(tr, noise, txt, 0.9, refs, runs=2, warmup=0)
    assert len(k["all_ms"]) == 2 and k["median_ms"] > 0


def test_cli_tiny_self_test(peer, tmp_path, capsys):
    mod, _ = peer
    out = tmp_path / "peer.json"
    report = mod.main(["--tiny", "--runs", "1", "--warmup", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["model"] == "tiny" and saved["peer"]["comfyui_version"] == "0.3.75"
    assert [len(c["reference_grids"]) for c in report["cases"]] == [0, 2]
    for case in saved["cases"]:
        assert set(case["timing"]) == {"comfyui", "klein_plain", "klein_fast"}
        for name in ("comfy_vs_plain", "comfy_vs_fast"):
            assert case["diffs"][name]["rel_l2"] < TOL_REL, (name, case["diffs"][name])
    assert saved["peer"]["constructor"]["default_ref_method"] == "index"
    assert "comfyui" in capsys.readouterr().out

