"""klein_core.checks.is_finite: one reduction instead of isfinite's passes, with the same answers.

The reference is numpy's element-wise ``isfinite`` on the same values (float8 through float32),
never the function under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from klein_core.checks import is_finite

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _reference(t: torch.Tensor) -> bool:
    if not t.is_floating_point():
        return True
    return bool(np.isfinite(t.to(torch.float64).numpy()).all())


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 33, generator=g).to(dtype)
    big = torch.finfo(dtype).max
    out = {"random": base, "empty": torch.empty(0, 3, dtype=dtype), "scalar": torch.tensor(1.5, dtype=dtype),
           "max values (the sum overflows)": torch.full((64,), big, dtype=dtype),
           "max and -max": torch.tensor([big, -big, big], dtype=dtype)}
    for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
        t = base.clone()
        t[2, 7] = value
        out[name] = t
    both = base.clone()
    both[0, 0], both[1, 1] = float("inf"), float("-inf")  # their sum is NaN: still caught
    out["inf and -inf"] = both
    nan_among_max = torch.full((64,), big, dtype=dtype)
    nan_among_max[5] = float("nan")
    out["nan among max values"] = nan_among_max
    return out


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_every_case_matches_numpy(dtype):
    for name, t in _cases(dtype).items():
        assert is_finite(t) is _reference(t), (dtype, name)
        assert is_finite(t[..., ::2] if t.ndim else t) is _reference(t[..., ::2] if t.ndim else t), (dtype, name)


def test_float8_and_integers():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    x = torch.randn(8, 8).to(torch.float8_e4m3fn)
    assert is_finite(x)
    y = x.clone()
    y.view(torch.uint8)[3, 3] = 0x7F  # e4m3fn's NaN pattern
    assert not is_finite(y)
    assert is_finite(torch.tensor([1, 2, 3])) and is_finite(torch.tensor([True, False]))


def test_a_large_tensor_is_one_pass_on_the_host(monkeypatch):
    """The common case (every value finite) reduces once and never builds isfinite's mask."""
    calls = []
    monkeypatch.setattr(torch, "isfinite", lambda *a, **k: calls.append(1) or torch.tensor(True))
    assert is_finite(torch.randn(1, 128, 64, 64))
    assert calls == []
