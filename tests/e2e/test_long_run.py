"""A long-running host: 30 prompts in a row with model switches through the real ComfyUI server.

Three configurations (4B distilled, 4B base with CFG, the bigger "9B" sibling with its own encoder)
run in a cycle, so every prompt switches models and ComfyUI's output cache never short-cuts a run.
Each configuration must give bit-identical images every time it comes round, and the server
process must not grow in resident memory, threads or open files beyond small bounds.
Also: API prompts with wrong types / out-of-range values and path-traversal file names are
refused by validation, and the server stays usable.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from test_nodes_e2e import WORKFLOWS, klein  # noqa: F401  (klein is a fixture)

pytestmark = pytest.mark.e2e

CONFIGS = {
    "4b": {"model_name": "flux-2-klein-4b.safetensors", "model_kind": "distilled",
           "text_encoder": "qwen_3_4b.safetensors", "steps": 2, "guidance": 0.0},
    "base": {"model_name": "flux-2-klein-base-4b.safetensors", "model_kind": "base",
             "text_encoder": "qwen_3_4b.safetensors", "steps": 2, "guidance": 3.0},
    "9b": {"model_name": "flux-2-klein-9b.safetensors", "model_kind": "distilled",
           "text_encoder": "qwen_3_8b.safetensors", "steps": 2, "guidance": 0.0},
}
RSS_GROWTH_BOUND_MB = 200  # after warm-up; allocator noise on CPU is tens of MB


def _graph(cfg: dict, width: int = 96, height: int = 64) -> dict:
    g = json.loads((WORKFLOWS / "api" / "klein_4b_text_to_image.api.json").read_text())
    g["1"]["inputs"].update(model_name=cfg["model_name"], model_kind=cfg["model_kind"], weight_dtype="fp32")
    g["2"]["inputs"].update(text_encoder=cfg["text_encoder"], prompt="a lighthouse", negative_prompt="fog")
    g["3"]["inputs"].update(steps=cfg["steps"], guidance=cfg["guidance"], seed=11, width=width, height=height)
    return g


def _proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) // 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_thirty_prompts_with_model_switches(klein):  # noqa: F811
    srv = klein
    pid = srv.proc.pid
    order = ["4b", "base", "9b"] * 10
    digests: dict[str, set[str]] = {k: set() for k in CONFIGS}
    stats, times = [], []
    for i, name in enumerate(order):
        t0 = time.perf_counter()
        res = srv.run_prompt(_graph(CONFIGS[name]), timeout=120)
        times.append(time.perf_counter() - t0)
        assert res.ok, f"prompt {i} ({name}): {res.describe()}"
        (img,) = res.images
        raw = srv.view(**img)
        digests[name].add(hashlib.sha256(raw[raw.index(b"IDAT"):]).hexdigest())  # pixels, not metadata
        stats.append(_proc_stats(pid))
    # every configuration reproduced its image exactly each of its 10 times
    assert all(len(d) == 1 for d in digests.values()), {k: len(v) for k, v in digests.items()}
    assert len({next(iter(d)) for d in digests.values()}) == 3  # and the three differ
    warm, end = stats[5], stats[-1]
    growth = end["rss_mb"] - warm["rss_mb"]
    report = (f"RSS {warm['rss_mb']} -> {end['rss_mb']} MB (+{growth}), threads {warm['threads']} -> "
              f"{end['threads']}, fds {warm['fds']} -> {end['fds']}, median prompt {sorted(times)[15]:.2f} s")
    print(report)
    (srv.work_dir / "long_run.txt").write_text(report + "\n" + json.dumps(stats))
    assert growth < RSS_GROWTH_BOUND_MB, report
    assert end["threads"] <= warm["threads"] + 2, report
    assert end["fds"] <= warm["fds"] + 3, report


BAD_INPUTS = [
    ("3", "steps", "four"),
    ("3", "steps", -1),
    ("3", "width", 99999),
    ("3", "guidance", "nan"),
    ("3", "guidance", 25.0),
    ("3", "seed", -5),
    ("3", "batch_size", 0),
    ("1", "model_name", "../../../../etc/passwd"),
    ("1", "model_name", "/etc/passwd"),
    ("2", "text_encoder", "../text_encoders/qwen_3_4b.safetensors"),
]


@pytest.mark.parametrize("node,field,value", BAD_INPUTS)
def test_bad_api_inputs_are_validation_errors(klein, node, field, value):  # noqa: F811
    g = copy.deepcopy(_graph(CONFIGS["4b"]))
    g[node]["inputs"][field] = value
    status, body = klein.post_prompt(g)
    assert status == 400, (status, body)
    errors = body["node_errors"][node]["errors"]
    assert any(field in json.dumps(e) for e in errors), errors
    assert "Traceback" not in json.dumps(body)


def test_server_usable_after_bad_inputs(klein):  # noqa: F811
    res = klein.run_prompt(_graph(CONFIGS["4b"], 80, 64), timeout=120)
    assert res.ok, res.describe()
