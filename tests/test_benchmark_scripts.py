"""The GPU benchmark scripts' plumbing on the CPU (their numbers only mean something on a GPU)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_module import load_script

from klein_core.models.transformer import TransformerConfig

REPO = Path(__file__).resolve().parent.parent


def test_kernels_blocks_rows_cover_every_variant():
    """kernels.py --ops blocks: one row per variant with both blocks timed and the step summed; on
    the CPU every variant is the plain path, so the outputs are identical."""
    kernels = load_script("klein_kernels_benchmark", REPO / "benchmarks" / "kernels.py")
    cfg = TransformerConfig(hidden_size=64, num_heads=2, depth=2, depth_single=3, context_dim=96,
                            mlp_hidden=192, axes_dim=(8, 8, 8, 8))
    args = argparse.Namespace(warmup=0, iters=2)
    rows = kernels.bench_blocks("tiny", 16, torch.device("cpu"), torch.float32, args, cfg=cfg)
    assert [r["variant"] for r in rows] == ["plain", "fast, elementwise plain", "fast, swiglu plain", "fast"]
    for r in rows:
        assert "error" not in r, r
        assert r["step_ms"] == r["double_ms"] * 2 + r["single_ms"] * 3
        assert r["max_abs_diff_vs_plain"] == 0.0
    assert "elementwise=plain" in rows[-1]["described"]["cpu torch.float32"]

    class Resolved:  # what the fast ops of a GPU say: the kernel was resolved before the row switched it off
        @staticmethod
        def resolved():
            return {"cuda:0 torch.bfloat16": "attention=sdpa_cudnn, swiglu=triton, compile=False"}

    assert kernels._described(Resolved, swiglu_plain=True) == {
        "cuda:0 torch.bfloat16": "attention=sdpa_cudnn, swiglu=plain, compile=False"}
    assert kernels._described(Resolved, swiglu_plain=False) == Resolved.resolved()


def test_profile_run_reports_stages_and_host_profile(tmp_path):
    out = tmp_path / "p.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_run.py"), "--tiny", "--device", "cpu",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    stages = report["unprofiled"]["engine_stages_ms"]
    assert set(stages) >= {"text", "denoise", "decode"} and all(v > 0 for k, v in stages.items() if k != "references")
    assert report["wall_ms"] > 0 and report["gpu_busy_ms"] == 0  # no CUDA kernels on the CPU
    assert any("engine.py" in line and "(generate)" in line for line in report["cprofile_cumulative"])
    for audit in (report["host_audit"], report["unprofiled"]["host_audit"]):  # warm eager runs compile nothing
        assert set(audit["gc"]) >= {"gen0", "gen1", "gen2", "largest_ms"} and audit["compiles"]["frames"] == 0


def test_profile_families_place_inductor_kernels_by_what_they_compute():
    """Inductor names a fused kernel after every op it fuses: the QK norm carries ``_to_copy`` and
    the SwiGLU ``cat`` in their names, and were counted as copies (2026-11-27 compile profile)."""
    profile = load_script("klein_profile_run", REPO / "benchmarks" / "profile_run.py")
    cases = {
        "triton_red_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_mean_mul_neg_pow_rsqrt"
        "_split_split_with_sizes_stack_transpose_unbind_view_1": "norm/rope",
        "triton_poi_fused__unsafe_view_cat_mul_silu_split_split_with_sizes_transpose_view_2": "elementwise",
        "triton_red_fused_clone_convolution_native_group_norm_silu_45": "norm/rope",
        "triton_poi_fused_convolution_0": "elementwise",
        "triton_poi_fused_cat_clone_1": "copy",
        "triton_tem_fused_mm_4": "matmul",
        "triton_poi_fused_addmm_gelu_2": "matmul",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "matmul",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>>": "copy",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention",
    }
    assert {name: profile.family(name) for name in cases} == cases


def test_profile_counts_kernels_not_the_engines_ranges_on_the_gpu_timeline():
    """The profiler draws each ``klein.*`` range on the GPU timeline too (a user annotation spanning
    the stage's kernels). Counted as kernels they made the 2026-11-27 compile profile's GPU busy 840 ms
    in a 324 ms span and hid the idle time inside the stages."""
    from types import SimpleNamespace

    profile = load_script("klein_profile_run", REPO / "benchmarks" / "profile_run.py")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               device_time_total=end - start, is_user_annotation=annotation)

    events = [
        ev("klein.denoise", 0, 10_000, annotation=True),  # spans both kernels and the gap between them
        ev("klein.step", 0, 10_000),  # (a range known by its name where the flag is missing)
        ev("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 0, 3_000),
        ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 7_000, 10_000),
        ev("klein.denoise", 0, 10_000, device=cpu, annotation=True),
    ]
    prof = SimpleNamespace(events=lambda: events, key_averages=lambda: [])
    report = profile.summarise(prof, wall_ms=12.0)
    assert report["gpu_busy_ms"] == 6.0 and report["gpu_idle_ms"] == 4.0 and report["gpu_first_to_last_ms"] == 10.0
    assert report["kernels_by_family_ms"] == {"matmul": 3.0, "attention": 3.0}
    assert report["stage_spans_ms"] == {"klein.denoise": 10.0, "klein.step": 10.0}
    gap = report["largest_gaps"][0]
    assert (gap["ms"], gap["after"][:5], gap["before"][:5]) == (4.0, "nvjet", "cudnn")
    assert gap["host"]["klein"] == {"klein.denoise": 4.0}  # what the host was in during the gap


def test_nodes_speed_times_the_node_chain_against_the_engine(comfy_pack, tmp_path):
    """nodes_speed.py on the CPU: the node chain and the engine on the same files give one image
    (within a rounding step) and every time it reports (the ComfyUI host comes from comfy_pack)."""
    out = tmp_path / "ns.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "nodes_speed.py"), "--tiny", "--device", "cpu",
                           "--runs", "1", "--warmup", "0", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["nodes_ms"]) == {"loader", "encoder", "sampler", "vae_decode", "chain"}
    assert report["nodes_ms"]["chain"] > 0 and report["engine_ms"]["e2e"] > 0 and report["nodes_over_engine"] > 0
    assert {"text", "denoise", "decode"} <= set(report["engine_ms"])
    assert report["image_max_abs_diff"] <= 1  # the same model, prompt and seed on both sides
    assert all(report[k]["compiles"]["frames"] == 0 for k in ("nodes_host_audit", "engine_host_audit"))
    profiled = report["nodes_cprofile"]
    assert any("nodes/encode.py" in line and "(execute)" in line for line in profiled["cumulative"])
    assert any("nodes/sampler.py" in line for line in profiled["cumulative"]) and len(profiled["self"]) > 5
    under_torch = report["nodes_profile"]  # no GPU here: host events only, the nodes' ranges among them
    assert under_torch["wall_ms"] > 0 and under_torch["gpu_busy_ms"] == 0
    assert any(row["op"].startswith("klein.node.") for row in under_torch["cpu_ops_self_ms"])
    assert "nodes chain" in done.stdout
    loads = report["engine_load"]  # each file's load, timed
    assert set(loads) == {"transformer", "text_encoder", "vae"}
    for row in loads.values():
        assert row["s"] > 0 and row["file_gb"] > 0
        assert row["gb_per_s"] == pytest.approx(row["file_gb"] / row["s"], rel=0.05)
    assert "loads: transformer" in done.stdout and "without staged reads" in done.stdout
    assert report["engine_load_unstaged"]["transformer"]["file_gb"] == loads["transformer"]["file_gb"]


def test_profile_train_profiles_one_step_of_each_side(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    out = tmp_path / "pt.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_train.py"), "--tiny", "--device", "cpu",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["case"] == "4b"
    for side in ("ours", "diffusers"):
        r = report[side]
        assert r["wall_ms"] > 0 and r["gpu_busy_ms"] == 0 and r["cpu_ops_self_ms"]  # host operators on the CPU
        assert any(op["op"].startswith("aten::mm") or op["op"].startswith("aten::addmm") for op in r["cpu_ops_self_ms"])
    assert "family" in done.stdout and "ours" in done.stdout and "diffusers" in done.stdout
    assert report["speed"] == "plain"
    fast = tmp_path / "pt_fast.json"  # ours on the fast path alone (the GPU session's second run)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_train.py"), "--tiny", "--device", "cpu",
                           "--warmup", "1", "--speed", "fast", "--no-diffusers", "--out", str(fast)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(fast.read_text())
    assert report["speed"] == "fast" and "ours" in report and "diffusers" not in report
    assert "ours at speed fast" in done.stdout


def test_host_audit_counts_collections_and_compilations():
    """benchmarks/host_audit.py: a forced full collection and a new compiled frame inside the block are
    counted (and the collection is a profiler range); an empty block counts nothing; the callback is
    removed on exit."""
    import gc

    audit_mod = load_script("klein_host_audit", REPO / "benchmarks" / "host_audit.py")
    with audit_mod.HostAudit() as idle:
        pass
    assert idle.result()["gc"]["gen2"]["count"] == 0 and idle.result()["compiles"].get("frames", 0) == 0

    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with audit_mod.HostAudit(profile=True) as audit:
            gc.collect()
            f(torch.ones(3))
            f(torch.ones(3))  # the same shape: no second compilation
    out = audit.result()
    assert out["gc"]["gen2"]["count"] >= 1 and out["gc"]["largest_ms"] > 0
    assert out["compiles"]["frames"] == 1
    assert any(e.name == "python.gc.gen2" for e in prof.events())
    assert audit._callback not in gc.callbacks
    with audit_mod.HostAudit() as again:  # the same shape again: compiled already, nothing new
        f(torch.ones(3))
    assert again.result()["compiles"]["frames"] == 0


def test_vae_decode_finds_what_is_live_at_the_peak():
    """vae_decode.py's allocator-history replay: the peak is the most bytes live at once (memory
    allocated before the history is not counted, a free of it is ignored), and the allocations
    live then are named by our line and the torch function that allocated them."""
    vae_decode = load_script("klein_vae_decode_benchmark", REPO / "benchmarks" / "vae_decode.py")
    conv = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "conv2d"},
            {"filename": "/repo/klein_core/models/vae.py", "line": 88, "name": "forward"}]
    norm = [{"filename": "/repo/klein_core/models/vae.py", "line": 40, "name": "group_norm"}]
    mb = 2**20
    events = [
        {"action": "free_completed", "addr": 9, "size": 500 * mb},  # allocated before the history
        {"action": "alloc", "addr": 1, "size": 256 * mb, "frames": conv},
        {"action": "alloc", "addr": 2, "size": 1024 * mb, "frames": norm},  # a workspace, say
        {"action": "alloc", "addr": 3, "size": 64 * mb, "frames": conv},  # peak: 1344 MB
        {"action": "free_completed", "addr": 2, "size": 1024 * mb},
        {"action": "alloc", "addr": 4, "size": 512 * mb, "frames": norm},  # 832 MB: below the peak
    ]
    found = vae_decode.live_at_peak(events)
    assert found["mb"] == 1344
    assert [a["mb"] for a in found["largest"]] == [1024, 256, 64]
    assert found["largest"][0]["where"] == "klein_core/models/vae.py:40 group_norm"
    assert found["largest"][1]["where"] == "klein_core/models/vae.py:88 forward <- conv2d"
    assert vae_decode.live_at_peak([]) == {"mb": 0.0, "largest": []}
    assert vae_decode.live_at_peak(events, top=1)["largest"] == found["largest"][:1]
