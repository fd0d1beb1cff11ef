"""Node options checked against the engine called directly; bugs found by hunting, each pinned by a
test that failed before its fix.

* docs/comfyui.md showed the Klein Reference Stacker's ``sizes`` output for a 1200x900 picture as
  ``ref 1: 1024x768``; the stacker (like the engine) scales to at most 1 megapixel and crops to
  multiples of 16, which gives 1168x880. Users compare that text with the docs, so the example must
  be what the node prints.

Nodes run in ComfyUI 0.3.75's modules with tiny models (the ``comfy`` fixture of test_nodes.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_nodes import M4B, VAE, comfy  # noqa: F401 (fixture)

from klein_core.pipeline.images import prepare_reference_image

DOCS = Path(__file__).resolve().parents[1] / "docs" / "comfyui.md"


def test_stacker_sizes_example_in_the_docs_is_what_the_node_prints(comfy):  # noqa: F811
    # The example is read from the docs, so any later edit of it is checked too.
    match = re.search(r"`(ref 1: (\d+)x(\d+) \(from (\d+)x(\d+)\))`", DOCS.read_text(encoding="utf-8"))
    assert match, "docs/comfyui.md no longer shows a sizes example for Klein Reference Stacker"
    example, src_w, src_h = match.group(1), int(match.group(4)), int(match.group(5))
    image = torch.rand(1, src_h, src_w, 3, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        vae = comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto", "auto", "fast").args[1]
        _, sizes = comfy.pack.KleinReferenceStacker.execute(image, vae).args
    # What the engine feeds the VAE for this frame: the size the node must report.
    px = prepare_reference_image(comfy.references.frames_to_pil(image)[0], 16)
    assert sizes == f"ref 1: {px.shape[-1]}x{px.shape[-2]} (from {src_w}x{src_h})"
    assert sizes == example


def test_a_linked_guidance_passes_the_queue_check_and_is_checked_when_the_sampler_runs(comfy):  # noqa: F811
    """Was a bug: ComfyUI calls validate_inputs with None for an input fed by a link (a primitive node's
    value is not known when the prompt is queued); the sampler refused it ("got None"), so guidance
    could not be linked at all. The value is now checked when the node runs, with the same message."""
    sampler = comfy.pack.KleinSampler
    assert sampler.validate_inputs(None) is True
    assert sampler.validate_inputs(4.0) is True
    for bad in (float("nan"), 25.0, -1.0):
        assert "guidance must be a finite number from 0 to 20" in sampler.validate_inputs(bad)
        with pytest.raises(ValueError, match="guidance must be a finite number from 0 to 20"):
            sampler.execute(None, None, guidance=bad)  # refused before its other inputs are read
