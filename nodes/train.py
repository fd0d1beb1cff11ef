"""Klein LoRA Trainer: trains a LoRA on a Klein base model from a folder of captioned images and
writes it into ComfyUI's ``loras`` folder (:func:`klein_core.train.run_job` does the work).

Progress goes to ComfyUI's progress bar; Cancel stops the run between encodings and steps, and a
stopped run writes no LoRA file. The output name is a plain file name: never a path. Checkpoints and
sample images go to ComfyUI's output folder (``klein_lora_training/<name>-<settings key>/``), so the
same inputs queued again continue from the last checkpoint. Optional: an fp8 base, block
streaming, a text-encoder LoRA, sample images (returned as the ``samples`` IMAGE batch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from comfy_api.latest import io
from PIL import Image, ImageDraw
from safetensors import safe_open

from klein_core.accel.speed import SPEEDS
from klein_core.train import PRESETS, TrainConfig, TrainJob, loss_curve_image, run_job
from klein_core.train.data import IMAGE_EXTS, DatasetError
from klein_core.train.job import TRAIN_MEMORY
from klein_core.train.trainer import latest_checkpoint

from . import host, notices
from .common import check_choices, check_widget, model_file

logger = logging.getLogger(__name__)

NODE = "Klein LoRA Trainer"
SUFFIX = ".safetensors"
_FOLDERS = {"model_name": "diffusion_models", "vae_name": "vae", "text_encoder": "text_encoders"}
PRECISIONS = {"default": None, "fp8": "fp8"}  # base_precision -> TrainJob.quantize
NO_SAMPLES_TEXT = "no sample prompts"


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


def sample_prompt_list(text: str) -> tuple[str, ...]:
    """One prompt per line of ``text``; blank lines are ignored, surrounding spaces dropped."""
    return tuple(line.strip() for line in (text or "").splitlines() if line.strip())


def sample_schedule(prompts: Sequence[str], sample_every: int, steps: int) -> int:
    """The ``TrainConfig.sample_every`` for the node's inputs (0 = no samples): ``sample_every`` steps,
    or ``steps`` (one set after the last step) when it is 0 or more than ``steps`` (the latter warned)."""
    if sample_every < 0:
        raise ValueError(f"{NODE}: sample_every must be 0 or more (0: sample only after the last step), "
                         f"got {sample_every}.")
    if not prompts:
        return 0
    if sample_every == 0:
        return steps
    if sample_every > steps:
        logger.warning("%s: sample_every (%d) is more than steps (%d), so no multiple of it is reached; sample "
                       "images are made once, after the last step", NODE, sample_every, steps)
        return steps
    return sample_every


TRAINING_FOLDER = "klein_lora_training"  # in ComfyUI's output folder: checkpoints and sample images
# Training states kept per run (resuming needs the newest; each is about 3x the LoRA's size): the older
# ones are deleted, their sample images stay.
KEEP_CHECKPOINTS = 2


def _file_stat(path: str) -> tuple:
    try:
        st = os.stat(path)
        return (path, st.st_size, st.st_mtime_ns)
    except OSError:  # missing: the job names it (skipped) when it runs
        return (path, None)


def _jsonl_files(path: str) -> list[str]:
    """The image and reference paths a JSONL dataset's rows name (rows that are not such JSON are
    left to the job, which names their line)."""
    files = []
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            refs = row.get("references")
            for name in [row.get("image"), *(refs if isinstance(refs, list) else [])]:
                if isinstance(name, str):
                    files.append(os.path.join(os.path.dirname(path), name))
    return files


def dataset_path(dataset: str) -> str:
    """Where the trainer reads ``dataset``: an absolute path (``~`` expanded) as given; a relative one
    in ComfyUI's input folder (also written ``input/...``, as the shipped workflow does), else from
    the server's working directory. The server's working directory is not ComfyUI's folder in the
    portable build, the desktop app or with ``--input-directory`` / ``--base-directory``."""
    text = os.path.expanduser(dataset.strip())
    if not text or os.path.isabs(text):
        return text
    inputs = host.input_dir()
    parts = Path(text).parts
    candidates = [os.path.join(inputs, text)]
    if parts and parts[0] == "input" and len(parts) > 1:
        candidates.append(os.path.join(inputs, *parts[1:]))
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    return os.path.abspath(text)  # the job names it if it is not there either


def dataset_fingerprint(dataset: str) -> object:
    """What changes when the dataset does: a folder's files (names, sizes, times); a JSONL file's size
    and time and those of every image and reference its rows name (an edited image changes what is
    learnt, though the JSONL stays the same); the text itself when it names nothing readable."""
    path = os.path.expanduser(dataset)
    try:
        if os.path.isdir(path):
            with os.scandir(path) as it:
                return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in it if e.is_file()))
        own = _file_stat(path)
        if own[1] is None:
            return dataset
        return (own, *(_file_stat(f) for f in _jsonl_files(path))) if path.lower().endswith(".jsonl") else own
    except OSError:
        return dataset


def run_key(dataset: str, *settings: object) -> str:
    """12 hex digits naming a run: the dataset's files (names, sizes, times) and every setting that
    changes what is learnt (not steps, sample images or memory_mode, which a resumed run may change)."""
    blob = json.dumps([dataset, dataset_fingerprint(dataset_path(dataset)), *settings], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def placeholder_image(text: str = NO_SAMPLES_TEXT, width: int = 256, height: int = 64) -> torch.Tensor:
    """A small dark IMAGE ``[1, height, width, 3]`` with ``text`` written on it."""
    img = Image.new("RGB", (width, height), (24, 25, 30))
    ImageDraw.Draw(img).text((12, height // 2 - 6), text, fill=(230, 230, 230))
    return _as_image(img)


def load_samples(paths: Sequence[str | os.PathLike]) -> torch.Tensor:
    """The sample PNGs as one IMAGE batch ``[N, H, W, 3]`` (they share one size), in order."""
    images = []
    for p in paths:
        with Image.open(p) as img:
            images.append(_as_image(img))
    sizes = {tuple(t.shape) for t in images}
    if len(sizes) != 1:
        raise ValueError(f"{NODE}: the sample images have different sizes {sorted(sizes)}; cannot batch them.")
    return torch.cat(images)


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
                    "{\"image\", \"caption\"} (edit pairs add \"references\"). A relative path is read in "
                    "ComfyUI's input folder (input/my_set or my_set), else from the server's working folder. Typed "
                    "here, a change to the dataset's files trains again; linked from another node, only a "
                    "change of the linked text does.")),
                io.Combo.Input("model_name", options=host.filename_list("diffusion_models", (".gguf",)), tooltip=(
                    "The Klein BASE model to train on (e.g. flux-2-klein-base-4b), from models/diffusion_models; "
                    "a GGUF base trains too (its quantised layers frozen, the LoRA on top). The LoRA then works "
                    "on the base and on the distilled model of that size.")),
                io.Combo.Input("vae_name", options=host.filename_list("vae"),
                               tooltip="FLUX.2 VAE from models/vae (encodes the images once)."),
                io.Combo.Input("text_encoder", options=host.filename_list("text_encoders", (".gguf",)), tooltip=(
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
                io.Combo.Input("base_precision", options=list(PRECISIONS), default="default", optional=True,
                               tooltip=(
                    "default: the base model's weights as its file stores them (a bf16 file trains on bf16 "
                    "weights; an fp8 file stays fp8). fp8: the frozen block linears of a bf16/fp16 base are "
                    "stored in fp8 as it loads, and the LoRA (unchanged, in its own precision) trains on top: "
                    "about half the transformer's weight memory, at a small cost in exactness. GPUs without "
                    "fp8 matrix multiplies (and the CPU) widen each layer per call, which is slower.")),
                io.String.Input("sample_prompts", default="", multiline=True, optional=True, tooltip=(
                    "Prompts for sample images made with the LoRA being trained, one per line (blank lines are "
                    "ignored). Empty: no samples. Each sample is resolution x resolution pixels (the training "
                    "resolution), seeded with seed, with the base model's CFG and an empty negative prompt.")),
                io.Int.Input("sample_every", default=250, min=0, max=100000, optional=True, tooltip=(
                    "Steps between sample images: one image per prompt at every multiple of sample_every "
                    "and always after the last step (the final LoRA). 0, or more than steps: after the last step "
                    "only. Ignored without sample_prompts.")),
                io.Int.Input("sample_steps", default=20, min=1, max=200, optional=True, tooltip=(
                    "Sampling steps of each sample image (the base model: 20 is its usual count). Sampling "
                    "pauses training, and the progress bar, while it runs.")),
                io.Combo.Input("memory_mode", options=list(TRAIN_MEMORY), default="resident", optional=True,
                               tooltip=(
                    "resident: the base model stays on the GPU while training (fastest). blocks: its blocks stay "
                    "in CPU memory and each is copied to the GPU only while it runs, forward and backward, for "
                    "GPUs that cannot hold the whole base model; slower, the same LoRA.")),
                io.Int.Input("text_encoder_rank", default=0, min=0, max=256, optional=True, tooltip=(
                    "0 (default): only the transformer learns. Above 0: the text encoder gets a LoRA of this rank "
                    "too (its attention and MLP layers), trained with the same learning rate; the text encoder "
                    "then stays loaded while training (more memory) and the LoRA file holds both parts: Klein "
                    "LoRA Loader applies the transformer part, the Qwen3 Layer-Concat Encoder's lora_name the "
                    "text-encoder part.")),
                io.Int.Input("checkpoint_every", default=250, min=0, max=100000, optional=True, tooltip=(
                    "Save the training state every this many steps (0: never) into output/klein_lora_training/"
                    "<lora_name>-<settings>/ (the newest 2 are kept). Queued again with the same inputs after a "
                    "Cancel, an error or a restart, the run continues from its last checkpoint; with more steps "
                    "it trains on.")),
                io.Combo.Input("speed", options=list(SPEEDS), default="fast", optional=True, tooltip=(
                    "The transformer's path while it trains. fast (default): on the GPU the fused QK-norm + "
                    "RoPE kernel (with its own backward) and the fastest attention; on the CPU plain PyTorch. "
                    "compile: torch.compile of the blocks (a slow first step, then the fastest). plain: plain "
                    "PyTorch. The same LoRA to rounding.")),
            ],
            outputs=[
                io.String.Output(display_name="lora_name", tooltip=(
                    "The LoRA's file name in models/loras: pick it in Klein LoRA Loader.")),
                io.Image.Output(display_name="loss_curve", tooltip="The training loss by step (moving average bold)."),
                io.Image.Output(display_name="samples", tooltip=(
                    "Every sample image written by this run, in order (by step, then by prompt line), as one "
                    "batch of resolution x resolution images; the files stay in ComfyUI's output folder under "
                    "klein_lora_training/<lora_name>-<settings>/checkpoint-<step>/sample-<i>.png (the server log "
                    "names them). Without sample_prompts: one small dark image saying 'no sample prompts'.")),
            ],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        # One input only: ComfyUI reports a failure under every input this signature names (a wrong
        # model_name was shown under vae_name and text_encoder too). Those two are checked by name when
        # the node runs (and by current ComfyUI when the prompt is queued, as every list input).
        return check_choices(cls, _FOLDERS, model_name=model_name)

    @classmethod
    def fingerprint_inputs(cls, dataset: str | None = "", **_: Any) -> Any:
        # Train again when the dataset's files change (same inputs otherwise reuse the last result).
        # A linked dataset arrives as None here (ComfyUI has not run the node that gives it yet): its
        # value then changes the cache key through that node, as with any linked input.
        if not isinstance(dataset, str):
            return None
        return dataset_fingerprint(dataset_path(dataset))

    @classmethod
    @notices.reported
    def execute(cls, dataset: str, model_name: str, vae_name: str, text_encoder: str, preset: str = "style",
                rank: int = 32, steps: int = 1000, learning_rate: float = 1e-4, seed: int = 0,
                lora_name: str = "klein_lora", resolution: int = 1024, base_precision: str = "default",
                sample_prompts: str = "", sample_every: int = 250, sample_steps: int = 20,
                memory_mode: str = "resident", text_encoder_rank: int = 0,
                checkpoint_every: int = 250, speed: str = "fast") -> io.NodeOutput:
        file_name = lora_file_name(lora_name)
        check_widget(NODE, "preset", preset, PRESETS)
        check_widget(NODE, "base_precision", base_precision, PRECISIONS)
        check_widget(NODE, "memory_mode", memory_mode, TRAIN_MEMORY)
        check_widget(NODE, "speed", speed, SPEEDS)
        if int(sample_steps) < 1:
            raise ValueError(f"{NODE}: sample_steps must be 1 or more, got {sample_steps}.")
        prompts = sample_prompt_list(sample_prompts)
        every = sample_schedule(prompts, int(sample_every), int(steps))
        if not dataset.strip():
            raise ValueError(f"{NODE}: dataset is empty; give a folder on the server with images and .txt captions "
                             f"({', '.join(IMAGE_EXTS)}).")
        paths = {k: model_file(NODE, k, folder, name, expect=expect) for (k, folder), name, expect in zip(
            _FOLDERS.items(), (model_name, vae_name, text_encoder), ("transformer", "vae", "text_encoder"))}
        out = output_path(file_name)
        device = host.torch_device()
        dtype = torch.bfloat16 if device.type != "cpu" and host.bf16_supported(device) else torch.float32
        if device.type != "cpu":  # resident: the weights, their gradients' working set and activations;
            # blocks: the non-block weights, two blocks in flight and activations (both rough, for the host)
            share = 3 if memory_mode == "resident" else 1
            need = share * os.path.getsize(paths["model_name"])
            if text_encoder_rank and memory_mode == "resident":  # a trained text encoder stays on the GPU too
                need += os.path.getsize(paths["text_encoder"])
            host.make_room(need, device)
        # Checkpoints (and sample images) of this run's settings, in the output folder: queued again
        # after a Cancel, an error or a restart, the same settings continue from the last checkpoint.
        key = run_key(dataset.strip(), model_name, vae_name, text_encoder, preset, int(rank), float(learning_rate),
                      int(seed), int(resolution), base_precision, int(text_encoder_rank))
        checkpoints = host.output_dir_path(os.path.join(TRAINING_FOLDER, f"{Path(file_name).stem}-{key}"))
        found = latest_checkpoint(checkpoints, int(steps))
        resume = str(found) if found is not None else None
        if resume is not None:
            logger.info("%s: continuing from %s (the same settings were stopped there)", NODE, resume)
        side = int(resolution)
        job = TrainJob(
            dataset=dataset_path(dataset), transformer=paths["model_name"], vae=paths["vae_name"],
            text_encoder=paths["text_encoder"], output=out, preset=preset, rank=int(rank),
            resolution=side, device=device, dtype=dtype, quantize=PRECISIONS[base_precision], memory=memory_mode,
            text_encoder_rank=int(text_encoder_rank) or None, speed=speed,
            config=TrainConfig(steps=int(steps), learning_rate=float(learning_rate), seed=int(seed),
                               sample_prompts=prompts, sample_every=every, sample_steps=int(sample_steps),
                               sample_seed=int(seed), sample_size=(side, side),
                               checkpoint_every=int(checkpoint_every), keep_checkpoints=KEEP_CHECKPOINTS),
            # BFL / ComfyUI key names: ComfyUI's own LoRA loaders read them, and so do this pack and diffusers
            fmt="comfyui", cache_dir=host.temp_path("klein_train_cache"), checkpoint_dir=checkpoints, resume=resume)
        bar = host.progress_bar(int(steps))
        encoding: list = []  # the dataset's bar (items, not steps), made once its size is known

        def encoded(done: int, total: int) -> None:
            if not encoding:
                encoding.append(host.progress_bar(total))
            encoding[0].update_absolute(done, total)

        try:
            result = run_job(job, on_step=lambda r: bar.update_absolute(r.step, r.total),
                             check_cancel=host.check_interrupt, on_encode=encoded)
        except DatasetError as exc:
            raise ValueError(f"{NODE}: {exc}") from exc
        finally:
            if device.type != "cpu":
                host.empty_cache()
        logger.info("%s: wrote %s (%d steps, last loss %.4f)", NODE, file_name, result.steps, result.losses[-1])
        if result.sample_images:
            logger.info("%s: %d sample image(s) in %s: %s", NODE, len(result.sample_images), checkpoints,
                        ", ".join(os.path.relpath(p, checkpoints) for p in result.sample_images))
            samples = load_samples(result.sample_images)
        else:
            samples = placeholder_image(NO_SAMPLES_TEXT if not prompts else "no sample images were made")
        return io.NodeOutput(file_name, _as_image(loss_curve_image(result.losses)), samples)
