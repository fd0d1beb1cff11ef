"""benchmarks/train_speed.py's plumbing on the CPU: every case trains with klein_core and with the
diffusers + peft peer on the same shapes and the same number of LoRA parameters (its numbers only mean
something on a GPU), and the GPU session's ``train`` phase runs in a dry run."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import require
from script_module import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "train_speed.py"


def _bench():
    return load_script("klein_train_speed_benchmark", SCRIPT)


@pytest.mark.parametrize("preset_name", ["style", "structure", "full"])
def test_peer_targets_are_diffusers_linears(preset_name):
    """Every linear our preset adapts has its diffusers name(s) in diffusers' Flux2 transformer, with
    our rank and alpha (for each preset, on both tiny sizes)."""
    diffusers = require("diffusers")
    bench = _bench()
    for model in ("4b", "9b"):
        cfg = bench.transformer_config(model, tiny=True)
        args = bench.parse_args(["--preset", preset_name, "--rank", "4", "--tiny"])
        targets = bench.peer_targets(cfg, args)
        with torch.device("meta"):
            dm = diffusers.Flux2Transformer2DModel(
                patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.depth, num_single_layers=cfg.depth_single,
                attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
                joint_attention_dim=cfg.context_dim, mlp_ratio=cfg.mlp_hidden / cfg.hidden_size,
                axes_dims_rope=cfg.axes_dim, guidance_embeds=False)
        linears = {n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)}
        assert targets and set(targets) <= linears, sorted(set(targets) - linears)
        assert {r for r, _ in targets.values()} == {4} and {a for _, a in targets.values()} == {4.0}


def test_unknown_case_is_refused():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--cases", "4b,9b_int4"])
    assert bench.parse_args(["--cases", "all"]).cases == list(bench.CASES)
    assert bench.parse_args(["--cases", "9b_edit_fp8,4b"]).cases == ["4b", "9b_edit_fp8"]  # documented order


def test_speed_puts_our_model_on_that_path(tmp_path, monkeypatch):
    """``--speed fast`` sets our transformer as ``TrainJob(speed="fast")`` does, before the first case,
    and the report says so; an unknown speed is refused."""
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--speed", "fastest"])
    speeds = []
    real = bench.apply_speed
    monkeypatch.setattr(bench, "apply_speed", lambda **kw: speeds.append(kw["speed"]) or real(**kw))
    report = bench.main(["--tiny", "--device", "cpu", "--cases", "4b", "--speed", "fast", "--no-diffusers",
                         "--warmup", "1", "--steps", "1", "--out", str(tmp_path / "t.json")])
    assert speeds == ["fast"] and report["args"]["speed"] == "fast"
    assert bench.parse_args([]).speed == "fast"  # TrainJob's default
    assert report["rows"]["4b"]["ours"]["s_per_step"] > 0


def _check_report(report: dict, fp8_forced: bool) -> None:
    bench = _bench()
    assert report["env"]["device"] == "cpu" and report["env"]["torch"] == torch.__version__ and report["env"]["date"]
    assert report["env"]["dtype"] == "torch.bfloat16"
    assert list(report["rows"]) == list(bench.CASES)
    for name, row in report["rows"].items():
        ours, peer = row["ours"], row["diffusers"]
        for side in (ours, peer):
            assert "error" not in side, (name, side)
            assert side["s_per_step"] > 0 and math.isfinite(side["s_per_step"]), (name, side)
            assert side["it_per_s"] == pytest.approx(1 / side["s_per_step"])
            assert len(side["step_s"]) == 2 and len(side["losses"]) == 3 and side["finite"]
            assert side["peak_gb"] is None  # the CPU has no allocator statistics
            assert side["lora_dtype"] == "torch.float32"
        # the peer trains exactly as many LoRA parameters (split q/k/v included)
        assert ours["lora_params"] == peer["lora_params"] > 0 and row["lora_params_match"] is True
        assert row["diffusers_over_ours"] > 0
        if row["precision"] == "fp8":
            assert ours["fp8_layers"] > 0
            # the fp8 matmul trains (its backward goes through the upcast weight): no fallback needed
            assert "fp8_auto_error" not in ours
            assert ours["fp8_matmul"] == ("scaled_mm" if fp8_forced else "auto")
        if name == "9b_blocks":  # each of the 3 steps (1 warm-up, 2 timed) streamed every block twice
            cfg = bench.transformer_config("9b", True)
            assert ours["streamed_loads"] == 3 * 2 * (cfg.depth + cfg.depth_single)
        assert row["verdict"] == ("no target" if name in ("9b", "9b_edit", "9b_blocks") else "not measured")
    assert "time_over_9b_fp8" in report["rows"]["9b_edit_fp8"]
    assert any(line.startswith("9b_edit_fp8 / 9b_fp8 time per step") for line in report["summary"])


@pytest.mark.slow
def test_tiny_run_with_the_diffusers_peer(tmp_path):
    """Every case, ours and diffusers', on the CPU in bf16 (the GPU's dtype); the fp8 cases force the
    fp8 matmul (the path an H100 takes), whose backward must work."""
    require("diffusers")
    require("peft")
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--warmup", "1", "--steps", "2",
                           "--dtype", "bf16", "--fp8-matmul", "scaled_mm", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    _check_report(report, fp8_forced=True)
    table = done.stdout[done.stdout.index("| case |"):]
    for name in report["rows"]:
        assert f"\n| {name} |" in table
    assert "fp8 is klein_core's only: the diffusers column of an fp8 row is diffusers' bf16 model" in table


@pytest.mark.slow
def test_gpu_session_dry_run_train(tmp_path):
    """``gpu_session.sh --dry-run train`` from a copy of the script with no carry pack (so nothing is
    installed into /tmp/site): the phase runs train_speed.py --tiny and writes train.json."""
    require("diffusers")
    fake = tmp_path / "repo"
    (fake / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "gpu_session.sh", fake / "benchmarks" / "gpu_session.sh")
    (fake / "benchmarks" / "train_speed.py").symlink_to(SCRIPT)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(fake / "benchmarks" / "gpu_session.sh"), "--dry-run", "train"],
                          check=False, capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout[done.stdout.index("--- summary"):]
    assert "train rc=0 " in summary, summary
    report = json.loads((out / "train.json").read_text())
    assert set(report["rows"]) == set(_bench().CASES)
    assert all("s_per_step" in r["ours"] and "s_per_step" in r["diffusers"] for r in report["rows"].values())
