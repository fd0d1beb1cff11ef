"""klein_core.testing.sync_callers names a synchronising CUDA call by its caller outside torch.

On the H100 (torch 2.11) a ``Stream.synchronize`` warned at torch's own wrapper
(``torch/cuda/streams.py:108``), so the GPU suite's one-wait test could not tell whose wait it was.
Here a stand-in wrapper in a folder of its own plays torch's part, on the CPU: the warning it raises
carries the wrapper's location, and the recorder must name the line that called the wrapper.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings
from pathlib import Path

import pytest

from klein_core.testing.sync import is_sync_warning, sync_callers

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's text (c10/cuda/CUDAFunctions)


@pytest.fixture
def wrapper(tmp_path: Path):
    """``(module, folder)``: a module whose ``synchronize()`` warns as torch's debug mode does, from
    inside the wrapper (the warning's own location is the wrapper's line)."""
    folder = tmp_path / "fake_torch" / "cuda"
    folder.mkdir(parents=True)
    (folder / "streams.py").write_text(
        "import warnings\n\n\n"
        "def synchronize():\n"
        f"    warnings.warn({SYNC_MESSAGE!r}, UserWarning)\n")
    spec = importlib.util.spec_from_file_location("fake_torch_streams", folder / "streams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module, str(tmp_path / "fake_torch") + os.sep


def _here() -> str:
    """``file:line`` of the caller's next line."""
    frame = inspect.currentframe().f_back  # type: ignore[union-attr]
    return f"{frame.f_code.co_filename}:{frame.f_lineno + 1}"  # type: ignore[union-attr]


def test_a_wait_through_a_wrapper_is_named_by_its_caller(wrapper):
    module, skip = wrapper
    with warnings.catch_warnings(record=True) as plain:  # what the warning itself says: the wrapper
        warnings.simplefilter("always")
        module.synchronize()
    assert plain[0].filename == module.__file__

    with sync_callers(enabled=True, switch=False, skip=(skip,)) as waits:
        first = _here()
        module.synchronize()
        second = _here()
        module.synchronize()
    assert waits == [f"{first}: {SYNC_MESSAGE}", f"{second}: {SYNC_MESSAGE}"]


def test_other_warnings_go_on_and_the_filters_come_back(wrapper):
    module, skip = wrapper
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with sync_callers(enabled=True, switch=False, skip=(skip,)) as waits:
            warnings.warn("a deprecation the user must still see", DeprecationWarning)
            module.synchronize()
    assert [str(w.message) for w in outside] == ["a deprecation the user must still see"]
    assert len(waits) == 1
    assert warnings.filters == before


def test_off_cuda_nothing_is_recorded_and_nothing_is_caught(wrapper):
    module, skip = wrapper
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with sync_callers(enabled=False, skip=(skip,)) as waits:
            module.synchronize()
    assert waits == [] and len(outside) == 1


def test_the_prototype_notice_is_not_a_wait():
    assert is_sync_warning(SYNC_MESSAGE)
    assert not is_sync_warning("Synchronization debug mode is a prototype feature and does not yet detect all "
                               "synchronizing operations")
    assert not is_sync_warning("some other warning")
