"""The published FLUX.2 Klein variants and the Qwen3 encoders that go with them: the one table.

Sizes are always read from the weights; this table only gives them names, and says which text
encoder fits which transformer (the transformer's text width is 3 x the encoder's hidden size,
hidden states 9, 18 and 27 concatenated per token). Every message that names a model size or the
encoder to use reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One published Klein size: transformer shape, and the Qwen3 encoder (and its ComfyUI file)."""

    name: str
    hidden: int
    depth: int  # double-stream blocks
    depth_single: int  # single-stream blocks
    heads: int
    text_width: int  # 3 x encoder_hidden
    encoder: str
    encoder_hidden: int
    encoder_file: str


KLEIN_4B = Variant("Klein 4B", 3072, 5, 20, 24, 7680, "Qwen3-4B", 2560, "qwen_3_4b.safetensors")
KLEIN_9B = Variant("Klein 9B", 4096, 8, 24, 32, 12288, "Qwen3-8B", 4096, "qwen_3_8b.safetensors")
VARIANTS: tuple[Variant, ...] = (KLEIN_4B, KLEIN_9B)

# FLUX.2 [dev]: the same architecture family, refused by name (Mistral text encoder, guidance embedder).
DEV_HIDDEN = 6144
DEV_TEXT_WIDTH = 15360


def transformer_name(hidden: int, depth: int, depth_single: int, text_width: int) -> str:
    """"Klein 4B", "Klein 9B", or a description of another Flux2 transformer shape."""
    for v in VARIANTS:
        if (v.hidden, v.depth, v.depth_single, v.text_width) == (hidden, depth, depth_single, text_width):
            return v.name
    return f"Flux2 (hidden {hidden}, {depth}+{depth_single} blocks)"


def model_for_hidden(hidden: int) -> str:
    """The model a transformer width belongs to (for LoRAs, which carry widths, not depths)."""
    if hidden == DEV_HIDDEN:
        return "FLUX.2 [dev]"
    return next((v.name for v in VARIANTS if v.hidden == hidden), "a Flux2 transformer")


def encoder_name(hidden: int) -> str:
    """"Qwen3-4B", "Qwen3-8B" or "Qwen3 (hidden N)" for a Qwen3 hidden size."""
    return next((v.encoder for v in VARIANTS if v.encoder_hidden == hidden), f"Qwen3 (hidden {hidden})")


def encoder_model(hidden: int) -> str:
    """The encoder and the Klein size it serves, e.g. "Qwen3-4B (Klein 4B)"."""
    return next((f"{v.encoder} ({v.name})" for v in VARIANTS if v.encoder_hidden == hidden),
                "another Qwen3 text encoder")


def variant_for_text_width(text_width: int) -> Variant | None:
    return next((v for v in VARIANTS if v.text_width == text_width), None)


def encoder_for_text_width(text_width: int) -> str:
    """The encoder that gives ``text_width``, e.g. "Qwen3-4B (qwen_3_4b.safetensors, text width 7680)"."""
    v = variant_for_text_width(text_width)
    if v is not None:
        return f"{v.encoder} ({v.encoder_file}, text width {text_width})"
    return f"a Qwen3 encoder with hidden size {text_width // 3} (text width {text_width})"


class TextWidthMismatch(ValueError):
    """Raised by :func:`check_text_width`. It keeps both widths, so a caller that knows more (a node
    knows the file names and the fix in its UI) can restate it with :meth:`restated` instead of
    checking again."""

    def __init__(self, text_width: int, model_width: int, *, encoded_by: str, model: str,
                 fix: str | None = None) -> None:
        self.text_width, self.model_width = text_width, model_width
        super().__init__(f"{encoded_by} (text width {text_width}) does not fit {model}, which expects "
                         f"{model_width}: {fix or 'use ' + encoder_for_text_width(model_width)}.")

    def restated(self, *, encoded_by: str, model: str, fix: str | None = None) -> TextWidthMismatch:
        """The same mismatch told with other names for both sides and another ``fix``."""
        return TextWidthMismatch(self.text_width, self.model_width, encoded_by=encoded_by, model=model, fix=fix)


def check_text_width(text_width: int, model_width: int, *, encoded_by: str, model: str,
                     fix: str | None = None) -> None:
    """The one text-width check: raise :class:`TextWidthMismatch` (a ValueError), before any
    compute, when embeddings of ``text_width`` cannot feed a transformer of ``model_width``.

    ``encoded_by`` and ``model`` describe both sides ("the text encoder (Qwen3-4B)", "the Klein 9B
    transformer"); ``fix`` says what to do (default: the encoder to use).
    """
    if text_width == model_width:
        return
    raise TextWidthMismatch(text_width, model_width, encoded_by=encoded_by, model=model, fix=fix)


__all__ = [
    "DEV_HIDDEN", "DEV_TEXT_WIDTH", "KLEIN_4B", "KLEIN_9B", "TextWidthMismatch", "VARIANTS", "Variant",
    "check_text_width",
    "encoder_for_text_width", "encoder_model", "encoder_name", "model_for_hidden", "transformer_name",
    "variant_for_text_width",
]
