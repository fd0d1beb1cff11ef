"""Quantised weights in memory (the layers and their maths); reading quantised files is :mod:`klein_core.files`."""

from .fp8 import FP8Linear, dequantize, fp8_layers, quantize_fp8, quantize_model_

__all__ = ["FP8Linear", "dequantize", "fp8_layers", "quantize_fp8", "quantize_model_"]
