"""LoRA training for FLUX.2 Klein (see docs/training.md): the flow-matching objective
(:mod:`.objective`), LoRA layers per block group (:mod:`.adapters`), one training step
(:mod:`.step`), the loop with checkpoints and exact resume (:mod:`.trainer`), sample images at
checkpoints (:mod:`.samples`), data and caches
(:mod:`.data`), saving (:mod:`.save`), a whole job from files (:mod:`.job`), the loss plot
(:mod:`.plot`) and the CLI (:mod:`.cli`)."""

from .adapters import PRESETS, AdapterConfig, LoRASet, TargetGroup, gradient_checkpointing, preset
from .job import TrainingStopped, TrainJob, TrainResult, run_job
from .objective import ObjectiveConfig
from .plot import loss_curve_image
from .save import save_lora
from .step import StepNoise, TrainBatch, compute_loss
from .trainer import TrainConfig, Trainer, TrainSample

__all__ = ["PRESETS", "AdapterConfig", "LoRASet", "ObjectiveConfig", "StepNoise", "TargetGroup", "TrainBatch",
           "TrainConfig", "TrainJob", "TrainResult", "TrainSample", "Trainer", "TrainingStopped", "compute_loss",
           "gradient_checkpointing", "loss_curve_image", "preset", "run_job", "save_lora"]
