"""Hunting the prompt-encoding path: TextOptions, the memory and disk prompt caches and their keys,
the tokenizer's warnings and errors, Engine.cached_prompts and the Qwen3 Layer-Concat Encoder node.

Each test either shows a bug (fixed with it; its docstring says which) or covers an edge case no
other test covers.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_prompts import LONG, encoder, model_files  # noqa: F401 - tiny fp32 files, their encoder

import klein_core as kc
from klein_core.pipeline.prompts import encode_prompts, encoder_identity, loaded_encoder_identity
from klein_core.pipeline.tokenizer import count_tokens
from klein_core.testing import TINY_4B, tiny_text_encoder, write_tiny_model_files

TOKENIZER_LOG = "klein_core.pipeline.tokenizer"


def _cut_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == TOKENIZER_LOG and r.levelno >= logging.WARNING and "truncated" in r.getMessage()]


# ----- cache keys: what an embedding depends on -----------------------------------------------------


def test_an_in_memory_encoder_converted_to_another_dtype_gets_its_own_embeddings():
    """Was a bug: an encoder not loaded from a file is keyed by id(encoder) alone; converted in place to
    another dtype (``.double()``, ``.half()``), it is served the embeddings it made before, in the old
    dtype, although it now computes in the new one."""
    te = tiny_text_encoder()
    cache = kc.PromptCache()
    cache.encode(te, ["a red fox"])
    te.double()
    out = cache.encode(te, ["a red fox"])
    assert out.dtype == torch.float64, f"served the float32 embedding to a float64 encoder ({out.dtype})"
    assert torch.equal(out, encode_prompts(te, ["a red fox"], cache=None))


def test_prompts_that_differ_only_in_whitespace_or_normal_form_are_each_encoded_as_written(encoder):  # noqa: F811
    """Edge case (passes): prompts that differ only in whitespace (trailing space, double space,
    no-break space, CRLF) tokenize differently and must each get their own cache entry, in the order
    asked, also from the cache; NFD and NFC forms tokenize alike (NFC) and give equal embeddings."""
    prompts = ["a cat", "a cat ", "a  cat", "a\u00a0cat", "a\r\ncat", "a\ncat", "cafe\u0301", "caf\u00e9"]
    cache = kc.PromptCache()
    first = cache.encode(encoder, prompts)
    expected = torch.cat([encode_prompts(encoder, [p], cache=None) for p in prompts])
    assert torch.equal(first, expected)
    assert all(not torch.equal(first[i], first[j]) for i in range(6) for j in range(i))
    assert torch.equal(first[6], first[7])
    again = cache.encode(encoder, prompts[::-1])
    assert cache.misses == len(prompts) and torch.equal(again, expected.flip(0))


def test_a_long_prompt_cut_at_512_shares_its_entry_between_trimmed_and_full_padding(encoder, tmp_path):  # noqa: F811
    """Edge case (passes): TextOptions.key() leaves ``trim`` out because the padded length is in the
    key. A prompt over 512 tokens has length 512 with and without trim; the trimmed run is served
    the untrimmed run's disk entry, equal to it, and a short prompt is not (its trimmed length, 64,
    is another key; its embedding is the first 64 rows of the padded one)."""
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    cache = kc.PromptCache(disk=disk)
    full = cache.encode(encoder, [LONG, "a cat"], kc.TextOptions())
    trimmed = kc.PromptCache(disk=disk).encode(encoder, [LONG], kc.TextOptions(trim=64))
    assert disk.hits == 1 and torch.equal(trimmed, full[:1])
    short = kc.PromptCache(disk=disk).encode(encoder, ["a cat"], kc.TextOptions(trim=64))
    assert short.shape[1] == 64 and torch.equal(short, full[1:, :64])


# ----- counts ----------------------------------------------------------------------------------------


def test_a_prompt_repeated_in_one_call_is_not_counted_as_a_hit_of_an_empty_cache(encoder):  # noqa: F811
    """Was a bug: PromptCache.encode counts ``len(prompts) - len(todo)`` hits, ``todo`` being the distinct
    prompts not cached: a batch repeating one prompt (a prompt equal to the negative, CFG in the
    BFL way encodes both in one batch) counts a hit although nothing was in the cache."""
    cache = kc.PromptCache()
    out = cache.encode(encoder, ["a cat", "a cat"])
    assert torch.equal(out[0], out[1])
    assert (cache.hits, cache.misses) == (0, 1), (cache.hits, cache.misses)


# ----- warnings for cut prompts ---------------------------------------------------------------------


def test_the_cut_warning_names_the_prompts_place_in_the_callers_list(encoder, caplog):  # noqa: F811
    """Was a bug: the tokenizer's warning numbers prompts within the batch it encodes; PromptCache.encode
    encodes only the prompts not cached, so with prompt 0 cached, the cut prompt 1 is reported as
    'prompt 0'."""
    cache = kc.PromptCache()
    cache.encode(encoder, ["a cat"])
    caplog.set_level(logging.WARNING, logger=TOKENIZER_LOG)
    caplog.clear()
    cache.encode(encoder, ["a cat", LONG])
    [warning] = _cut_warnings(caplog)
    assert warning.startswith("prompt 1 "), warning


def test_a_cut_prompt_served_from_the_disk_cache_is_still_warned(encoder, tmp_path, caplog):  # noqa: F811
    """Was a bug: the only warning that a prompt was cut at 512 tokens is the tokenizer's, so a prompt
    served from the cache is cut silently: after a restart (the disk cache) the user never hears
    that the end of the prompt is ignored. (The encoder node warns on its own; the Python API and
    the CLI's --prompt-cache do not.)"""
    caplog.set_level(logging.WARNING, logger=TOKENIZER_LOG)
    kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "prompts")).encode(encoder, [LONG])
    assert len(_cut_warnings(caplog)) == 1
    caplog.clear()
    restarted = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "prompts"))
    assert kc.Engine(prompt_cache=restarted).cached_prompts(
        [LONG], identity=loaded_encoder_identity(encoder)) is not None
    caplog.clear()
    restarted.encode(encoder, [LONG])
    assert restarted.hits == 2 and _cut_warnings(caplog), "a 2702-token prompt was cut at 512 without a word"


def test_a_whole_prompt_is_never_warned_and_a_trimmed_one_only_when_over_512(encoder, caplog):  # noqa: F811
    """Edge case (passes): no cut warning in ComfyUI's whole-prompt mode (nothing is cut, even padded
    with trim), nor for a prompt of exactly 512 tokens with trim; one for 513 tokens with trim."""
    caplog.set_level(logging.WARNING, logger=TOKENIZER_LOG)
    exact = "a" + " a" * (512 - count_tokens("a"))  # " a" is one token
    over = exact + " a"
    assert count_tokens(exact) == 512 and count_tokens(over) == 513
    cache = None
    encode_prompts(encoder, [LONG], cache=cache, options=kc.COMFYUI_TEXT)
    encode_prompts(encoder, [LONG], cache=cache, options=kc.TextOptions(max_tokens=None, trim=64))
    out = encode_prompts(encoder, [exact], cache=cache, options=kc.TextOptions(trim=64))
    assert out.shape[1] == 512 and not _cut_warnings(caplog)
    encode_prompts(encoder, [over], cache=cache, options=kc.TextOptions(trim=64))
    assert len(_cut_warnings(caplog)) == 1


# ----- errors that name the input -------------------------------------------------------------------


@pytest.mark.parametrize("options", [kc.TextOptions(), kc.COMFYUI_TEXT, kc.TextOptions(trim=64)],
                         ids=["512", "whole", "trim"])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
def test_an_empty_prompt_list_is_refused_naming_it(encoder, options, cached):  # noqa: F811
    """Was a bug: encode_prompts(te, []) says 'prompts must contain at least one prompt' only without a
    cache and without whole-prompt mode; with a cache it fails inside torch.cat ('expected a
    non-empty list of Tensors'), in whole-prompt mode inside TextOptions.length ('int' object is not
    iterable: max(512, *[]))."""
    cache = kc.PromptCache() if cached else None
    with pytest.raises(ValueError, match="at least one prompt"):
        encode_prompts(encoder, [], cache=cache, options=options)


@pytest.mark.parametrize("options", [kc.TextOptions(), kc.COMFYUI_TEXT, kc.TextOptions(trim=64)],
                         ids=["512", "whole", "trim"])
def test_a_prompt_with_an_unpaired_surrogate_is_refused_naming_it(encoder, options):  # noqa: F811
    """Was a bug: tokenize_prompts names an unpaired surrogate ('prompts[0] is not valid Unicode text'),
    but count_tokens, which TextOptions.length calls first in whole-prompt and trimmed modes, hands
    it to the tokenizers library: 'TextEncodeInput must be Union[TextInputSequence, ...]'."""
    with pytest.raises(ValueError, match=r"unpaired surrogate U\+D83D"):
        encode_prompts(encoder, ["a \ud83d cat"], cache=None, options=options)
    with pytest.raises(ValueError, match=r"unpaired surrogate U\+D83D"):
        count_tokens("a \ud83d cat")


@pytest.mark.parametrize("options", [kc.TextOptions(), kc.COMFYUI_TEXT], ids=["512", "whole"])
def test_a_prompt_that_is_not_a_string_is_refused_naming_it_with_a_cache(encoder, options):  # noqa: F811
    """Was a bug: with a cache, a prompt that is a list fails on the cache's dict ('unhashable type:
    list'), and in whole-prompt mode as 'prompt must be a str' without its index; without a cache
    the tokenizer says 'prompts[1] must be a str, got list'."""
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str, got list"):
        encode_prompts(encoder, ["a cat", ["a dog"]], cache=kc.PromptCache(), options=options)


# ----- the disk cache never crashes generation ------------------------------------------------------


def test_an_encoder_file_whose_name_is_not_utf8_does_not_break_the_disk_cache(model_files, tmp_path):  # noqa: F811
    """Was a bug: a file name with bytes that are not UTF-8 (a Latin-1 name on Linux) reaches Python as a
    surrogate escape; DiskPromptCache.put writes the identity into the entry's metadata, safetensors
    cannot encode it and raises UnicodeEncodeError, which put does not catch (it promises to log and
    never raise): encoding fails whenever a disk cache is set."""
    odd = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/qwen_3_4b_\xe9t\xe9.safetensors"))
    shutil.copy(model_files["qwen_4b"], odd)
    te = kc.load_text_encoder(odd)
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "prompts"))
    out = cache.encode(te, ["a red fox"])
    assert torch.equal(out, encode_prompts(te, ["a red fox"], cache=None))
    restarted = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path / "prompts"))
    assert restarted.cached(loaded_encoder_identity(te), ["a red fox"]) is not None


# ----- the encoder node -----------------------------------------------------------------------------


PACK = "klein_pack_nodes"
Q4B = "qwen_3_4b.safetensors"


@pytest.fixture(scope="module")
def node(comfy_pack, tmp_path_factory):
    folder_paths = comfy_pack.folder_paths
    root = tmp_path_factory.mktemp("encode_node")
    write_tiny_model_files(root / "models", dtype=torch.float32)
    saved = folder_paths.folder_names_and_paths["text_encoders"]
    folder = str(root / "models" / "text_encoders")
    folder_paths.folder_names_and_paths["text_encoders"] = ([folder], saved[1])
    folder_paths.filename_list_cache.clear()
    encode = importlib.import_module(f"{PACK}.encode")
    cache = importlib.import_module(f"{PACK}.cache")
    try:
        yield SimpleNamespace(node=encode.KleinTextEncode, cache=cache)
    finally:
        cache.release_all("prompt hunt done")
        folder_paths.folder_names_and_paths["text_encoders"] = saved
        folder_paths.filename_list_cache.clear()


def test_the_encoder_node_names_the_input_holding_an_unpaired_surrogate(node, monkeypatch):
    """Was a bug: a prompt with an unpaired surrogate (JSON from a client may carry '\\ud83d' alone) fails
    in the node's cut-warning check (count_tokens) with the tokenizers library's 'TextEncodeInput
    must be Union[...]': neither the input nor the problem is named."""
    monkeypatch.delenv("KLEIN_PROMPT_CACHE", raising=False)
    named = r"(?s)negative_prompt.*surrogate|surrogate.*negative_prompt"
    with pytest.raises(ValueError, match=named), torch.inference_mode():
        node.node.execute(Q4B, "a cat", "blurry \ud83d")



# ----- the encoder's identity: the files it was read from ---------------------------------------------


def _repo_root(tmp_path: Path, model_files: dict[str, Path]) -> Path:  # noqa: F811
    """A diffusers-style repo root: ``text_encoder/`` (weights and config.json), ``vae/``, ``transformer/``."""
    root = tmp_path / "FLUX.2-klein-4B"
    for sub, key, name in (("text_encoder", "qwen_4b", "model.safetensors"),
                           ("vae", "vae", "diffusion_pytorch_model.safetensors"),
                           ("transformer", "klein_4b", "diffusion_pytorch_model.safetensors")):
        (root / sub).mkdir(parents=True)
        shutil.copy(model_files[key], root / sub / name)
    (root / "text_encoder" / "config.json").write_text('{"rms_norm_eps": 1e-06}')
    return root


def _bump(path: Path, seconds: int = 10) -> None:
    """A later modification time, as a replaced file gets (the clock tick may not show a quick rewrite)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_the_identity_of_a_repo_root_is_the_identity_of_the_encoder_loaded_from_it(model_files, tmp_path):  # noqa: F811
    """Was a bug: ``encoder_identity(root)`` (the CLI's and a script's key to look up prompts before
    loading the encoder) stamped every ``.safetensors`` under the root, the transformer and the VAE
    too, while the loaded encoder's identity stamped only ``text_encoder/``: they never matched, so
    a prompt cached from a repo root was never found without loading the encoder."""
    root = _repo_root(tmp_path, model_files)
    te = kc.load_text_encoder(root)
    assert encoder_identity(root, torch.float32, "cpu") == loaded_encoder_identity(te) is not None
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    kc.PromptCache(disk=disk).encode(te, ["a red fox"])
    found = kc.Engine(prompt_cache=kc.PromptCache(disk=disk)).cached_prompts(
        ["a red fox"], identity=encoder_identity(root, torch.float32, "cpu"))
    assert found is not None and torch.equal(found.positive, encode_prompts(te, ["a red fox"], cache=None))
    # The VAE and the transformer are not what the embeddings depend on; the VAE's own identity is its file.
    text_before = encoder_identity(root, torch.float32, "cpu")
    vae_before = encoder_identity(root, torch.float32, "cpu", component="vae")
    _bump(root / "vae" / "diffusion_pytorch_model.safetensors")
    _bump(root / "transformer" / "diffusion_pytorch_model.safetensors")
    assert encoder_identity(root, torch.float32, "cpu") == text_before
    assert encoder_identity(root, torch.float32, "cpu", component="vae") != vae_before


def test_a_changed_config_json_is_a_new_encoder_for_the_prompt_cache(model_files, tmp_path):  # noqa: F811
    """Was a bug: a folder encoder's identity stamped only its ``.safetensors`` files, but its
    ``config.json`` sets ``rms_norm_eps`` and ``rope_theta``: after the config changed, the disk
    cache served the embeddings of the old config."""
    root = _repo_root(tmp_path, model_files)
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    old = kc.PromptCache(disk=disk).encode(kc.load_text_encoder(root), ["a red fox"])
    config = root / "text_encoder" / "config.json"
    config.write_text('{"rms_norm_eps": 0.5}')
    _bump(config)
    te = kc.load_text_encoder(root)
    new = encode_prompts(te, ["a red fox"], cache=None)
    assert (new - old).abs().max() > 1e-3  # the config matters to the embeddings
    restarted = kc.PromptCache(disk=disk)
    assert restarted.cached(encoder_identity(root, torch.float32, "cpu"), ["a red fox"]) is None
    assert torch.equal(restarted.encode(te, ["a red fox"]), new)


def test_a_file_replaced_under_a_loaded_encoder_keeps_the_old_weights_out_of_the_new_files_entries(
        model_files, tmp_path):  # noqa: F811
    """Was a bug: the loaded encoder's identity was its file's ``stat`` at the time of the call. A
    file replaced while the old encoder stayed loaded (ComfyUI keeps it until the node runs again)
    had the old weights' embeddings stored under the new file's identity, and served for it."""
    path = tmp_path / "qwen_3_4b.safetensors"
    shutil.copy(model_files["qwen_4b"], path)
    old_te = kc.load_text_encoder(path)
    new_weights = tiny_text_encoder(TINY_4B, seed=7).state_dict()
    from safetensors.torch import save_file
    save_file({"model." + k: v.float().contiguous() for k, v in new_weights.items()}, str(path))
    _bump(path)
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    kc.PromptCache(disk=disk).encode(old_te, ["a red fox"])  # the old weights, encoded after the swap
    looked_up = kc.PromptCache(disk=disk).cached(encoder_identity(path, torch.float32, "cpu"), ["a red fox"])
    assert looked_up is None
    new = kc.PromptCache(disk=disk).encode(kc.load_text_encoder(path), ["a red fox"])
    assert torch.equal(new, encode_prompts(kc.load_text_encoder(path), ["a red fox"], cache=None))
    assert not torch.equal(new, encode_prompts(old_te, ["a red fox"], cache=None))


def test_a_file_that_changes_while_it_is_read_gives_an_encoder_that_is_never_cached(
        model_files, tmp_path, monkeypatch):  # noqa: F811
    """Weights read from a file that changed during the load are of neither version: no identity,
    nothing cached under either file's key (the encoder still encodes)."""
    from klein_core.files import loaders
    path = tmp_path / "qwen_3_4b.safetensors"
    shutil.copy(model_files["qwen_4b"], path)
    real = loaders.materialize

    def touched_meanwhile(*args, **kwargs):
        out = real(*args, **kwargs)
        _bump(path)
        return out

    monkeypatch.setattr(loaders, "materialize", touched_meanwhile)
    te = kc.load_text_encoder(path)
    monkeypatch.setattr(loaders, "materialize", real)
    assert loaded_encoder_identity(te) is None
    disk = kc.DiskPromptCache(tmp_path / "prompts")
    cache = kc.PromptCache(disk=disk)
    cache.encode(te, ["a red fox"])
    assert disk.size_bytes() == 0 and len(cache) == 1  # kept in memory for this object only
    assert kc.load_text_encoder(path) is not None and loaded_encoder_identity(kc.load_text_encoder(path)) is not None
