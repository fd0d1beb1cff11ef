"""Klein LoRA Trainer: trains a LoRA on a Klein base model from a folder of captioned images and
writes it into ComfyUI's ``loras`` folder (:func:`klein_core.train.run_job` does the work).

Progress goes to ComfyUI's progress bar; Cancel stops the run between encodings and steps, and a
stopped run writes no LoRA file. The output name is a plain file name: never a path.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
from comfy_api.latest import io
from safetensors import safe_open

from klein_core.train import PRESETS, TrainConfig, TrainJob, loss_curve_image, run_job
from klein_core.train.data import IMAGE_EXTS, DatasetError

from . import host, notices
from .common import check_choices, model_file

logger = logging.getLogger(__name__)

NODE = "Klein LoRA Trainer"
SUFFIX = ".safetensors"
_FOLDERS = {"model_name": "diffusion_models", "vae_name": "vae", "text_encoder": "text_encoders"}


# ----- host access not (yet) in host.py ---------------------------------------------------------------


# ----- helpers ------------------------------------------------------------------------------------------


def lora_file_name(name: str) -> str:
    """``name`` as a LoRA file name (``.safetensors`` added); refuses paths and hidden names."""
    name = name.strip()
    if not name or any(sep in name for sep in ("/", "\\", os.sep)) or name.startswith(".") or ":" in name:
        raise ValueError(f"{NODE}: lora_name '{name}' must be a plain file name (no folders, no '/' or '\\', "
                         f"not starting with '.'); the LoRA is always written into models/loras.")
    return name if name.lower().endswith(SUFFIX) else name + SUFFIX


def output_path(file_name: str) -> str:
    """The LoRA's path in the first ``loras`` folder; refuses to replace a file this trainer did not write."""
    folders = host.folder_paths_of("loras")
    if not folders:
        raise ValueError(f"{NODE}: ComfyUI has no loras folder configured.")
    root = os.path.realpath(folders[0])
    path = os.path.realpath(os.path.join(root, file_name))
    if os.path.dirname(path) != root:
        raise ValueError(f"{NODE}: lora_name '{file_name}' does not name a file in models/loras.")
    if os.path.exists(path):
        try:
            with safe_open(path, "pt") as f:
                ours = "klein.steps" in (f.metadata() or {})
        except Exception:  # noqa: BLE001 - unreadable: not ours either
            ours = False
        if not ours:
            raise ValueError(f"{NODE}: models/loras/{file_name} exists and was not written by this trainer; "
                             "pick another lora_name (it is never overwritten).")
    return path


def _as_image(pil: Any) -> torch.Tensor:
    """PIL RGB -> IMAGE ``[1, H, W, 3]`` float32 in 0..1."""
    return torch.from_numpy(np.asarray(pil.convert("RGB"), dtype=np.float32) / 255.0)[None]


class KleinLoraTrainer(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinLoraTrainer",
            display_name=NODE,
            category="Klein/training",
            description="Trains a FLUX.2 Klein LoRA on a base model from a folder of images with a .txt caption "
                        "beside each, and writes it into models/loras. Latents and captions are encoded once, "
                        "then the VAE and text encoder are freed while the transformer trains. Cancel stops it "
                        "and writes nothing. Distilled models are refused: LoRAs are trained on the base model.",
            inputs=[
                io.String.Input("dataset", default="", tooltip=(
                    "Folder ON THE SERVER (the machine running ComfyUI) holding the training images (png, jpg, "
                    "webp, bmp) with a .txt caption of the same name beside each; or a .jsonl file of rows "
                    "{\"image\", \"caption\"} (edit pairs add \"references\").")),
                io.Combo.Input("model_name", options=host.filename_list("diffusion_models"), tooltip=(
                    "The Klein BASE model to train on (e.g. flux-2-klein-base-4b), from models/diffusion_models. "
                    "The LoRA then works on the base and on the distilled model of that size.")),
                io.Combo.Input("vae_name", options=host.filename_list("vae"),
                               tooltip="FLUX.2 VAE from models/vae (encodes the images once)."),
                io.Combo.Input("text_encoder", options=host.filename_list("text_encoders"), tooltip=(
                    "Qwen3 text encoder for this model size, from models/text_encoders (encodes the captions "
                    "once).")),
                io.Combo.Input("preset", options=list(PRESETS), default="style", tooltip=(
                    "Which blocks learn: style = the double blocks; structure = single blocks 0-12 "
                    "(identity, layout); full = every block.")),
                io.Int.Input("rank", default=32, min=1, max=256, tooltip=(
                    "LoRA rank of every adapted layer (alpha = rank); higher learns more and makes a bigger file.")),
                io.Int.Input("steps", default=1000, min=1, max=100000, tooltip="Optimizer steps (batch size 1)."),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=1e-1, step=1e-5, round=False,
                               tooltip="AdamW learning rate; 1e-4 is a common start for rank 16-64."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, tooltip=(
                    "Seeds the LoRA's initial weights, the noise and the data order: the same seed and inputs "
                    "give the same LoRA.")),
                io.String.Input("lora_name", default="klein_lora", tooltip=(
                    "File name of the LoRA written into models/loras (.safetensors is added). A plain name: "
                    "folders are refused, and a file not made by this trainer is never replaced.")),
                io.Int.Input("resolution", default=1024, min=64, max=2048, step=16, optional=True, tooltip=(
                    "Training area: each image is scaled to about resolution x resolution pixels, keeping its "
                    "aspect ratio (sides multiples of 16).")),
            ],
            outputs=[
                io.String.Output(display_name="lora_name", tooltip=(
                    "The LoRA's file name in models/loras: pick it in Klein LoRA Loader.")),
                io.Image.Output(display_name="loss_curve", tooltip="The training loss by step (moving average bold)."),
            ],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, model_name: str, vae_name: str, text_encoder: str) -> bool | str:
        return check_choices(cls, _FOLDERS, model_name=model_name, vae_name=vae_name, text_encoder=text_encoder)

    @classmethod
    def fingerprint_inputs(cls, dataset: str = "", **_: Any) -> Any:
        # Train again when the dataset's files change (same inputs otherwise reuse the last result).
        try:
            with os.scandir(os.path.expanduser(dataset)) as it:
                return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in it if e.is_file()))
        except OSError:
            return dataset

    @classmethod
    @notices.reported
    def execute(cls, dataset: str, model_name: str, vae_name: str, text_encoder: str, preset: str = "style",
                rank: int = 32, steps: int = 1000, learning_rate: float = 1e-4, seed: int = 0,
                lora_name: str = "klein_lora", resolution: int = 1024) -> io.NodeOutput:
        file_name = lora_file_name(lora_name)
        if preset not in PRESETS:
            raise ValueError(f"{NODE}: preset '{preset}' is not one of {', '.join(PRESETS)}.")
        if not dataset.strip():
            raise ValueError(f"{NODE}: dataset is empty; give a folder on the server with images and .txt captions "
                             f"({', '.join(IMAGE_EXTS)}).")
        paths = {k: model_file(NODE, k, folder, name, expect=expect) for (k, folder), name, expect in zip(
            _FOLDERS.items(), (model_name, vae_name, text_encoder), ("transformer", "vae", "text_encoder"))}
        out = output_path(file_name)
        device = host.torch_device()
        dtype = torch.bfloat16 if device.type != "cpu" and host.bf16_supported(device) else torch.float32
        if device.type != "cpu":
            host.make_room(3 * os.path.getsize(paths["model_name"]), device)
        job = TrainJob(
            dataset=dataset.strip(), transformer=paths["model_name"], vae=paths["vae_name"],
            text_encoder=paths["text_encoder"], output=out, preset=preset, rank=int(rank),
            resolution=int(resolution), device=device, dtype=dtype,
            config=TrainConfig(steps=int(steps), learning_rate=float(learning_rate), seed=int(seed)),
            cache_dir=host.temp_path("klein_train_cache"), checkpoint_dir=os.path.join(host.temp_path("klein_train_cache"), "checkpoints"))
        bar = host.progress_bar(int(steps))
        try:
            result = run_job(job, on_step=lambda r: bar.update_absolute(r.step, r.total),
                             check_cancel=host.check_interrupt)
        except DatasetError as exc:
            raise ValueError(f"{NODE}: {exc}") from exc
        finally:
            if device.type != "cpu":
                host.empty_cache()
        logger.info("%s: wrote %s (%d steps, last loss %.4f)", NODE, file_name, result.steps, result.losses[-1])
        return io.NodeOutput(file_name, _as_image(loss_curve_image(result.losses)))
