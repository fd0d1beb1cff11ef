"""klein_core: an exact, self-contained PyTorch implementation of FLUX.2 Klein.

Never imports ComfyUI. Public API (stable names): see README.md.
"""

from .weights import WeightFormatError, WeightSource, open_weights

__all__ = ["WeightFormatError", "WeightSource", "open_weights"]
