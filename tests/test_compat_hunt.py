"""Hunt of files this project wrote in earlier versions, read by the current one ("an upgrade never
loses a user's work").

Each old-format file here is written by hand as the code of the commit named in its test wrote it
(read with ``git show <commit>:<path>``), then given to today's reader. A file the current code
cannot read exactly must be refused with a message naming the file and what to do, never misread.

Formats looked at: training checkpoints (``trainer_state.pt`` before 3323948, safetensors without
``run_identity`` from 3323948 to 58d7ae1), trained LoRA files (diffusers names without the text
encoder's PEFT config before 43f1e5c; Kohya files in underscored diffusers paths before 43f1e5c),
the disk prompt cache and the training tensor cache (their old entries are already covered by
tests/test_prompt_cache_hostile.py and tests/test_train_hunt.py; no defect found there), the Ray
batch manifest (its entry format never changed), PNG ``parameters`` (nothing reads them back) and
saved ComfyUI workflows (the example workflows of ef8c850, the first ones shipped).

Found and left alone (niche, noted in the session's closing note): the Trainer node's run folder of
a JSONL dataset, started before 58d7ae1 (whose key gained the JSONL's images), is not resumed after
the upgrade (it restarts at step 0; its checkpoints stay on disk); a batch job with ids ``Fox`` and
``fox`` started before de6fa1b on a case-folding file system keeps the one PNG both wrote.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import save_file
from test_train_node import env  # noqa: F401 (fixture: the trainer node with tiny models in ComfyUI)
from train_files import tiny_training_files

from klein_core.lora import apply_loras, load_lora
from klein_core.testing import tiny_text_encoder, tiny_transformer
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.save import diffusers_names
from klein_core.train.state_file import load_state, save_state
from klein_core.train.trainer import CHECKPOINT_FILE, TrainConfig, Trainer, TrainSample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----- helpers ------------------------------------------------------------------------------------


def _random_up(*sets: LoRASet, seed: int = 0) -> None:
    """B off zero (a fresh LoRA changes nothing), so a wrong scale shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s in sets:
            for layer in s.layers.values():
                layer.up.copy_(torch.randn(layer.up.shape, generator=g) * 0.5)


def _merged_deltas(model: torch.nn.Module, lora_file) -> dict[str, torch.Tensor]:
    """``merged weight - base weight`` of every Linear ``apply_loras`` changed (model unchanged after)."""
    base = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    handle = apply_loras(model, [(load_lora(lora_file), 1.0)])
    try:
        return {n: model.get_submodule(n).weight.detach() - w for n, w in base.items()
                if not torch.equal(model.get_submodule(n).weight, w)}
    finally:
        handle.remove()


def _old_state(trainer: Trainer) -> dict:
    """``Trainer.state()`` as versions before 58d7ae1 wrote it: no ``run_identity`` (5873ad5 to
    58d7ae1^; ``text_lora`` only with a text-encoder LoRA, none here)."""
    return {"step": trainer.step, "lora": {k: v.detach().clone() for k, v in trainer.lora.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(), "losses": list(trainer.losses),
            "seed": trainer.config.seed, "torch_rng": torch.get_rng_state()}


def _samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)  # the tiny 4B transformer: 128 latent channels, 96 text width
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g), torch.randn(1, 4, 96, generator=g)) for _ in range(2)]


def _trainer(lr: float, steps: int = 3, output_dir=None, *, rank: int = 2, seed: int = 0) -> Trainer:
    model = tiny_transformer()
    lora = LoRASet(model, preset("style", rank=rank), seed=seed)
    return Trainer(model, lora, _samples(), TrainConfig(steps=steps, learning_rate=lr, seed=seed,
                                                        gradient_checkpointing=False), output_dir=output_dir)


# ----- trained LoRA files -------------------------------------------------------------------------


def test_old_diffusers_lora_keeps_its_text_encoder_alpha(tmp_path):
    """Was a bug: a LoRA trained with a text-encoder LoRA whose alpha is not its rank (``--text-encoder-rank 2
    --text-encoder-alpha 6``) and saved in diffusers names by versions 7ba5530 to 43f1e5c^ (the CLI's
    default naming) loads today with its text-encoder part at a third of its strength: those files
    hold only the transformer's PEFT config in ``lora_adapter_metadata``, so ``load_lora`` takes the
    text encoder's scale as 1, silently, although the same file records the alpha in
    ``klein.text_encoder_targets``. The user sees prompts encoded as by another LoRA.

    The file is written as 7ba5530's ``save.lora_state_dict`` / ``save_lora`` wrote it (diffusers
    branch): ``transformer.<diffusers path>.lora_A/B.weight``, ``text_encoder.model.<core>.lora_A/B.
    weight``, ``lora_adapter_metadata`` with ``transformer.``-prefixed entries only, and the
    ``klein.*`` metadata. Fixed: the merged text-encoder weights carry the trained delta (alpha / rank
    = 3), read from ``klein.text_encoder_targets``."""
    tr, te = tiny_transformer(), tiny_text_encoder()
    lora = LoRASet(tr, preset("style", rank=2), seed=1)
    text_lora = LoRASet(te, text_encoder_preset(rank=2, alpha=6.0), seed=2)  # scale 3
    _random_up(lora, text_lora)
    tensors: dict[str, torch.Tensor] = {}
    for core, layer in text_lora.items():  # 7ba5530 _text_encoder_tensors, diffusers names
        tensors[f"text_encoder.model.{core}.lora_A.weight"] = layer.down[0].detach().contiguous()
        tensors[f"text_encoder.model.{core}.lora_B.weight"] = layer.up[0].detach().contiguous()
    ranks, alphas = {}, {}
    for core, layer in lora.items():
        for p, path in enumerate(diffusers_names(core, layer.parts)):
            tensors[f"transformer.{path}.lora_A.weight"] = layer.down[p].detach().contiguous()
            tensors[f"transformer.{path}.lora_B.weight"] = layer.up[p].detach().contiguous()
            ranks[path], alphas[path] = layer.rank, layer.scale * layer.rank
    config = {"r": 2, "lora_alpha": 2.0, "target_modules": sorted(ranks), "peft_type": "LORA", "rank_pattern": {},
              "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "lora_dropout": 0.0, "bias": "none",
              "init_lora_weights": True}
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()}),
            "klein.format": "klein-lora/1 (diffusers names)",
            "klein.targets": json.dumps(lora.config.description),
            "klein.ranks": json.dumps({name: layer.rank for name, layer in lora.items()}),
            "klein.text_encoder_targets": json.dumps(text_lora.config.description),
            "klein.text_encoder_ranks": json.dumps({name: layer.rank for name, layer in text_lora.items()}),
            "klein.steps": "10"}
    path = tmp_path / "old_diffusers.safetensors"
    save_file(tensors, str(path), metadata=meta)

    deltas = _merged_deltas(te, path)
    assert set(deltas) == set(text_lora.names())
    worst = max((deltas[n] - text_lora.layer(n).delta()).abs().max().item() for n in deltas)
    assert worst <= 1e-5, f"text-encoder part read at another scale (max error {worst:.3g})"


def test_pinned_old_kohya_names_still_apply_as_trained(tmp_path):
    """Pinned: a Kohya-named LoRA written by versions 5873ad5 to 43f1e5c^, whose transformer keys are
    underscored diffusers paths (``lora_unet_transformer_blocks_0_attn_to_q``, one pair per q/k/v,
    each with ``.alpha``) and whose text-encoder keys are ``lora_te_model_layers_N_...``, is read by
    today's ``load_lora`` with every key used, and merges into both models the trained delta (mixed
    alphas: transformer scale 2, text encoder 0.5). Written as 7ba5530's ``lora_state_dict`` (Kohya
    branch) wrote it."""
    tr, te = tiny_transformer(), tiny_text_encoder()
    lora = LoRASet(tr, preset("full", rank=2, alpha=4.0), seed=1)
    text_lora = LoRASet(te, text_encoder_preset(rank=4, alpha=2.0), seed=2)
    _random_up(lora, text_lora)
    tensors: dict[str, torch.Tensor] = {}
    for core, layer in text_lora.items():
        key = "lora_te_" + f"model.{core}".replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = layer.down[0].detach().contiguous()
        tensors[f"{key}.lora_up.weight"] = layer.up[0].detach().contiguous()
        tensors[f"{key}.alpha"] = torch.tensor(layer.scale * layer.rank, dtype=torch.float32)
    for core, layer in lora.items():
        for p, path in enumerate(diffusers_names(core, layer.parts)):
            key = "lora_unet_" + path.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = layer.down[p].detach().contiguous()
            tensors[f"{key}.lora_up.weight"] = layer.up[p].detach().contiguous()
            tensors[f"{key}.alpha"] = torch.tensor(layer.scale * layer.rank, dtype=torch.float32)
    path = tmp_path / "old_kohya.safetensors"
    save_file(tensors, str(path), metadata={"klein.format": "klein-lora/1 (kohya names)", "klein.steps": "10"})

    assert load_lora(path).skipped == {}
    for model, trained in ((tr, lora), (te, text_lora)):
        deltas = _merged_deltas(model, path)
        assert set(deltas) == set(trained.names())
        for name, d in deltas.items():
            assert (d - trained.layer(name).delta()).abs().max().item() <= 1e-5, name


# ----- training checkpoints -----------------------------------------------------------------------


def test_resume_auto_does_not_pass_over_an_old_pickled_checkpoint(tmp_path):
    """Was a bug: ``train --resume auto`` (``TrainJob(resume="auto")``) over an output whose checkpoints were
    written by versions 5873ad5 to 3323948^ (``checkpoint-N/trainer_state.pt``, ``torch.save`` of the
    trainer's state) starts again from step 0 with an info line only ("no checkpoint ... starting at
    step 0"), then writes its own ``checkpoint-1`` beside the old state: the steps already trained
    are lost without a word. ``trainer.checkpoints`` lists only folders holding
    ``trainer_state.safetensors``.

    The old file is ``torch.save`` of the state dict 3323948^'s ``Trainer.state`` returned (step,
    lora, optimizer, losses, seed, torch_rng). Fixed: the job continues from step 1, or stops with
    an error naming ``trainer_state.pt`` (and what to do): the latter, as nothing trains then."""
    paths, data = tiny_training_files(tmp_path)
    checkpoints = tmp_path / "out" / "l-checkpoints"
    old = _trainer(1e-2, steps=2, output_dir=checkpoints, seed=3)  # the job's LoRA: style preset, rank 2, seed 3
    old.train(until=1)
    old.close()
    (checkpoints / "checkpoint-1").mkdir(parents=True)
    torch.save(_old_state(old), checkpoints / "checkpoint-1" / "trainer_state.pt")

    from klein_core.train.job import TrainJob, run_job

    steps: list[int] = []
    job = TrainJob(dataset=data, transformer=paths["klein_base_4b"], vae=paths["vae"], text_encoder=paths["qwen_4b"],
                   output=tmp_path / "out" / "l.safetensors", resolution=32, rank=2, device="cpu",
                   cache_dir=tmp_path / "cache", resume="auto",
                   config=TrainConfig(steps=2, learning_rate=1e-2, seed=3, checkpoint_every=1,
                                      gradient_checkpointing=False))
    with pytest.raises(ValueError) as info:
        run_job(job, on_step=lambda report: steps.append(report.step))
    assert str(checkpoints / "checkpoint-1" / "trainer_state.pt") in str(info.value)
    assert "earlier version" in str(info.value) and "to start afresh" in str(info.value)
    assert steps == [] and not (checkpoints / "checkpoint-1" / "trainer_state.safetensors").exists()
    assert not (tmp_path / "cache").exists()  # refused before anything was encoded


def test_resume_of_a_checkpoint_without_run_identity_keeps_this_runs_learning_rate(tmp_path):
    """Was a bug: a checkpoint written by versions 3323948 to 58d7ae1^ (safetensors, but no ``run_identity``)
    resumed with another learning rate is accepted without a check (by design: "checkpoints written
    before it was recorded are not checked"), and then trains on at the checkpoint's rate: the
    optimizer's ``param_groups`` (lr, betas, eps, weight_decay), which the old file does record, replace
    this run's. The run, its new checkpoints' ``run_identity`` and the LoRA's ``klein.learning_rate``
    all say 1e-3 while every step runs at 1e-2.

    The file is ``state_file.save_state`` (unchanged since 3323948 but for the atomic write) of the
    state 3323948's ``Trainer.state`` returned. Fixed: the settings the old file records are checked
    against this run's and a difference refused naming them, or the run trains at its own rate."""
    old = _trainer(1e-2, output_dir=tmp_path)
    old.train(until=1)
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    save_state(_old_state(old), folder / CHECKPOINT_FILE)
    old.close()
    assert "run_identity" not in load_state(folder / CHECKPOINT_FILE)

    new = _trainer(1e-3)
    try:
        with pytest.raises(ValueError) as info:
            new.resume(folder)
    finally:
        new.close()
    assert str(folder) in str(info.value) and "learning_rate 0.01 -> 0.001" in str(info.value), info.value
    same = _trainer(1e-2)  # the same settings: resumed
    try:
        same.resume(folder)
        assert same.step == 1
    finally:
        same.close()


# ----- saved ComfyUI workflows ----------------------------------------------------------------------

# Klein Model Loader in ef8c850's example_workflows/api/klein_4b_base_cfg.api.json, as saved then.
OLD_API_LOADER = {"class_type": "KleinModelLoader",
                  "inputs": {"model_name": "flux-2-klein-base-4b.safetensors", "vae_name": "flux2-vae.safetensors",
                             "weight_dtype": "bf16", "model_kind": "auto"}}

# ef8c850's example_workflows/klein_4b_base_cfg.json: each node's widgets_values and the inputs they were for.
OLD_UI_WIDGETS = {
    "KleinModelLoader": (["flux-2-klein-base-4b.safetensors", "flux2-vae.safetensors", "bf16", "auto"],
                         ["model_name", "vae_name", "weight_dtype", "model_kind"]),
    "KleinTextEncode": (["qwen_3_4b.safetensors", "A cozy reading corner", "blurry, low quality"],
                        ["text_encoder", "prompt", "negative_prompt"]),
    "KleinSampler": ([1024, 1024, 50, 4.0, 42, "randomize", 1],
                     ["width", "height", "steps", "guidance", "seed", "control_after_generate", "batch_size"]),
}


@pytest.fixture(scope="module")
def pack_nodes(comfy_pack):
    return {m: importlib.import_module(f"{comfy_pack.pack.__name__}.{m}") for m in ("loaders", "encode", "sampler")}


def test_an_api_workflow_saved_before_memory_mode_still_validates(pack_nodes):
    """Was a bug: the API-format workflows shipped in ef8c850 (and any saved before 38fb2a7) give Klein Model
    Loader four inputs; ``memory_mode`` was added after them as a *required* input, so ComfyUI refuses
    the whole prompt when it is queued: ``execution.validate_inputs`` reports ``required_input_missing``
    ("Required input is missing: memory_mode") for every required name of ``INPUT_TYPES()`` the
    prompt lacks (ComfyUI 0.3.75, execution.py). tests/test_train_node.py's rule for the trainer,
    inputs appended as optional, was not followed here.

    Checked as ComfyUI checks it (its ``validate_inputs`` cannot be imported beside the pack, whose
    ``nodes`` package shadows ComfyUI's ``nodes`` module in the tests). Fixed: ``memory_mode``
    optional (default ``auto``)."""
    info = pack_nodes["loaders"].KleinModelLoader.INPUT_TYPES()
    missing = [name for name in info["required"] if name not in OLD_API_LOADER["inputs"]]
    assert missing == [], f"Required input is missing: {', '.join(missing)}"


def test_pinned_old_ui_widgets_values_map_to_the_same_inputs(pack_nodes):
    """Pinned: the ``widgets_values`` of the first shipped UI workflows (ef8c850) land on the inputs they
    were written for: the frontend fills widgets in ``INPUT_TYPES()``'s order (required, then optional;
    a ``control_after_generate`` value after its widget), and every input added since comes after them."""
    classes = {"KleinModelLoader": pack_nodes["loaders"].KleinModelLoader,
               "KleinTextEncode": pack_nodes["encode"].KleinTextEncode,
               "KleinSampler": pack_nodes["sampler"].KleinSampler}
    widget_types = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
    for node, (values, meant) in OLD_UI_WIDGETS.items():
        info = classes[node].INPUT_TYPES()
        order = []
        for group in ("required", "optional"):
            for name, spec in info.get(group, {}).items():
                typ, opts = spec[0], (spec[1] if len(spec) > 1 else {})
                if (isinstance(typ, list) or typ in widget_types) and not opts.get("forceInput"):
                    order.append(name)
                    if opts.get("control_after_generate"):
                        order.append("control_after_generate")
        assert order[:len(values)] == meant, (node, order)


def test_review_a_transformer_only_diffusers_lora_of_this_trainer_loads_without_a_warning(tmp_path, caplog):
    """Was a bug (in the mend above, found in review): every LoRA this trainer saves with diffusers
    names and no text-encoder part (the CLI's default) warned, when loaded, that its
    'klein.text_encoder_targets' could not be read: it has none to read. No warning now."""
    import logging

    tr = tiny_transformer()
    lora = LoRASet(tr, preset("style", rank=2), seed=1)
    _random_up(lora)
    path = tmp_path / "style.safetensors"
    from klein_core.train.save import save_lora

    save_lora(path, lora, fmt="diffusers")
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        loaded = load_lora(path)
    assert loaded.patches and not loaded.skipped
    assert "text_encoder_targets" not in caplog.text, caplog.text
