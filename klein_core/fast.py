"""``klein_core.fast``: the name the README gives for the fast paths; they live in :mod:`klein_core.accel`."""

from .accel.fast import *  # noqa: F403
from .accel.fast import __all__  # noqa: F401
