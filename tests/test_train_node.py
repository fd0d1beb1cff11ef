"""Klein LoRA Trainer node (nodes/train.py) in the ComfyUI 0.3.75 host, on the CPU, with tiny models:
it trains, writes the LoRA into models/loras (which load_lora and Klein LoRA Loader read), draws the
loss curve, refuses a distilled base and path-like names, and Cancel leaves no LoRA file."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from klein_core.files.loaders import load_transformer
from klein_core.lora import load_lora
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.testing import write_tiny_model_files

M4B, M4B_BASE = "flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"
Q4B, VAE = "qwen_3_4b.safetensors", "flux2-vae.safetensors"
FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared 2-core machine
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def env(comfy_pack, tmp_path_factory):
    folder_paths = comfy_pack.folder_paths
    root = tmp_path_factory.mktemp("train_node")
    paths = write_tiny_model_files(root / "models")
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    saved_temp = folder_paths.get_temp_directory()
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(root / "models" / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    folder_paths.set_temp_directory(str(root / "temp"))
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
                                            "steps", "learning_rate", "seed", "lora_name", "resolution"]
    assert "ON THE SERVER" in schema.inputs[0].tooltip
    assert schema.inputs[1].options == sorted(os.listdir(env.paths["klein_4b"].parent))
    assert [o.io_type for o in schema.outputs] == ["STRING", "IMAGE"]
    assert env.node.validate_inputs(M4B_BASE, VAE, "nope.safetensors").startswith(
        "text_encoder 'nope.safetensors' is not available")


def test_trains_and_writes_a_lora_the_loader_reads(env, trained):
    out, calls = trained
    name = out.args[0]
    assert name == "tiny_style.safetensors"
    assert sorted(os.listdir(env.loras)) == ["tiny_style.safetensors"]  # nothing else in models/loras
    assert calls == [(i, STEPS) for i in range(1, STEPS + 1)]
    # the unreadable image is skipped and the user is told, by file name only
    (warning,) = out.ui["warnings"]
    assert warning.startswith("skipped broken.png: unreadable image"), warning
    lora = load_lora(env.loras / name)
    assert not lora.skipped and len(lora.patches) == 12  # 1 double block: 6 q/k/v + 2 proj + 4 mlp
    assert set(lora.ranks.values()) == {2}
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
    assert steps == [(1, STEPS), (2, STEPS)]
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
