"""Reading weight files: the safetensors reader, weight sources, load plans, key layouts; and writing
files whole or not at all (:mod:`~klein_core.files.atomic`)."""
