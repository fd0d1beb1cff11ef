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


def _foreign_core(here: str) -> str | None:
    """The folder of the ``klein_core`` that ``import klein_core`` gives, if it is not this pack's own.

    There is one ``klein_core`` per process, so a second copy of the pack in ``custom_nodes`` (an old
    clone left next to a new one) would run its nodes on the first copy's core: other code than its
    own, silently."""
    import klein_core

    theirs = os.path.realpath(next(iter(klein_core.__path__)))  # realpath: a symlinked pack is the same copy
    return None if theirs == os.path.realpath(os.path.join(here, "klein_core")) else theirs


if _IN_COMFY:
    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.insert(0, _here)
    _other = _foreign_core(_here)
    if _other is not None:
        # Registering would replace the first copy's nodes by ones running on that copy's core: keep
        # the first copy's nodes and name both folders, so the user can remove one.
        logging.getLogger(__name__).error(
            "FLUX.2 Klein nodes in %s are not registered: another copy of the pack (%s) is already "
            "loaded. Keep one copy of the pack in custom_nodes and restart ComfyUI.",
            _here, os.path.dirname(_other))
    else:
        from .nodes import comfy_entrypoint  # noqa: E402,F401
