"""The GPU test suite: every public path of klein_core once on CUDA (bf16, small models), and at full
Klein 4B size where it fits.

Where it runs:

* ``pytest tests/gpu`` on a machine with CUDA: the device is ``cuda`` (or ``KLEIN_GPU_TESTS_DEVICE=cuda:N``),
  components in bf16; "small" models have the real head dim (128) so the attention backends and the
  fused kernels see the shapes of the real model; full-size tests build random-weight Klein 4B
  components directly on the GPU (meta device, then ``to_empty`` and an in-place random init).
* Without CUDA every test in this folder is skipped (the normal CPU run collects it too).
* ``KLEIN_GPU_TESTS_DEVICE=cpu pytest tests/gpu`` runs the same test logic on the CPU in float32 with
  the tiny models of :mod:`klein_core.testing`, so the assertions themselves are exercised without a
  GPU. Tests that need CUDA by nature (fp8 tensor cores, CUDA streams, cuDNN
  attention, inductor compilation, full-size models) skip there, naming why.
* ``KLEIN_GPU_TESTS_FULL=0`` skips the full-size tests on a GPU too (a quick pass).
* ``KLEIN_GPU_TESTS_DTYPE=bf16|fp32`` overrides the dtype (``cpu`` + ``bf16`` shows on the CPU what the
  bf16 tolerances are made of).

Measured differences go through the suite's ``parity`` fixture (tests/conftest.py): the end-of-run table
shows them with ``KLEIN_PARITY_TABLE=1`` or ``-v``; ``KLEIN_PARITY_JSON=path`` writes them as JSON.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from klein_core.pipeline.request import as_device

from .helpers import GIB, Target, build_full_4b, load_small, make_target

ENV_DEVICE = "KLEIN_GPU_TESTS_DEVICE"
ENV_FULL = "KLEIN_GPU_TESTS_FULL"
ENV_DTYPE = "KLEIN_GPU_TESTS_DTYPE"
HERE = Path(__file__).resolve().parent


def _target() -> tuple[torch.device | None, str | None]:
    """The device the suite runs on, or why it cannot run (then every test here is skipped)."""
    want = os.environ.get(ENV_DEVICE, "").strip().lower()
    if want == "cpu":
        return torch.device("cpu"), None
    if want and not want.startswith("cuda"):
        return None, f"{ENV_DEVICE}={want!r} is not understood: use cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        return None, (f"CUDA is not available (run with {ENV_DEVICE}=cpu to exercise the suite's logic on "
                      "the CPU)")
    try:
        # with its index: "cuda" alone is the current device, and torch.cuda.set_device refuses it
        return as_device(want or "cuda"), None
    except ValueError as exc:
        return None, f"{ENV_DEVICE}={want!r}: {exc}"


DEVICE, UNAVAILABLE = _target()
ON_CPU = DEVICE is not None and DEVICE.type == "cpu"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda(reason): needs a CUDA device; skipped in the CPU mode with the reason")
    config.addinivalue_line("markers", "full_size(gib): full-size Klein 4B on the GPU; needs gib GiB of GPU memory")


def _in_suite(item: pytest.Item) -> bool:
    try:
        Path(str(item.fspath)).resolve().relative_to(HERE)
    except ValueError:
        return False
    return True


def _gpu_gib() -> float:
    if DEVICE is None or DEVICE.type != "cuda":
        return 0.0
    return torch.cuda.get_device_properties(DEVICE).total_memory / GIB


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests without CUDA; in the CPU mode skip the CUDA-only and full-size ones."""
    full_off = os.environ.get(ENV_FULL, "1").strip().lower() in ("0", "false", "no")
    for item in items:
        if not _in_suite(item):
            continue
        if UNAVAILABLE is not None:
            item.add_marker(pytest.mark.skip(reason=UNAVAILABLE))
            continue
        cuda = item.get_closest_marker("cuda")
        if cuda is not None and ON_CPU:
            why = cuda.args[0] if cuda.args else "needs CUDA"
            item.add_marker(pytest.mark.skip(reason=f"CPU mode: {why}"))
        full = item.get_closest_marker("full_size")
        if full is not None:
            need = float(full.args[0]) if full.args else 40.0
            if ON_CPU:
                item.add_marker(pytest.mark.skip(reason="CPU mode: full-size Klein 4B runs only on a GPU"))
            elif full_off:
                item.add_marker(pytest.mark.skip(reason=f"{ENV_FULL}=0"))
            elif _gpu_gib() < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need:g} GiB of GPU memory, this GPU has "
                                                        f"{_gpu_gib():.0f}"))


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def gpu() -> Target:
    """The suite's device, dtype and small sizes (see :func:`helpers.make_target`)."""
    assert DEVICE is not None, UNAVAILABLE
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    name = os.environ.get(ENV_DTYPE, "").strip().lower()
    dtypes = {"": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
              "float32": torch.float32}
    if name not in dtypes:
        pytest.fail(f"{ENV_DTYPE}={name!r}: use bf16 or fp32", pytrace=False)
    return make_target(DEVICE, dtypes[name])


@pytest.fixture(scope="module")
def small(gpu):
    """Small components on the suite's device (module scope: tests must not change them for good)."""
    return load_small(gpu)


@pytest.fixture(scope="session")
def full4b(gpu):
    """Full-size random Klein 4B (transformer, text encoder, VAE) on the GPU in bf16 (about 14 GiB)."""
    comps = build_full_4b(gpu.device, gpu.dtype)
    gpu.sync()
    yield comps
    del comps
    torch.cuda.empty_cache()
