"""Training checkpoints are safetensors with JSON metadata: the optimizer's int-keyed state, tuples and
plain values come back as they were, and a file that is not a checkpoint (a pickle in particular) is
refused by name, never unpickled."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from klein_core.errors import WeightFormatError
from klein_core.train.state_file import load_state, save_state


def test_state_round_trips_with_key_types_tuples_and_tensors(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.99))
    opt.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    opt.step()
    state = {"step": 7, "losses": [0.5, float("nan")], "optimizer": opt.state_dict(), "seed": None,
             "torch_rng": torch.get_rng_state(), "scalar": torch.tensor(2.5)}
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert back["step"] == 7 and back["seed"] is None and back["losses"][0] == 0.5 and back["losses"][1] != back["losses"][1]
    assert torch.equal(back["torch_rng"], state["torch_rng"]) and torch.equal(back["scalar"], state["scalar"])
    assert list(back["optimizer"]["state"]) == [0]  # int keys stay ints
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    for name, t in state["optimizer"]["state"][0].items():
        assert torch.equal(back["optimizer"]["state"][0][name], t), name
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 2))], lr=1.0)
    fresh.load_state_dict(back["optimizer"])  # what resume does
    assert fresh.param_groups[0]["lr"] == 1e-3
    assert not (tmp_path / ".s.safetensors.tmp").exists()


def test_files_that_are_not_checkpoints_are_refused_by_name(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "lora.safetensors")
    with pytest.raises(WeightFormatError, match="lora.safetensors: not a klein_core training checkpoint"):
        load_state(tmp_path / "lora.safetensors")

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    (tmp_path / "evil.safetensors").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(WeightFormatError, match="evil.safetensors.*pickle") as err:
        load_state(tmp_path / "evil.safetensors")
    assert "unpickled" not in str(err.value)


def test_an_unstorable_value_is_named(tmp_path):
    with pytest.raises(TypeError, match="holds a set"):
        save_state({"x": {1, 2}}, tmp_path / "s.safetensors")
