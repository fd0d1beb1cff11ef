"""The exception types klein_core raises on purpose, in one place (no module imports another's).

Every one is a subclass of a built-in type a caller may already catch (``ValueError`` or
``RuntimeError``), so code written against the built-ins keeps working.
"""

from __future__ import annotations

import torch


class WeightFormatError(ValueError):
    """A weight file that cannot be read or is in a format the core does not run.

    The message names the file, what it is (or seems to be) and what to use instead.
    """


class NonFiniteWeights(WeightFormatError, FloatingPointError):
    """A model's weights hold NaN or Inf (a corrupt file): both a file problem and the numeric
    failure it causes; the message names the tensor and the file."""


class KleinOutOfMemory(torch.OutOfMemoryError):
    """The device ran out of memory (or a request was refused because it would); the message says
    which setting to lower. Memory was released before raising.

    A ``torch.OutOfMemoryError`` (so a ``RuntimeError``): hosts that handle running out of memory
    handle it too (ComfyUI unloads its models and shows its memory tips)."""


class GenerationCancelled(RuntimeError):
    """Raised when a step callback returned ``False`` to stop the run."""


__all__ = ["GenerationCancelled", "KleinOutOfMemory", "NonFiniteWeights", "WeightFormatError"]
