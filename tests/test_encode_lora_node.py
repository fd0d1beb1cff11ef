"""Qwen3 Layer-Concat Encoder with a text-encoder LoRA (lora_name / lora_strength), in the ComfyUI
0.3.75 host on the CPU with tiny models: the embeddings are the adapted encoder's, the prompt cache
never mixes adapted and plain embeddings, a retrained file under the same name changes the
fingerprint, and a LoRA without a text-encoder part is refused naming the node that applies it."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

import klein_core as kc
from klein_core.pipeline.prompts import encode_prompts
from klein_core.testing import write_tiny_model_files
from klein_core.testing.tiny import tiny_transformer
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.save import save_lora

PACK = "klein_pack_nodes"
Q4B = "qwen_3_4b.safetensors"
FOLDERS = ("text_encoders", "loras")


@pytest.fixture(scope="module")
def env(comfy_pack, tmp_path_factory):
    folder_paths = comfy_pack.folder_paths
    root = tmp_path_factory.mktemp("encode_lora")
    paths = write_tiny_model_files(root / "models")
    (root / "models" / "loras").mkdir(exist_ok=True)
    saved = {f: folder_paths.folder_names_and_paths[f] for f in FOLDERS}
    for f in FOLDERS:
        folder_paths.folder_names_and_paths[f] = ([str(root / "models" / f)], saved[f][1])
    folder_paths.filename_list_cache.clear()
    encode = importlib.import_module(f"{PACK}.encode")
    cache = importlib.import_module(f"{PACK}.cache")
    te = kc.load_text_encoder(paths["qwen_4b"], dtype=torch.bfloat16)
    text_lora = LoRASet(te, text_encoder_preset(rank=2), seed=1)
    transformer_lora = LoRASet(tiny_transformer(), preset("style", rank=2), seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in [*text_lora.layers.values(), *transformer_lora.layers.values()]:
            layer.up.copy_(torch.randn(layer.up.shape, generator=g) * 0.5)
    loras = root / "models" / "loras"
    save_lora(loras / "both.safetensors", transformer_lora, text_lora=text_lora)
    save_lora(loras / "transformer_only.safetensors", transformer_lora)
    try:
        yield SimpleNamespace(node=encode.KleinTextEncode, encode=encode, cache=cache, te=te, text_lora=text_lora,
                              loras=loras, folder_paths=folder_paths)
    finally:
        cache.release_all("encode lora tests done")
        for f in FOLDERS:
            folder_paths.folder_names_and_paths[f] = saved[f]
        folder_paths.filename_list_cache.clear()


def _encode(env, prompt, **kw):
    with torch.inference_mode():
        return env.node.execute(Q4B, prompt, "blurry", **kw).args[0]




def test_embeddings_are_the_adapted_encoders_and_the_cache_keeps_them_apart(env, caplog):
    prompt = "a lighthouse at dusk"
    plain = _encode(env, prompt)  # cached now
    adapted = _encode(env, prompt, lora_name="both.safetensors")
    env.text_lora.attach(env.te)
    try:
        want = encode_prompts(env.te, [prompt, "blurry"], cache=None)
    finally:
        env.text_lora.detach()
    def dist(a: torch.Tensor, b: torch.Tensor) -> float:  # relative L2
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # bf16 through 27 layers: the node's branches and the training hooks round differently (measured
    # 2.5% relative here; in fp32 they are equal, tests/test_train_text_encoder.py); the LoRA itself: 99.7%
    assert dist(adapted.positive, want[:1]) < 0.05 and dist(adapted.negative, want[1:]) < 0.05
    assert dist(plain.positive, want[:1]) > 0.5
    assert "not applied" not in caplog.text  # the transformer part is Klein LoRA Loader's, not reported here
    misses = env.cache.prompts.misses
    again = _encode(env, prompt)  # still the plain embeddings, from the cache
    assert torch.equal(again.positive, plain.positive) and env.cache.prompts.misses == misses
    assert torch.equal(_encode(env, prompt, lora_name="both.safetensors", lora_strength=0.0).positive,
                       plain.positive)


def test_a_lora_without_a_text_encoder_part_is_refused(env):
    with pytest.raises(ValueError, match=r"Qwen3 Layer-Concat Encoder: lora_name 'transformer_only.safetensors' "
                                         r"has no text-encoder part .* apply it with Klein LoRA Loader"):
        _encode(env, "x", lora_name="transformer_only.safetensors")


def test_fingerprint_follows_the_lora_file(env):
    before = env.node.fingerprint_inputs(lora_name="both.safetensors")
    path = env.loras / "both.safetensors"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert env.node.fingerprint_inputs(lora_name="both.safetensors") != before
    assert env.node.fingerprint_inputs(lora_name="none")[1] is None  # (text encoder file state, LoRA file state)


def test_a_missing_lora_is_named_under_lora_name_only(env):
    """validate_inputs names text_encoder alone: ComfyUI reports a failure under every input its
    signature names, and a missing LoRA was also reported under text_encoder. The node names it when it runs."""
    import inspect
    assert list(inspect.signature(env.node.validate_inputs).parameters) == ["text_encoder"]
    assert env.node.validate_inputs(Q4B) is True
    assert env.node.validate_inputs("gone.safetensors").startswith("text_encoder 'gone.safetensors' is not available")
    with pytest.raises(FileNotFoundError, match="lora_name 'gone.safetensors' was not found in models/loras"):
        env.encode.text_encoder_lora("gone.safetensors")
    assert env.encode.text_encoder_lora("both.safetensors") is not None


def test_a_missing_lora_at_strength_0_is_named_too(env):
    """Was a bug: with lora_strength 0 the LoRA is not loaded, and a wrong lora_name ran silently on
    ComfyUI 0.3.75 (which does not check V3 list inputs at queue time): the graph was wrong and nobody
    said so. The name is checked, the file is not read."""
    with pytest.raises(FileNotFoundError, match="lora_name 'gone.safetensors' was not found in models/loras"):
        _encode(env, "x", lora_name="gone.safetensors", lora_strength=0.0)
    assert _encode(env, "x", lora_name="none", lora_strength=0.0).positive.shape[0] == 1


def test_speed_compile_compiles_the_encoders_layers(env, monkeypatch):
    """``speed = fast + compile`` puts the node's encoder on ``speed="compile"`` (its layers compiled;
    dynamo's eager backend here, so nothing is generated): the embeddings are the plain ones, and
    ``fast`` afterwards takes the compilation off again."""
    from klein_core.accel import fast, speed
    from klein_core.accel.text_encoder import enable_fast_text_encoder

    compiled = []

    def eager_backend(encoder, **kw):
        compiled.append(encoder)
        enable_fast_text_encoder(encoder, compile_backend="eager")

    monkeypatch.setattr(speed, "enable_fast_text_encoder", eager_backend)
    torch._dynamo.reset()
    try:
        prompt = "a lantern on a snowy bridge"  # not cached yet: the encoder runs
        got = _encode(env, prompt, speed="fast + compile")
        (te,) = compiled
        assert all(fast.is_compiled(layer) for layer in te.layers)
        with torch.inference_mode():
            for layer in te.layers:  # the same encoder, plain, for the reference
                fast._uncompile(layer)
            want = encode_prompts(te, [prompt, "blurry"], cache=None)
        assert torch.equal(got.positive, want[:1]) and torch.equal(got.negative, want[1:])
        _encode(env, "another prompt, not cached", speed="fast")
        assert speed.speed_of(te) == "fast"
    finally:
        torch._dynamo.reset()
