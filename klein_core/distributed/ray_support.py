"""The one place Ray is imported: lazily, with one clear error and the install hint when it is missing."""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "klein-nodes[ray]"'


class RayMissing(ImportError):
    """Ray (or the part of it a command needs) is not installed; the message says how to install it."""


def require_ray(part: str | None = None) -> ModuleType:
    """Import and return ``ray`` (``part``: also ``"data"`` or ``"serve"``, returned instead).

    Raises :class:`RayMissing` naming the missing module and :data:`INSTALL_HINT`.
    """
    name = "ray" if part is None else f"ray.{part}"
    try:
        importlib.import_module("ray")
        return importlib.import_module(name)
    except ImportError as exc:
        raise RayMissing(f"{name} is not installed ({exc.name or exc}); batch and serve run on Ray: "
                         f"{INSTALL_HINT}") from None


def init_ray(address: str | None, *, num_cpus: int | None = None, quiet: bool = True) -> ModuleType:
    """Connect to the Ray cluster at ``address`` (None: ``RAY_ADDRESS`` if set, else a new local
    cluster, as ``ray.init()`` does); a session already connected is reused. Returns ``ray``."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict = {"include_dashboard": False, "log_to_driver": not quiet}
    if address is not None:
        kwargs["address"] = address
    elif num_cpus is not None and not os.environ.get("RAY_ADDRESS"):
        kwargs["num_cpus"] = num_cpus
    ray.init(**kwargs)
    logger.info("ray: %s", ray.get_runtime_context().gcs_address)
    return ray
