"""Shared by the text encoder's speed tests (test_text_encoder_compile, test_text_graph): dynamo's
caches cleared around each test, and token ids of a few prompts."""

from __future__ import annotations

import pytest
import torch

from klein_core.pipeline.tokenizer import tokenize_prompts


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Autouse in a module that imports it: every test starts and ends with dynamo's caches empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tokens(prompts: tuple[str, ...] = ("a red fox in the snow", "two cats"), length: int = 40
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) ``[len(prompts), length]`` of ``prompts``, right-padded as Klein pads them."""
    return tokenize_prompts(list(prompts), max_length=length)
