"""The Triton kernels of klein_core.kernels against the plain PyTorch path, on the CPU.

The kernels run under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before Triton is first imported in a process: Triton's own library functions are decorated at
import time, and other test modules may import Triton (through torch or diffusers) during
collection. So :func:`test_kernels_under_triton_interpreter` re-runs this file in a child pytest
process with the variable set; there the other tests run, here they are skipped. No other test
ever sees the variable. Everything is skipped when Triton is not installed (CI installs it
through the ``test`` extra on Linux x86-64).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import klein_core
from klein_core import testing as demo
from klein_core.models.layers import rms_norm
from klein_core.models.transformer_math import NORM_EPS, apply_rope, rope_cos_sin
from klein_core.models.transformer_math import modulate as _modulate

_CHILD_FLAG = "KLEIN_KERNEL_TESTS_CHILD"
_IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install triton==3.9.0; Linux x86-64 only)",
)
child_only = pytest.mark.skipif(not _IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child process of "
                                                      "test_kernels_under_triton_interpreter")


@pytest.mark.skipif(_IN_CHILD, reason="this is the child process")
def test_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-rfE"]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{report}"
    assert " passed" in proc.stdout and " skipped" in proc.stdout, report  # the driver skips itself there


@pytest.fixture(scope="module")
def kernels():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from klein_core.accel import kernels as k

    ok, why = k.available("cpu")
    assert ok, why
    return k


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    # spacing of bf16 numbers around |x| (8 bits of mantissa)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within a few ulp; bf16/fp16: equal except for rare one-ulp flips."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        return
    diff = (out.float() - ref.float()).abs()
    if ref.dtype == torch.bfloat16:
        assert (diff <= _ulp_bf16(ref.float()) * 1.01).all(), f"max diff {diff.max():.3g}"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert (diff > 0).float().mean() < 0.01, f"{(diff > 0).float().mean():.3%} of elements differ"


def _plain_qk(parts, cos, sin):
    q = torch.cat([rms_norm(p[0].transpose(1, 2), p[2], NORM_EPS) for p in parts], dim=2)
    k = torch.cat([rms_norm(p[1].transpose(1, 2), p[3], NORM_EPS) for p in parts], dim=2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _ids(n_txt: int, h: int, w: int) -> torch.Tensor:
    return torch.cat([klein_core.text_position_ids(n_txt), klein_core.position_ids(h, w, t=10)])


@child_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim", [(3, 32), (24, 128)])
def test_qk_norm_rope_two_streams_into_joint_buffer(kernels, dtype, heads, dim):
    """Double-block layout: txt and img q/k read in place from fused qkv outputs (strided views),
    written at their offsets of one joint buffer, compared with norm -> cat -> rope."""
    g = torch.Generator().manual_seed(heads * dim)
    b, n_txt, (h, w) = 2, 5, (2, 3) if dim == 128 else (3, 4)
    axes = (dim // 4,) * 4
    cos, sin = rope_cos_sin(_ids(n_txt, h, w) * 7, axes, 2000.0)  # *7: larger angles
    parts = []
    for length in (n_txt, h * w):
        qkv = (torch.randn(b, length, 3 * heads * dim, generator=g) * 3).to(dtype)
        q, k, _ = (t.unflatten(-1, (heads, dim)) for t in qkv.chunk(3, dim=-1))
        wq = (1 + 0.2 * torch.randn(dim, generator=g)).to(dtype)
        wk = (1 + 0.2 * torch.randn(dim, generator=g)).to(dtype)
        parts.append((q, k, wq, wk))
    ref_q, ref_k = _plain_qk(parts, cos[None, None], sin[None, None])
    n = n_txt + h * w
    out_q = torch.full((b, n, heads, dim), float("nan"), dtype=dtype)  # poisoned: every row must be written
    out_k = torch.full_like(out_q, float("nan"))
    offset = 0
    for q, k, wq, wk in parts:
        assert not q.is_contiguous()
        kernels.qk_norm_rope_into(q, k, wq, wk, cos[None], sin[None], out_q, out_k, offset)
        offset += q.shape[1]
    _assert_matches(out_q.transpose(1, 2), ref_q)
    _assert_matches(out_k.transpose(1, 2), ref_k)


@child_only
def test_qk_norm_rope_per_batch_tables(kernels):
    g = torch.Generator().manual_seed(5)
    b, length, heads, dim = 2, 6, 2, 16
    ids = torch.stack([_ids(2, 2, 2), _ids(2, 2, 2) + 3])  # [B, N, 4]: different ids per item
    cos, sin = rope_cos_sin(ids, (4, 4, 4, 4), 2000.0)
    x = torch.randn(b, length, 2, heads, dim, generator=g)
    q, k = x[:, :, 0], x[:, :, 1]
    w = 1 + 0.1 * torch.randn(dim, generator=g)
    ref_q, ref_k = _plain_qk([(q, k, w, w)], cos[:, None], sin[:, None])
    out_q, out_k = torch.empty(b, length, heads, dim), torch.empty(b, length, heads, dim)
    kernels.qk_norm_rope_into(q, k, w, w, cos, sin, out_q, out_k)
    _assert_matches(out_q.transpose(1, 2), ref_q)
    _assert_matches(out_k.transpose(1, 2), ref_k)


@child_only
def test_qk_norm_rope_rejects_bad_arguments(kernels):
    q = torch.randn(1, 4, 2, 16)
    w = torch.ones(16)
    cos = torch.ones(1, 4, 16)
    out = torch.empty(1, 4, 2, 16)
    with pytest.raises(ValueError, match="power-of-two"):
        kernels.qk_norm_rope_into(q[..., :12], q[..., :12], w[:12], w[:12], cos[..., :12], cos[..., :12],
                                  out[..., :12].contiguous(), out[..., :12].contiguous())
    with pytest.raises(ValueError, match="float32"):
        kernels.qk_norm_rope_into(q, q, w, w, cos.double(), cos.double(), out, out)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.qk_norm_rope_into(q, q, w, w, cos, cos, out, out, offset=2)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.qk_norm_rope_into(q, q, w, w, cos, cos, out.transpose(1, 2), out)


@child_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [96, 128])
def test_modulate_matches_plain(kernels, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    b, length = 2, 9
    x = (torch.randn(b, length, dim, generator=g) * 4 + 1).to(dtype)
    mod = torch.randn(b, 1, 3 * dim, generator=g).to(dtype)
    shift, scale, _ = mod.chunk(3, dim=-1)  # strided views, as the model passes them
    out = kernels.modulate(x, shift, scale, NORM_EPS)
    _assert_matches(out, _modulate(x, shift, scale))


@child_only
def test_modulate_broadcasts_batch_one_modulation(kernels):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 32, generator=g)
    shift, scale = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    _assert_matches(kernels.modulate(x, shift, scale), _modulate(x, shift, scale))
    with pytest.raises(ValueError, match="shift"):
        kernels.modulate(x, torch.randn(2, 1, 32), scale)


@child_only
def test_bf16_rounding_is_nearest_even(kernels):
    """The kernels' bf16 rounding equals torch's cast, ties and specials included."""
    import triton

    # A Triton kernel resolves names through its module's globals; Triton is imported only here so
    # that collecting this file in the parent process never imports it.
    globals()["tl"] = importlib.import_module("triton.language")
    globals()["round_to"] = importlib.import_module("klein_core.accel.kernels._rounding").round_to

    @triton.jit
    def _round_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):  # noqa: F821
        i = tl.arange(0, BLOCK)  # noqa: F821
        m = i < n
        x = tl.load(x_ptr + i, mask=m)  # noqa: F821
        tl.store(o_ptr + i, round_to(x, tl.bfloat16).to(tl.bfloat16), mask=m)  # noqa: F821

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-20, 20, (2000,), generator=g).float())
    bits = base.view(torch.int32) & ~0xFFFF  # exact bf16 values ...
    ties = (bits | 0x8000).view(torch.float32)  # ... and the midpoints after them
    # (subnormals are left out: the interpreter's own bf16 store flushes them; activations never are)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895e38, -3.3895e38, 1.2e-38])
    x = torch.cat([base, ties, specials])
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    nan = torch.full((4,), float("nan"))
    _round_kernel[(1,)](nan, out, 4, BLOCK=4)
    assert out[:4].isnan().all()


@child_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_with_fused_kernels_matches_plain(kernels, dtype, caplog):
    from klein_core.accel import fast

    model = demo.tiny_transformer().to(dtype)
    ids = torch.cat([klein_core.position_ids(2, 3), klein_core.position_ids(2, 2, t=10)])
    g = torch.Generator().manual_seed(2)
    kw = dict(img=torch.randn(2, ids.shape[0], 128, generator=g), img_ids=ids,
              txt=torch.randn(2, 5, model.config.context_dim, generator=g),
              txt_ids=klein_core.text_position_ids(5),
              timesteps=torch.tensor([0.9, 0.4]))
    with torch.no_grad():
        ref = model(**kw)
        ops = fast.enable_fast_paths(model)
        with caplog.at_level("INFO", logger="klein_core.accel.fast"):
            out = model(**kw)
        fast.disable_fast_paths(model)
    assert "qk-norm+rope=triton, modulation=triton" in next(iter(ops.resolved().values()))
    assert "unavailable" not in caplog.text
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, rel


@child_only
def test_kernel_failing_its_self_check_is_switched_off(kernels, monkeypatch, caplog):
    """A kernel that computes wrong on this device/Triton is caught at first use, not trusted."""
    from klein_core.accel import fast

    model = demo.tiny_transformer()
    monkeypatch.setattr(kernels, "modulate", lambda x, shift, scale, eps=1e-6: torch.zeros_like(x))
    ids = klein_core.position_ids(2, 2)
    kw = dict(img=torch.randn(1, 4, 128), img_ids=ids, txt=torch.randn(1, 3, model.config.context_dim),
              txt_ids=klein_core.text_position_ids(3), timesteps=torch.tensor([0.5]))
    with torch.no_grad():
        ref = model(**kw)
        ops = fast.enable_fast_paths(model)
        with caplog.at_level("INFO", logger="klein_core.accel.fast"):
            out = model(**kw)
    assert "self-check is off" in caplog.text
    assert "qk-norm+rope=triton, modulation=plain" in ops.resolved()["cpu torch.float32"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
