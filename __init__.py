"""FLUX.2 Klein node pack for ComfyUI.

Outside ComfyUI this file does nothing, so ``klein_core`` and the tests import without the host.
Inside ComfyUI the pack folder is imported as a package; its directory is put on ``sys.path`` so
``klein_core`` resolves to the same module whether used by the nodes, the CLI or a user script.
The nodes use ComfyUI's V3 node API (``comfy_api.latest``): ComfyUI 0.3.75 or newer.
"""

import importlib.util
import logging
import os
import sys

MIN_COMFYUI = "0.3.75"

try:
    import comfy_api.latest  # noqa: F401  (present only inside a ComfyUI host that has the V3 API)
except ImportError:
    _IN_COMFY = False
    if importlib.util.find_spec("folder_paths") is not None and importlib.util.find_spec("comfy") is not None:
        # Inside a ComfyUI too old for V3 nodes: say so once instead of registering nothing silently.
        logging.getLogger(__name__).error(
            "FLUX.2 Klein nodes need ComfyUI %s or newer (its V3 node API, comfy_api.latest); this ComfyUI has "
            "none, so no Klein node is registered. Update ComfyUI and restart.", MIN_COMFYUI)
else:
    _IN_COMFY = True

if _IN_COMFY:
    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.insert(0, _here)
    from .nodes import comfy_entrypoint  # noqa: E402,F401
