"""Reading weight files: the safetensors reader, weight sources, load plans, key layouts."""
