"""Device memory: the planner (estimates, plans), placement (the one place that applies a plan) and tiling."""

from .placement import BlockOffloader, StagePlacer, offload_blocks, on_device, pin_memory_
from .planner import MemoryEstimate, MemoryPlan, MemoryRequest, ModelSizes, choose_plan, estimate, plan_for
from .tiling import decode_tiled, encode_tiled

__all__ = [
    "BlockOffloader", "MemoryEstimate", "MemoryPlan", "MemoryRequest", "ModelSizes", "StagePlacer", "choose_plan",
    "decode_tiled", "encode_tiled", "estimate", "offload_blocks", "on_device", "pin_memory_", "plan_for",
]
