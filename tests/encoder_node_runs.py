"""The encoder node run again and again, for the tests of its CUDA graph replay in ComfyUI (on the
CPU with a stand-in recorder: tests/test_nodes_host.py; on a GPU: tests/gpu/test_gpu_nodes.py)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from klein_core.accel.text_graph import graphed_forward


def encode_runs(pack: ModuleType, cache: ModuleType, encoder_file: str, prompt: str,
                runs: int = 4) -> tuple[Any, list[tuple[int, int]]]:
    """The encoder node at its default speed on a freshly loaded encoder, ``runs`` times, each with
    a new prompt of one token length (``prompt`` numbered); returns the last run's conditioning and
    ``(captures, replays)`` of the encoder's graph after each run. Fails if ComfyUI's loading moved
    the graphs or made replay give up."""
    cache.release_all("a fresh encoder for this test")
    counts = []
    for i in range(runs):
        with torch.inference_mode():
            cond = pack.KleinTextEncode.execute(encoder_file, f"{prompt} {i}", "").args[0]
        forward = graphed_forward(cache._resident["text_encoder"][1])
        assert forward is not None and forward.disabled is None and forward.moves == 0, forward.disabled
        counts.append((forward.captures, forward.replays))
    return cond, counts


def assert_replayed_after_the_second_run(counts: list[tuple[int, int]]) -> None:
    """Run 0 records the prompt with the empty negative, run 1 the prompt alone; later runs replay."""
    assert [c for c, _ in counts[1:]] == [counts[1][0]] * (len(counts) - 1), counts
    assert [r for _, r in counts[1:]] == [counts[1][1] + k for k in range(len(counts) - 1)], counts
