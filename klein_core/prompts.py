"""Prompts -> embeddings: tokenize, encode with the Qwen3 encoder, and cache repeated prompts."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from .tokenizer import MAX_LENGTH, tokenize_prompts


class PromptCache:
    """Bounded LRU of prompt embeddings per (encoder, prompt, max_length).

    Entries hold a weak reference to their encoder, so a freed or reloaded encoder never serves
    stale embeddings. Bounded by entry count and by bytes.
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 1 << 30) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def _lookup(self, encoder: Any, prompt: str, max_length: int) -> torch.Tensor | None:
        key = (id(encoder), prompt, max_length)
        hit = self._data.get(key)
        if hit is None or hit[0]() is not encoder:
            return None
        self._data.move_to_end(key)
        return hit[1]

    def _store(self, encoder: Any, prompt: str, max_length: int, emb: torch.Tensor) -> None:
        # A copy: a slice of the batch output would keep the whole batch alive, and the byte cap
        # would count only the slice.
        self._data[(id(encoder), prompt, max_length)] = (weakref.ref(encoder), emb.clone())
        total = sum(t.numel() * t.element_size() for _, t in self._data.values())
        while self._data and (len(self._data) > self.max_entries or total > self.max_bytes):
            _, (_, old) = self._data.popitem(last=False)
            total -= old.numel() * old.element_size()

    def encode(self, encoder: Any, prompts: Sequence[str], max_length: int = MAX_LENGTH) -> torch.Tensor:
        """Embeddings ``[len(prompts), max_length, text_dim]``; only unseen prompts are encoded."""
        with self._lock:
            found = {p: self._lookup(encoder, p, max_length) for p in prompts}
        todo = [p for p, e in found.items() if e is None]
        self.hits += len(prompts) - len([p for p in prompts if found[p] is None])
        if todo:
            self.misses += len(todo)
            ids, mask = tokenize_prompts(todo, max_length=max_length)
            embs = encoder.encode(ids, mask)
            with self._lock:
                for p, e in zip(todo, embs):
                    found[p] = e[None]
                    self._store(encoder, p, max_length, e[None])
        return torch.cat([found[p] for p in prompts])  # type: ignore[misc]


default_prompt_cache = PromptCache()


def encode_prompts(
    text_encoder: Any, prompts: Sequence[str], *, cache: PromptCache | None = default_prompt_cache,
    max_length: int = MAX_LENGTH,
) -> torch.Tensor:
    """Tokenize and encode prompts: ``[len(prompts), max_length, text_dim]``, cached by default."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings; wrap a single prompt as [prompt]")
    if cache is None:
        ids, mask = tokenize_prompts(list(prompts), max_length=max_length)
        return text_encoder.encode(ids, mask)
    return cache.encode(text_encoder, list(prompts), max_length)


__all__ = ["PromptCache", "default_prompt_cache", "encode_prompts"]
