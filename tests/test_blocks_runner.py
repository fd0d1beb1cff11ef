"""``Flux2Transformer.forward(blocks_runner=...)``: a host runs the blocks itself (ComfyUI's block patches
on Klein Model to MODEL, nodes/model_patches.py). A runner that runs them as :meth:`BlockStack.run` does,
block by block, gives the same bytes as no runner; what a runner changes reaches the output; a step cache
and a runner together are refused."""

from __future__ import annotations

import pytest
import torch

from klein_core.accel import disable_step_cache, enable_step_cache
from klein_core.models.transformer import BlockStack
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.testing import tiny_transformer


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = position_ids(3, 4)
    return {"img": torch.randn(2, ids.shape[0], model.config.in_channels, generator=g), "img_ids": ids,
            "txt": torch.randn(2, 5, model.config.context_dim, generator=g), "txt_ids": text_position_ids(5),
            "timesteps": torch.tensor([0.7, 0.2])}


def _by_hand(blocks: BlockStack, x: torch.Tensor, c: torch.Tensor, calls: list) -> torch.Tensor:
    for i in range(len(blocks.model.double_blocks)):
        calls.append(("double", i))
        x, c = blocks.double(i, x, c)
    h = torch.cat([c, x], dim=1)
    for i in range(len(blocks.model.single_blocks)):
        calls.append(("single", i))
        h = blocks.single(i, h)
    return h[:, c.shape[1]:]


def test_a_runner_that_runs_every_block_gives_the_same_bytes():
    model = tiny_transformer()
    calls: list = []
    with torch.no_grad():
        plain = model(**_inputs(model))
        ran = model(**_inputs(model), blocks_runner=lambda b, x, c: _by_hand(b, x, c, calls))
        other = model(**_inputs(model, seed=1), blocks_runner=lambda b, x, c: _by_hand(b, x, c, []))
    assert calls == [("double", 0), ("single", 0), ("single", 1)]
    assert torch.equal(ran, plain)
    assert not torch.equal(other, plain)  # the runner's output is the model's, not a stored one


def test_what_a_runner_changes_reaches_the_output():
    model = tiny_transformer()

    def skip_last_single(blocks, x, c):
        for i in range(len(blocks.model.double_blocks)):
            x, c = blocks.double(i, x, c)
        h = torch.cat([c, x], dim=1)
        for i in range(len(blocks.model.single_blocks) - 1):
            h = blocks.single(i, h)
        return h[:, c.shape[1]:]

    with torch.no_grad():
        plain = model(**_inputs(model))
        skipped = model(**_inputs(model), blocks_runner=skip_last_single)
    assert (skipped - plain).abs().max() > 1e-3


def test_a_runner_with_a_step_cache_is_refused():
    model = tiny_transformer()
    enable_step_cache(model)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="blocks_runner cannot run with a step cache"):
            model(**_inputs(model), blocks_runner=lambda b, x, c: b.run(x, c))
    finally:
        disable_step_cache(model)
    with torch.no_grad():
        assert torch.isfinite(model(**_inputs(model), blocks_runner=lambda b, x, c: b.run(x, c))).all()
