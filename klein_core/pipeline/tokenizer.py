"""Qwen3 prompt tokenization for the FLUX.2 Klein text encoder, identical to the official tokenizer.

A prompt is wrapped in Qwen3's chat template (user turn, generation prompt, thinking disabled),
tokenized with Qwen3's byte-level BPE and right-padded. The tokenizer is built with ``tokenizers``
from the vocabulary in ``klein_core/data/qwen3`` (no download, no ``transformers``): NFC, the Qwen2
regex split then the byte-level mapping, BPE of 151,643 tokens (no unknown token, no byte fallback),
the 26 control tokens (ids 151643..151668) matched in the raw text, a byte-level decoder.

It is built on first use (about a second), under a lock, and cached for the process; encoding with
it is safe from several threads at once.
"""

from __future__ import annotations

import functools

import importlib.resources
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

logger = logging.getLogger(__name__)

QWEN3_PAD_ID: int = 151643
"""Id of ``<|endoftext|>``, Qwen3's pad token."""

MAX_LENGTH: int = 512
"""Sequence length FLUX.2 Klein pads (and truncates) every prompt to."""

QWEN3_BPE_VOCAB_SIZE: int = 151643
"""Number of byte-level BPE tokens in ``vocab.json`` (ids ``0 .. 151642``)."""

QWEN2_PRETOKENIZE_REGEX: str = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2/Qwen3 pre-tokenization pattern (same as ``transformers`` ``Qwen2Tokenizer``)."""

# (id, content, special) for every Qwen3 added token, in id order. The ``<|...|>`` tokens are
# special; the tool/think/fim/repo tokens are plain added tokens. Either way they are matched in
# the raw text before normalization and BPE.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)

_CHAT_PREFIX = "<|im_start|>user\n"
_CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

_DATA_SUBDIR = ("data", "qwen3")
_VOCAB_NAME = "vocab.json"
_MERGES_NAME = "merges.txt"

_tokenizer: Tokenizer | None = None
_tokenizer_lock = threading.Lock()


def chat_template(prompt: str) -> str:
    """Wrap ``prompt`` in Qwen3's chat template as a single user turn.

    As ``apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
    enable_thinking=False)``: no system message, no BOS, an empty ``<think>`` block.

    Args:
        prompt: the user's prompt, used verbatim.

    Returns:
        The templated text.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    return _CHAT_PREFIX + prompt + _CHAT_SUFFIX


def _read_data_file(name: str) -> str:
    """Return the text of a shipped Qwen3 vocabulary file (installed package or plain checkout)."""
    package = (__package__ or "").rpartition(".")[0]  # the data lives in klein_core/data, beside this package
    if package:
        try:
            resource = importlib.resources.files(package)
            for part in _DATA_SUBDIR:
                resource = resource / part
            resource = resource / name
            if resource.is_file():
                return resource.read_text(encoding="utf-8")
        except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
            logger.debug("importlib.resources lookup of %s failed; trying the module path", name)
    path = Path(__file__).resolve().parents[1].joinpath(*_DATA_SUBDIR, name)
    if not path.is_file():
        raise FileNotFoundError(
            f"Qwen3 tokenizer file {name!r} not found in package data (looked in {path}); "
            "the klein_core installation is incomplete"
        )
    return path.read_text(encoding="utf-8")


def _parse_merges(text: str) -> list[tuple[str, str]]:
    """Parse a GPT-2 style ``merges.txt`` (optional ``#version`` header, one ``a b`` pair a line)."""
    merges: list[tuple[str, str]] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"merges.txt line {line_no} is not a pair of tokens: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """Build the Qwen3 tokenizer from a BPE vocabulary and merge list.

    Args:
        vocab: byte-level BPE vocabulary, token -> id, ids ``0 .. len(vocab) - 1``
            (151,643 entries for Qwen3); must not contain the added tokens.
        merges: BPE merges in priority order.

    Returns:
        A ``tokenizers.Tokenizer`` with the Qwen3 normalizer, pre-tokenizer, decoder and the 26
        added tokens at ids 151643..151668. It adds no BOS/EOS and does no padding/truncation.
    """
    if len(vocab) != QWEN3_BPE_VOCAB_SIZE:
        raise ValueError(f"Qwen3 BPE vocabulary must have {QWEN3_BPE_VOCAB_SIZE} tokens, got {len(vocab)}")
    added_in_vocab = [content for _, content, _ in QWEN3_ADDED_TOKENS if content in vocab]
    if added_in_vocab:
        raise ValueError(f"Qwen3 BPE vocabulary already contains added tokens: {added_in_vocab}")

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()

    # Added one at a time, in id order, so each gets the next free id (= its official id).
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(content)
        if got != token_id:
            raise RuntimeError(f"added token {content!r} got id {got}, expected {token_id}")
    return tokenizer


def _load_tokenizer() -> Tokenizer:
    """Read the shipped vocabulary files and build the tokenizer (uncached)."""
    vocab = json.loads(_read_data_file(_VOCAB_NAME))
    if not isinstance(vocab, dict):
        raise ValueError(f"{_VOCAB_NAME} must hold a JSON object token -> id, got {type(vocab).__name__}")
    merges = _parse_merges(_read_data_file(_MERGES_NAME))
    tokenizer = build_tokenizer(vocab, merges)
    logger.debug("built Qwen3 tokenizer: %d BPE tokens, %d merges", len(vocab), len(merges))
    return tokenizer


def get_tokenizer() -> Tokenizer:
    """Return the process-wide Qwen3 tokenizer, building it on first call (thread-safe).

    Returns:
        The cached ``tokenizers.Tokenizer``; treat it as read-only (do not enable padding or
        truncation on it, other callers share it).
    """
    global _tokenizer
    tokenizer = _tokenizer
    if tokenizer is not None:
        return tokenizer
    with _tokenizer_lock:
        if _tokenizer is None:
            _tokenizer = _load_tokenizer()
        return _tokenizer


def _check_prompts(prompts: object) -> list[str]:
    """Validate the ``prompts`` argument and return it as a list of str."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of str, got a single str; pass [prompt] instead")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of str, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must contain at least one prompt, got an empty list")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{index}] must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a mis-decoded emoji
            raise ValueError(
                f"prompts[{index}] is not valid Unicode text: it has an unpaired surrogate "
                f"U+{ord(prompt[exc.start]):04X} at position {exc.start}; fix the text's encoding."
            ) from None
    return list(prompts)


def _encode(texts: list[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens added, no truncation)."""
    encodings = get_tokenizer().encode_batch(texts, add_special_tokens=False)
    return [encoding.ids for encoding in encodings]


def warn_cut(index: int, tokens: int, length: int, label: str | None = None) -> None:
    """Say that prompt ``index`` (its place in the caller's list), ``tokens`` tokens long, is cut at
    ``length``; ``label``: the name the user knows the text by instead ("negative prompt")."""
    logger.warning("%s is %d tokens after the chat template; truncated to max_length=%d "
                   "(%d tokens cut from the end)", label or f"prompt {index}", tokens, length, tokens - length)


def tokenize_prompts(
    prompts: list[str], max_length: int = MAX_LENGTH, *, truncate: bool = True, warn: bool = True
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Chat-template, tokenize, cut and right-pad ``prompts``, as the Hugging Face Qwen3 tokenizer with
    ``padding="max_length", truncation=True`` does (BFL, diffusers).

    Args:
        prompts: ``B`` prompts (a list; a bare str is refused). Empty prompts are allowed.
        max_length: ``L`` (>= 1); longer prompts are cut at the end (with a warning), shorter ones padded
            with :data:`QWEN3_PAD_ID`.
        truncate: False cuts nothing and pads to ``max(max_length, longest)`` (ComfyUI's way).
        warn: False leaves the warning for a cut prompt to the caller (:func:`warn_cut`).

    Returns ``(input_ids, attention_mask)``, both ``torch.long`` ``[B, L]``; the mask is 1 for real tokens.
    """
    texts = [chat_template(prompt) for prompt in _check_prompts(prompts)]
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int, got {type(max_length).__name__}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")

    all_ids = _encode(texts)
    length = max_length if truncate else max(max_length, *(len(ids) for ids in all_ids))
    input_ids = torch.full((len(texts), length), QWEN3_PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(texts), length), dtype=torch.long)
    for index, ids in enumerate(all_ids):
        if len(ids) > length:
            if warn:
                warn_cut(index, len(ids), length)
            ids = ids[:length]
        n = len(ids)
        input_ids[index, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[index, :n] = 1
    return input_ids, attention_mask  # type: ignore[return-value]


def count_tokens(prompt: str) -> int:
    """Number of tokens of ``chat_template(prompt)`` before truncation (for UI length warnings).
    Remembered for the last 256 prompts: the prompt cache asks again for every prompt it serves.

    Args:
        prompt: one prompt.

    Returns:
        The token count, template tokens included (an empty prompt gives 12).
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a mis-decoded emoji
        raise ValueError(f"the prompt is not valid Unicode text: it has an unpaired surrogate "
                         f"U+{ord(prompt[exc.start]):04X} at position {exc.start}; fix the text's "
                         "encoding.") from None
    return _count(prompt)


@functools.lru_cache(maxsize=256)
def _count(prompt: str) -> int:
    return len(_encode([chat_template(prompt)])[0])


def decode(ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
    """Turn token ids back into text (for debugging).

    Args:
        ids: ``[N]`` token ids (a list or a 1-D tensor); padding is decoded as ``<|endoftext|>``
            unless ``skip_special_tokens`` is set.
        skip_special_tokens: drop the special ``<|...|>`` tokens from the output.

    Returns:
        The decoded text (invalid UTF-8 byte sequences are replaced by U+FFFD).
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"decode expects a 1-D tensor of ids, got shape {tuple(ids.shape)}")
        id_list = [int(i) for i in ids.tolist()]
    else:
        id_list = [int(i) for i in ids]
    return get_tokenizer().decode(id_list, skip_special_tokens=skip_special_tokens)
