"""LoRA training for FLUX.2 Klein (see docs/training.md): the flow-matching objective
(:mod:`.objective`), LoRA layers per block group (:mod:`.adapters`), one training step
(:mod:`.step`), the loop with checkpoints and exact resume (:mod:`.trainer`), data and caches
(:mod:`.data`), saving (:mod:`.save`) and the CLI (:mod:`.cli`)."""

from .adapters import PRESETS, AdapterConfig, LoRASet, TargetGroup, gradient_checkpointing, preset
from .objective import ObjectiveConfig
from .save import save_lora
from .step import StepNoise, TrainBatch, compute_loss
from .trainer import TrainConfig, Trainer, TrainSample

__all__ = ["PRESETS", "AdapterConfig", "LoRASet", "ObjectiveConfig", "StepNoise", "TargetGroup", "TrainBatch",
           "TrainConfig", "TrainSample", "Trainer", "compute_loss", "gradient_checkpointing", "preset", "save_lora"]
