"""What an image's metadata says made it (klein_core.provenance): versions, device, fast paths."""

from __future__ import annotations

import torch

import klein_core
from klein_core import provenance
from klein_core import testing as demo
from klein_core.accel import speed


def test_run_environment_names_versions_device_and_kernels(monkeypatch):
    """What an image's metadata says ran: versions, the device (a GPU by its name, "cuda" without an
    index as the current one) and the fast paths' description."""
    model = demo.tiny_transformer()
    env = provenance.run_environment(model)
    assert env == {"klein_core": klein_core.__version__, "torch": torch.__version__, "device": "cpu",
                   "fast_paths": speed.describe_speed(model)}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    assert provenance.device_name(torch.device("cuda")) == "cuda:1 (Fake GPU 1)"
    assert provenance.device_name(torch.device("cuda:0")) == "cuda:0 (Fake GPU 0)"
    assert provenance.device_name(torch.device("mps")) == "mps"
