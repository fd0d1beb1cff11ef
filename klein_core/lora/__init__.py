"""LoRA / LyCORIS adapters for FLUX.2 Klein: read (:mod:`.read`), apply and remove (:mod:`.apply`).

Every Klein LoRA format maps onto the core's module names (:mod:`.formats`); see docs/lora.md.
"""

from .apply import AppliedLoRAs, LoRABranch, LoRASpec, apply_loras, check_loras, has_loras, with_loras
from .formats import TEXT_ENCODER, TRANSFORMER
from .patches import LoRA, LoRAPatch
from .read import load_lora

__all__ = [
    "TEXT_ENCODER", "TRANSFORMER", "AppliedLoRAs", "LoRA", "LoRABranch", "LoRAPatch", "LoRASpec", "apply_loras",
    "check_loras", "has_loras", "load_lora", "with_loras",
]
