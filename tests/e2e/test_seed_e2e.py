"""The seed reaches the picture in the real server: two seeds give two different images, and the same
seed run again (the sampler executing anew, not served from ComfyUI's output cache) the same image.
The other e2e tests only check that runs succeed, which a sampler ignoring its seed would pass."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from test_nodes_e2e import api, klein, node_id  # noqa: F401  (klein is a fixture)

pytestmark = pytest.mark.e2e


def _run(srv, seed: int) -> tuple[np.ndarray, bool]:
    """The decoded image of a small text-to-image run with ``seed``, and whether the sampler ran."""
    graph = api("klein_4b_text_to_image", width=64, height=64, steps=2, seed=seed)
    res = srv.run_prompt(graph, timeout=60)
    assert res.ok, res.describe()
    cached = {n for m in res.of_type("execution_cached") for n in m["nodes"]}
    (ref,) = res.images
    pixels = np.asarray(Image.open(io.BytesIO(srv.view(**ref))).convert("RGB"))
    return pixels, node_id(graph, "KleinSampler") not in cached


def test_seed_changes_the_image_and_the_same_seed_repeats_it(klein):  # noqa: F811
    first, ran = _run(klein, 424242)
    other, _ = _run(klein, 424243)
    again, ran_again = _run(klein, 424242)  # the graph differs from the last one: ComfyUI runs the sampler
    assert ran and ran_again, "the sampler's output came from ComfyUI's cache: the seed was never tested"
    assert not np.array_equal(first, other), "two seeds gave the same image"
    assert np.array_equal(first, again), "the same seed gave another image"
