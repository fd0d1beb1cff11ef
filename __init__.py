"""FLUX.2 Klein node pack for ComfyUI.

Outside ComfyUI this file does nothing, so ``klein_core`` and the tests import without the host.
Inside ComfyUI the pack folder is imported as a package; its directory is put on ``sys.path`` so
``klein_core`` resolves to the same module whether used by the nodes, the CLI or a user script.
"""

import os
import sys

try:
    import comfy_api.latest  # noqa: F401  (present only inside a ComfyUI host)
except ImportError:
    _IN_COMFY = False
else:
    _IN_COMFY = True

if _IN_COMFY:
    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.insert(0, _here)
    from .nodes import comfy_entrypoint  # noqa: E402,F401
