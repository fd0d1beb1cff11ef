"""Klein LoRA Trainer node (nodes/train.py) in the ComfyUI 0.3.75 host, on the CPU, with tiny models:
it trains, writes the LoRA into models/loras (which load_lora and Klein LoRA Loader read), draws the
loss curve, refuses a distilled base and path-like names, and Cancel leaves no LoRA file; an fp8 base
reaches the job, and sample images come back as a batch (a placeholder without sample prompts)."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from train_files import one_thread  # noqa: F401 (an autouse fixture)

from klein_core.files.loaders import load_transformer
from klein_core.lora import load_lora
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.testing import write_tiny_model_files

M4B, M4B_BASE = "flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"
Q4B, VAE = "qwen_3_4b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
STEPS = 4


@pytest.fixture(scope="module")
def env(comfy_pack, tmp_path_factory):
    folder_paths = comfy_pack.folder_paths
    root = tmp_path_factory.mktemp("train_node")
    paths = write_tiny_model_files(root / "models")
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    saved_temp, saved_output = folder_paths.get_temp_directory(), folder_paths.get_output_directory()
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(root / "models" / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    folder_paths.set_temp_directory(str(root / "temp"))
    folder_paths.set_output_directory(str(root / "output"))
    data = root / "data"
    data.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (60 * i, 120, 200 - 50 * i)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(f"a square of colour {i}")
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (data / "broken.txt").write_text("unreadable")
    train = importlib.import_module(f"{comfy_pack.pack.__name__}.train")
    try:
        yield SimpleNamespace(folder_paths=folder_paths, mm=comfy_pack.mm, utils=comfy_pack.utils, train=train,
                              node=train.KleinLoraTrainer, paths=paths, loras=root / "models" / "loras",
                              data=data, pack=comfy_pack.pack)
    finally:
        for f in FOLDERS:
            folder_paths.folder_names_and_paths[f] = saved[f]
        folder_paths.filename_list_cache.clear()
        folder_paths.set_temp_directory(saved_temp)
        folder_paths.set_output_directory(saved_output)


def _run(env, model=M4B_BASE, lora_name="tiny_style", **kw):
    args = {"dataset": str(env.data), "model_name": model, "vae_name": VAE, "text_encoder": Q4B,
            "preset": "style", "rank": 2, "steps": STEPS, "learning_rate": 1e-2, "seed": 3,
            "lora_name": lora_name, "resolution": 64, **kw}
    with torch.inference_mode():  # as ComfyUI runs every node
        return env.node.execute(**args)


@pytest.fixture(scope="module")
def trained(env):
    calls = []
    before, env.utils.PROGRESS_BAR_HOOK = env.utils.PROGRESS_BAR_HOOK, \
        lambda value, total, preview, node_id=None: calls.append((value, total))
    try:
        out = _run(env)
    finally:
        env.utils.PROGRESS_BAR_HOOK = before
    return out, calls


def test_schema(env):
    schema = env.node.define_schema()
    assert (schema.node_id, schema.display_name, schema.category) == \
        ("KleinLoraTrainer", "Klein LoRA Trainer", "Klein/training")
    assert [i.id for i in schema.inputs] == ["dataset", "model_name", "vae_name", "text_encoder", "preset", "rank",
                                            "steps", "learning_rate", "seed", "lora_name", "resolution",
                                            "base_precision", "sample_prompts", "sample_every", "sample_steps",
                                            "memory_mode", "text_encoder_rank", "checkpoint_every", "speed"]
    assert all(i.optional for i in schema.inputs[10:])  # appended: saved workflows keep their widget order
    assert "ON THE SERVER" in schema.inputs[0].tooltip
    assert schema.inputs[1].options == sorted(os.listdir(env.paths["klein_4b"].parent))
    assert schema.inputs[11].options == ["default", "fp8"] and schema.inputs[11].default == "default"
    assert "half the transformer's weight memory" in schema.inputs[11].tooltip
    assert schema.inputs[12].multiline and schema.inputs[12].default == ""
    assert (schema.inputs[13].default, schema.inputs[14].default) == (250, 20)
    assert schema.inputs[15].options == ["resident", "blocks"] and schema.inputs[15].default == "resident"
    assert schema.inputs[16].default == 0
    assert schema.inputs[18].options == ["fast", "compile", "plain"] and schema.inputs[18].default == "fast"
    assert [o.io_type for o in schema.outputs] == ["STRING", "IMAGE", "IMAGE"]
    assert [o.display_name for o in schema.outputs] == ["lora_name", "loss_curve", "samples"]
    assert "no sample prompts" in schema.outputs[2].tooltip
    # model_name alone: ComfyUI reports a failure under every input the signature names (a wrong
    # model_name was shown under vae_name and text_encoder too); those two are named when the node runs.
    assert env.node.validate_inputs("nope.safetensors").startswith("model_name 'nope.safetensors' is not available")
    assert env.node.validate_inputs(M4B_BASE) is True


def test_trains_and_writes_a_lora_the_loader_reads(env, trained):
    out, calls = trained
    name = out.args[0]
    assert name == "tiny_style.safetensors"
    assert sorted(os.listdir(env.loras)) == ["tiny_style.safetensors"]  # nothing else in models/loras
    # the dataset's 3 readable images, then the steps (one bar after the other)
    assert calls == [(i, 3) for i in range(1, 4)] + [(i, STEPS) for i in range(1, STEPS + 1)]
    # the unreadable image is skipped and the user is told, by file name only
    (warning,) = out.ui["warnings"]
    assert warning.startswith("skipped broken.png: unreadable image"), warning
    lora = load_lora(env.loras / name)
    # ComfyUI's names (what ComfyUI's own LoRA loaders read): 1 double block, 2 fused qkv + 2 proj + 4 mlp;
    # each fused qkv holds its q/k/v pairs as one of rank 3 x 2
    assert not lora.skipped and len(lora.patches) == 8 and lora.metadata["klein.format"].endswith("(comfyui names)")
    assert sorted(lora.ranks.values()) == [2] * 6 + [6] * 2
    assert lora.metadata["klein.steps"] == str(STEPS)
    assert lora.metadata["klein.base_model"].startswith(M4B_BASE)

    # Klein LoRA Loader accepts it, and the LoRA changes the model's output
    loader = importlib.import_module(f"{env.pack.__name__}.lora").KleinLoraLoader
    assert loader.validate_inputs(name) is True
    base = SimpleNamespace(transformer=load_transformer(env.paths["klein_base_4b"], dtype=torch.float32))
    patched = loader.execute(model=base, lora_name=name, strength=1.0).args[0]
    g = torch.Generator().manual_seed(0)
    feed = {"img": torch.randn(1, 16, 128, generator=g), "img_ids": position_ids(4, 4),
            "txt": torch.randn(1, 5, 96, generator=g), "txt_ids": text_position_ids(5),
            "timesteps": torch.tensor([0.5])}
    with torch.no_grad():
        diff = (patched.transformer(**feed) - base.transformer(**feed)).abs().max().item()
    assert diff > 1e-4, diff


def test_loss_curve_image(trained):
    curve = trained[0].args[1]
    assert curve.shape == (1, 256, 512, 3) and curve.dtype == torch.float32
    assert 0.0 <= curve.min().item() and curve.max().item() <= 1.0
    # the moving average (orange) and the raw losses (blue) are drawn
    px = (curve[0] * 255).round().to(torch.uint8).reshape(-1, 3).tolist()
    assert (240, 170, 60) in map(tuple, px) and (90, 120, 170) in map(tuple, px)


def test_distilled_model_is_refused_with_the_reason(env):
    with pytest.raises(ValueError) as err:
        _run(env, model=M4B, lora_name="distilled")
    msg = str(err.value)
    assert msg.startswith(f"Klein LoRA Trainer: {M4B}: this is a distilled Klein model; LoRAs are trained on the "
                          "base model"), msg
    assert "step distillation bakes the sampling schedule into the weights" in msg
    assert not (env.loras / "distilled.safetensors").exists()


@pytest.mark.parametrize("bad", ["../escape", "sub/lora", "sub\\lora", ".hidden", "", "C:lora"])
def test_path_like_lora_names_are_refused(env, bad):
    with pytest.raises(ValueError, match=r"^Klein LoRA Trainer: lora_name '.*' must be a plain file name"):
        _run(env, lora_name=bad)
    assert not (env.loras.parent / "escape.safetensors").exists()
    assert not (env.loras / "sub").exists()


def test_a_file_not_made_by_the_trainer_is_never_replaced(env):
    from safetensors.torch import save_file

    other = env.loras / "someone_else.safetensors"
    save_file({"x": torch.zeros(1)}, str(other))
    try:
        before = other.read_bytes()
        with pytest.raises(ValueError, match="someone_else.safetensors exists and was not written by this trainer"):
            _run(env, lora_name="someone_else")
        assert other.read_bytes() == before
    finally:
        other.unlink()


def test_cancel_stops_and_leaves_no_lora(env, monkeypatch):
    steps = []

    def cancel_after_step_2():  # Cancel pressed once step 2 showed: the next check stops the run
        if (2, STEPS) in steps:
            raise env.mm.InterruptProcessingException()

    host = importlib.import_module(f"{env.pack.__name__}.host")
    monkeypatch.setattr(host, "check_interrupt", cancel_after_step_2)
    monkeypatch.setattr(env.utils, "PROGRESS_BAR_HOOK",
                        lambda value, total, preview, node_id=None: steps.append((value, total)))
    with pytest.raises(env.mm.InterruptProcessingException):
        _run(env, lora_name="cancelled")
    assert steps == [(1, 3), (2, 3), (3, 3), (1, STEPS), (2, STEPS)]  # the dataset's 3 images, then the steps
    assert not [p for p in os.listdir(env.loras) if "cancelled" in p]  # no LoRA, no temporary file
    assert "cancelled.safetensors" not in env.folder_paths.get_filename_list("loras")


def test_example_workflow_trains_then_loads_that_lora(env):
    import json
    from pathlib import Path

    api = json.loads((Path(__file__).resolve().parents[1] / "example_workflows" / "api" /
                      "klein_train_then_generate.api.json").read_text())
    (trainer,) = [n["inputs"] for n in api.values() if n["class_type"] == "KleinLoraTrainer"]
    (loader_id,) = [k for k, n in api.items() if n["class_type"] == "KleinLoraLoader"]
    (sampler,) = [n["inputs"] for n in api.values() if n["class_type"] == "KleinSampler"]
    assert list(trainer) == [i.id for i in env.node.define_schema().inputs]
    assert trainer["model_name"] == M4B_BASE
    assert env.train.lora_file_name(trainer["lora_name"]) == api[loader_id]["inputs"]["lora_name"]
    assert sampler["model"] == [loader_id, 0]


# ----- fp8 base, sample images ------------------------------------------------------------------------


def _spy_jobs(env, monkeypatch):
    jobs = []
    real = env.train.run_job

    def spy(job, **kw):
        jobs.append(job)
        return real(job, **kw)

    monkeypatch.setattr(env.train, "run_job", spy)
    return jobs


def _sample_files(env, stem):
    """The run folder of LoRA ``stem`` in the output folder (one per settings key)."""
    import glob

    (folder,) = glob.glob(os.path.join(env.folder_paths.get_output_directory(), "klein_lora_training", f"{stem}-*"))
    return folder


def test_fp8_base_reaches_the_job_and_its_lora_loads(env, trained, monkeypatch):
    from safetensors.torch import load_file

    jobs = _spy_jobs(env, monkeypatch)
    name = _run(env, lora_name="tiny_fp8", base_precision="fp8").args[0]
    (job,) = jobs
    assert job.quantize == "fp8"
    lora = load_lora(env.loras / name)
    assert not lora.skipped and len(lora.patches) == 8 and set(lora.ranks.values()) == {2, 6}
    # the same seed and data as the default-precision run: the fp8 base changed what was learnt
    fp8, default = load_file(str(env.loras / name)), load_file(str(env.loras / trained[0].args[0]))
    assert fp8.keys() == default.keys()
    diff = max((fp8[k].float() - default[k].float()).abs().max().item() for k in fp8)
    assert diff > 0, "the fp8 run trained exactly as the default one"
    (env.loras / name).unlink()


def test_default_inputs_send_no_quantize_and_no_samples(env, monkeypatch):
    jobs = []

    def stop(job, **kw):  # only the job's settings matter here
        jobs.append(job)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(env.train, "run_job", stop)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        _run(env, lora_name="tiny_default")
    (job,) = jobs
    assert job.quantize is None and job.config.sample_prompts == () and job.config.sample_every == 0


def test_sample_images_at_every_sample_every_steps(env, monkeypatch):
    jobs = _spy_jobs(env, monkeypatch)
    prompts = "a red square\n\n   \n  a blue circle  \n"  # blank lines are ignored
    out = _run(env, lora_name="tiny_samples", sample_prompts=prompts, sample_every=2, sample_steps=2)
    (job,) = jobs
    cfg = job.config
    assert cfg.sample_prompts == ("a red square", "a blue circle")
    assert (cfg.sample_every, cfg.sample_steps, cfg.sample_seed, cfg.sample_size) == (2, 2, 3, (64, 64))
    samples = out.args[2]
    assert samples.shape == (2 * (STEPS // 2), 64, 64, 3) and samples.dtype == torch.float32
    assert 0.0 <= samples.min().item() and samples.max().item() <= 1.0
    # by step, then by prompt: the two prompts differ, and so do the two steps of one prompt
    assert (samples[0] - samples[1]).abs().max() > 1 / 255 and (samples[2] - samples[3]).abs().max() > 1 / 255
    assert (samples[0] - samples[2]).abs().max() > 0
    folder = _sample_files(env, "tiny_samples")
    files = [os.path.join(folder, f"checkpoint-{s}", f"sample-{i}.png") for s in (2, 4) for i in (0, 1)]
    assert all(os.path.isfile(f) for f in files)
    for f, img in zip(files, samples, strict=True):  # the output is exactly the files written
        px = torch.from_numpy(np.array(Image.open(f).convert("RGB"))).float() / 255
        assert torch.equal(px, img)
    (env.loras / "tiny_samples.safetensors").unlink()


@pytest.mark.parametrize("every", [0, STEPS + 1])
def test_sample_every_zero_or_past_the_end_samples_after_the_last_step(env, monkeypatch, every):
    jobs = _spy_jobs(env, monkeypatch)
    out = _run(env, lora_name="tiny_last", sample_prompts="one prompt", sample_every=every, sample_steps=1)
    assert jobs[0].config.sample_every == STEPS
    assert out.args[2].shape == (1, 64, 64, 3)
    folder = _sample_files(env, "tiny_last")
    assert sorted(os.listdir(folder)) == [f"checkpoint-{STEPS}"]  # the run's folder holds this run's samples only
    warned = [w for w in out.ui["warnings"] if "sample_every" in w]
    if every:
        assert warned == [(f"Klein LoRA Trainer: sample_every ({every}) is more than steps ({STEPS}), so no "
                           "multiple of it is reached; sample images are made once, after the last step")]
    else:
        assert not warned
    (env.loras / "tiny_last.safetensors").unlink()


def test_no_sample_prompts_gives_a_placeholder(env, trained):
    out = trained[0]
    placeholder = out.args[2]
    assert placeholder.shape == (1, 64, 256, 3) and placeholder.dtype == torch.float32
    assert 0.0 <= placeholder.min().item() and placeholder.max().item() <= 1.0
    assert placeholder.max().item() > 0.8  # the text is drawn
    assert torch.equal(placeholder, env.train.placeholder_image())
    assert env.train.sample_prompt_list(" \n\n") == ()


@pytest.mark.parametrize("kw,message", [
    ({"base_precision": "fp16"}, "base_precision 'fp16' is not one of default, fp8."),
    ({"sample_prompts": "x", "sample_every": -1}, "sample_every must be 0 or more"),
    ({"sample_prompts": "x", "sample_steps": 0}, "sample_steps must be 1 or more, got 0."),
])
def test_bad_new_inputs_are_refused_before_training(env, monkeypatch, kw, message):
    jobs = _spy_jobs(env, monkeypatch)
    with pytest.raises(ValueError) as err:
        _run(env, lora_name="tiny_bad", **kw)
    assert str(err.value).startswith(f"Klein LoRA Trainer: {message}"), str(err.value)
    assert not jobs and not (env.loras / "tiny_bad.safetensors").exists()


def test_memory_mode_blocks_trains_the_same_lora(env, trained, monkeypatch):
    from safetensors.torch import load_file

    jobs = _spy_jobs(env, monkeypatch)
    name = _run(env, lora_name="tiny_blocks", memory_mode="blocks").args[0]
    assert jobs[0].memory == "blocks"
    streamed, resident = load_file(str(env.loras / name)), load_file(str(env.loras / trained[0].args[0]))
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    (env.loras / name).unlink()
    with pytest.raises(ValueError, match="Klein LoRA Trainer: memory_mode 'swap' is not one of resident, blocks."):
        _run(env, lora_name="tiny_blocks", memory_mode="swap")


def test_speed_reaches_the_job_and_a_wrong_one_is_refused(env, monkeypatch):
    """The speed choice goes to the job (which applies it to the transformer: tests/test_train_cli.py
    trains the same LoRA at fast); one that is not a choice is refused before anything runs."""
    jobs = _spy_jobs(env, monkeypatch)
    with pytest.raises(ValueError, match="Klein LoRA Trainer: speed 'turbo' is not one of fast, compile, plain."):
        _run(env, lora_name="tiny_speed", speed="turbo")
    assert not jobs
    name = _run(env, lora_name="tiny_speed", speed="fast").args[0]
    assert [j.speed for j in jobs] == ["fast"]
    (env.loras / name).unlink()


def test_cancel_during_sample_images_stops_between_their_steps(env, monkeypatch):
    host = importlib.import_module(f"{env.pack.__name__}.host")
    from klein_core.train import samples as samples_mod

    sampling_steps = []
    real_step = samples_mod.CheckpointSampler._step

    def counting(self, step, total, latents):
        sampling_steps.append(step)
        return real_step(self, step, total, latents)

    def cancel_once_sampling():  # Cancel pressed during the first sample image's second step
        if len(sampling_steps) >= 2:
            raise env.mm.InterruptProcessingException()

    monkeypatch.setattr(samples_mod.CheckpointSampler, "_step", counting)
    monkeypatch.setattr(host, "check_interrupt", cancel_once_sampling)
    with pytest.raises(env.mm.InterruptProcessingException):
        _run(env, lora_name="cancel_sampling", sample_prompts="one prompt", sample_every=2, sample_steps=10)
    assert len(sampling_steps) == 2  # stopped at once, not after the sample's 10 steps
    assert not (env.loras / "cancel_sampling.safetensors").exists()


def test_text_encoder_rank_trains_both_parts(env, monkeypatch):
    jobs = _spy_jobs(env, monkeypatch)
    name = _run(env, lora_name="tiny_te", text_encoder_rank=2).args[0]
    assert jobs[0].text_encoder_rank == 2
    lora = load_lora(env.loras / name)
    assert lora.targets == ("transformer", "text_encoder") and not lora.skipped
    (env.loras / name).unlink()


def test_a_gguf_base_trains(env, tmp_path):
    from gguf_files import write_tiny_gguf_transformer

    gguf = env.paths["klein_base_4b"].parent / "flux-2-klein-base-4b-Q8_0.gguf"
    write_tiny_gguf_transformer(gguf)
    env.folder_paths.filename_list_cache.clear()
    try:
        assert gguf.name in env.node.define_schema().inputs[1].options
        name = _run(env, model=gguf.name, lora_name="tiny_gguf").args[0]
        lora = load_lora(env.loras / name)
        assert not lora.skipped and set(lora.ranks.values()) == {2, 6}
        (env.loras / name).unlink()
    finally:
        gguf.unlink()
        env.folder_paths.filename_list_cache.clear()


def test_a_stopped_run_continues_from_its_last_checkpoint(env, monkeypatch):
    """Cancel after step 3 (checkpoints every step), queue the same inputs again: the run resumes at
    step 3 and writes the LoRA an uninterrupted run writes, bit for bit; other settings start afresh."""
    from safetensors.torch import load_file

    host = importlib.import_module(f"{env.pack.__name__}.host")
    steps_seen: list[int] = []

    def cancel_after_3():  # pressed once step 2 showed: step 3 runs and is checkpointed, then the run stops
        if 2 in steps_seen:
            raise env.mm.InterruptProcessingException()

    jobs = _spy_jobs(env, monkeypatch)
    monkeypatch.setattr(host, "check_interrupt", cancel_after_3)
    monkeypatch.setattr(env.utils, "PROGRESS_BAR_HOOK",  # the steps' bar (the dataset's has 3 items)
                        lambda value, total, preview, node_id=None: steps_seen.append(value) if total == STEPS else None)
    with pytest.raises(env.mm.InterruptProcessingException):
        _run(env, lora_name="tiny_resumed", checkpoint_every=1)
    assert not (env.loras / "tiny_resumed.safetensors").exists()
    monkeypatch.setattr(host, "check_interrupt", lambda: None)
    _run(env, lora_name="tiny_resumed", checkpoint_every=1)
    assert jobs[0].resume is None and jobs[1].resume.endswith("checkpoint-3")
    assert steps_seen[-1] == STEPS and steps_seen.count(4) == 1  # only step 4 ran again
    _run(env, lora_name="tiny_uninterrupted", checkpoint_every=1)
    assert jobs[2].resume is None
    a, b = load_file(str(env.loras / "tiny_resumed.safetensors")), load_file(str(env.loras / "tiny_uninterrupted.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _run(env, lora_name="tiny_resumed", checkpoint_every=1, learning_rate=5e-3)  # other settings: a new run
    assert jobs[3].resume is None
    assert len(os.listdir(os.path.join(env.folder_paths.get_output_directory(), "klein_lora_training"))) >= 3
    for name in ("tiny_resumed", "tiny_uninterrupted"):
        (env.loras / f"{name}.safetensors").unlink()


def test_a_relative_dataset_is_read_in_comfyuis_input_folder(env, tmp_path, monkeypatch):
    """Was a bug: a relative dataset (the shipped workflow's ``input/klein_lora_dataset``) was read from
    the server's working folder, which is not ComfyUI's folder in the portable build, the desktop app
    or with ``--input-directory``: "dataset not found". It is read in the input folder, with or without
    ``input/`` in front; else from the working folder; absolute paths as given."""
    saved = env.folder_paths.get_input_directory()
    inputs = tmp_path / "elsewhere" / "input"
    (inputs / "my_set").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a working folder with no input/ in it
    env.folder_paths.set_input_directory(str(inputs))
    try:
        for text in ("input/my_set", "my_set", " my_set "):
            assert env.train.dataset_path(text) == str(inputs / "my_set"), text
        (tmp_path / "only_here").mkdir()
        assert env.train.dataset_path("only_here") == str(tmp_path / "only_here")
        assert env.train.dataset_path(str(env.data)) == str(env.data)
        # The node's fingerprint follows the folder it reads.
        before = env.node.fingerprint_inputs(dataset="input/my_set")
        Image.new("RGB", (8, 8)).save(inputs / "my_set" / "a.png")
        assert env.node.fingerprint_inputs(dataset="input/my_set") != before
    finally:
        env.folder_paths.set_input_directory(saved)
