"""The prompt caches under hostile files and inputs (#28).

Disk entries of the wrong shape, dtype, width or key, with NaN, truncated, pickled or foreign are
refused with one warning naming the file, removed and encoded again; a folder that cannot be
written (read-only, full) is one warning naming it, and generation goes on; writes are atomic;
settings are checked when the caches are made; valid entries are always served.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files.safetensors import open_safetensors
from klein_core.pipeline.prompts import encode_prompts, loaded_encoder_identity
from klein_core.testing import write_tiny_model_files

LOGGER = "klein_core.pipeline.prompts"
PROMPT = "a lighthouse at dusk"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    files = write_tiny_model_files(tmp_path_factory.mktemp("models"), dtype=torch.float32)
    return kc.load_text_encoder(files["qwen_4b"])


@pytest.fixture(scope="module")
def fresh(encoder) -> torch.Tensor:
    return encode_prompts(encoder, [PROMPT], cache=None)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _stored(encoder, folder: Path, prompt: str = PROMPT) -> Path:
    """A folder holding the valid entry of ``prompt``; its path."""
    kc.PromptCache(disk=kc.DiskPromptCache(folder)).encode(encoder, [prompt])
    [path] = [p for p in _entries(folder) if open_safetensors(p).metadata.get("prompt") == prompt]
    return path


def _rewrite(path: Path, tensors: dict[str, torch.Tensor] | None = None, **meta: str | None) -> None:
    """Replace the entry at ``path`` by ``tensors`` with its metadata changed by ``meta`` (None drops a key)."""
    old = open_safetensors(path)
    metadata = {k: v for k, v in {**old.metadata, **meta}.items() if v is not None}
    if tensors is None:
        tensors = {"embedding": old.read("embedding")}
    path.unlink()
    save_file(tensors, str(path), metadata=metadata)


def _valid(path: Path) -> torch.Tensor:
    return open_safetensors(path).read("embedding")


def _nan(t):
    t = t.clone()
    t[0, 3, 5] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[0, -1, 0] = float("-inf")
    return t


# name -> (how the entry is spoiled, what the warning says)
SPOILED = {
    "short": (lambda p, t: _rewrite(p, {"embedding": t[:, :10].contiguous()}), "shape [1, 10, 96], expected [1, 512, 96]"),
    "batch of two": (lambda p, t: _rewrite(p, {"embedding": torch.cat([t, t])}), "shape [2, 512, 96], expected"),
    "2-d": (lambda p, t: _rewrite(p, {"embedding": t[0].contiguous()}), "shape [512, 96], expected [1, 512, 96]"),
    "NaN": (lambda p, t: _rewrite(p, {"embedding": _nan(t)}), "NaN or infinite"),
    "Inf": (lambda p, t: _rewrite(p, {"embedding": _inf(t)}), "NaN or infinite"),
    "int64": (lambda p, t: _rewrite(p, {"embedding": t.to(torch.int64)}, dtype="int64"),
              "dtype int64 is not a floating-point type"),
    "dtype not as written": (lambda p, t: _rewrite(p, {"embedding": t.half()}),
                             "dtype float16, but 'float32' was written"),
    "width not as written": (lambda p, t: _rewrite(p, {"embedding": torch.zeros(1, 512, 100)}),
                             "shape [1, 512, 100], expected [1, 512, 96]"),
    "another encoder's width": (lambda p, t: _rewrite(p, {"embedding": torch.zeros(1, 512, 100)}, width="100"),
                                "written with width 100; the encoder produces 96"),
    "width not a number": (lambda p, t: _rewrite(p, width="²"), "width metadata '²' is not a number"),
    "another key": (lambda p, t: _rewrite(p, key="0" * 64), "its key does not match"),
    "two tensors": (lambda p, t: _rewrite(p, {"embedding": t, "extra": t.clone()}), "not one tensor 'embedding'"),
    "renamed tensor": (lambda p, t: _rewrite(p, {"emb": t}), "not one tensor 'embedding'"),
    "no metadata": (lambda p, t: (p.unlink(), save_file({"embedding": t}, str(p))),
                    "not a prompt cache entry (format None"),
    "another format": (lambda p, t: _rewrite(p, format="klein-prompt-embedding/99"), "not a prompt cache entry"),
    "truncated": (lambda p, t: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
    "empty": (lambda p, t: p.write_bytes(b""), "only 0 bytes long"),
    "text": (lambda p, t: p.write_text("not a safetensors file"), "not a safetensors"),
    "pickle": (lambda p, t: torch.save({"embedding": t}, p), "never unpickles"),
    "huge header claim": (lambda p, t: p.write_bytes((10**15).to_bytes(8, "little") + b"{}"), "header claims"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_a_spoiled_entry_is_named_removed_and_encoded_again(encoder, fresh, tmp_path, caplog, monkeypatch, case):
    spoil, says = SPOILED[case]
    path = _stored(encoder, tmp_path)
    spoil(path, _valid(path))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a cache entry was unpickled"))
    disk = kc.DiskPromptCache(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = kc.PromptCache(disk=disk).encode(encoder, [PROMPT])  # nothing in memory: the disk is read
    [warning] = _warnings(caplog)
    assert str(path) in warning and "removing unreadable entry" in warning and says in warning, warning
    assert torch.equal(got, fresh) and disk.misses == 1 and disk.hits == 0
    # the bad file is gone: the entry there now is the fresh one, served from now on without a word
    assert _entries(tmp_path) == [path] and torch.equal(_valid(path), fresh)
    caplog.clear()
    restarted = kc.DiskPromptCache(tmp_path)
    assert torch.equal(kc.PromptCache(disk=restarted).cached(loaded_encoder_identity(encoder), [PROMPT]), fresh)
    assert restarted.hits == 1 and _warnings(caplog) == []


@pytest.mark.parametrize("case", ["short", "NaN", "int64", "another key", "pickle"])
def test_a_spoiled_entry_is_a_miss_without_the_encoder(encoder, tmp_path, caplog, case):
    spoil, says = SPOILED[case]
    path = _stored(encoder, tmp_path)
    spoil(path, _valid(path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert kc.PromptCache(disk=kc.DiskPromptCache(tmp_path)).cached(loaded_encoder_identity(encoder), [PROMPT]) is None
    [warning] = _warnings(caplog)
    assert str(path) in warning and says in warning and not path.exists()


def test_a_width_the_encoder_does_not_produce_is_refused_where_it_is_known(encoder, fresh, tmp_path, caplog):
    """An entry consistent in itself but of another width: refused when the width is given, once the
    cache has seen the encoder, and by encode (which drops it from memory too)."""
    identity = loaded_encoder_identity(encoder)
    path = _stored(encoder, tmp_path)
    wrong = torch.randn(1, 512, 100)
    _rewrite(path, {"embedding": wrong}, width="100")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert kc.PromptCache(disk=kc.DiskPromptCache(tmp_path)).cached(identity, [PROMPT], width=96) is None
    assert not path.exists() and "the encoder produces 96" in _warnings(caplog)[0]

    path = _stored(encoder, tmp_path)
    _rewrite(path, {"embedding": wrong}, width="100")
    learned = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    learned.encode(encoder, ["another prompt"])  # the cache now knows this encoder's width
    assert learned.cached(identity, [PROMPT]) is None and not path.exists()

    path = _stored(encoder, tmp_path)
    _rewrite(path, {"embedding": wrong}, width="100")
    blind = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    assert torch.equal(blind.cached(identity, [PROMPT]), wrong)  # without a width nothing says it is wrong...
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert torch.equal(blind.encode(encoder, [PROMPT]), fresh)  # ...but the encoder does
    assert len(_warnings(caplog)) == 1 and str(path) in _warnings(caplog)[0]
    assert torch.equal(_valid(path), fresh) and torch.equal(blind.cached(identity, [PROMPT]), fresh)


def test_entries_of_different_widths_are_never_concatenated(encoder, tmp_path):
    identity = loaded_encoder_identity(encoder)
    kc.PromptCache(disk=kc.DiskPromptCache(tmp_path)).encode(encoder, ["one", "two"])
    path = _stored(encoder, tmp_path, "two")
    _rewrite(path, {"embedding": torch.zeros(1, 512, 100)}, width="100")
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    assert cache.cached(identity, ["one", "two"]) is None  # not a RuntimeError from torch.cat
    assert torch.equal(cache.encode(encoder, ["one", "two"]), encode_prompts(encoder, ["one", "two"], cache=None))
    assert torch.equal(_valid(path), encode_prompts(encoder, ["two"], cache=None))  # rewritten


def test_an_entry_of_an_older_version_is_encoded_again_quietly(encoder, fresh, tmp_path, caplog):
    """Entries from before the key, dtype and width were stored cannot be checked against the
    request: they are replaced once, with one info line for the folder, not a warning per file."""
    path = _stored(encoder, tmp_path)
    old = _valid(path)
    path.unlink()
    save_file({"embedding": old}, str(path), metadata={"prompt": PROMPT, "encoder": "qwen_4b.safetensors"})
    disk = kc.DiskPromptCache(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert torch.equal(kc.PromptCache(disk=disk).encode(encoder, [PROMPT]), fresh)
    assert _warnings(caplog) == [] and str(tmp_path) in caplog.text and "older version" in caplog.text
    assert open_safetensors(path).metadata["format"] == "klein-prompt-embedding/1" and disk.misses == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_valid_entry_is_served(tmp_path, caplog, dtype):
    disk = kc.DiskPromptCache(tmp_path)
    whole = kc.TextOptions(max_tokens=None)
    stored = {}
    for i, (length, width, options) in enumerate([(512, 96, kc.TextOptions()), (700, 7680, whole), (8, 3, whole)]):
        emb = torch.randn(1, length, width).to(dtype)
        disk.put("enc|float32|None|cpu", f"prompt {i}", length, options, emb)
        stored[i] = (length, options, emb)
    restarted = kc.DiskPromptCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i, (length, options, emb) in stored.items():
            got = restarted.get("enc|float32|None|cpu", f"prompt {i}", length, options, emb.shape[-1])
            assert got is not None and got.dtype == dtype and torch.equal(got, emb)
    assert restarted.hits == 3 and _warnings(caplog) == []
    with pytest.raises(ValueError, match=r"\[1, 4, width\]"):
        disk.put("enc", "p", 4, kc.TextOptions(), torch.zeros(1, 5, 3))


# ----- folders that cannot be written ------------------------------------------------------------

FOLDER_FAILURES = {
    "read-only at the rename": ("os.replace", OSError(errno.EROFS, os.strerror(errno.EROFS)), "Read-only file system"),
    "full at the rename": ("os.replace", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device"),
    "full while saving": ("save_file", SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                                                       "StorageFull })"), "StorageFull"),
    "read-only at the temporary file": ("tempfile.mkstemp", PermissionError(errno.EACCES, os.strerror(errno.EACCES)),
                                        "Permission denied"),
}


@pytest.mark.parametrize("case", list(FOLDER_FAILURES))
def test_a_folder_that_cannot_be_written_is_one_warning(encoder, tmp_path, caplog, monkeypatch, case):
    where, exc, says = FOLDER_FAILURES[case]
    calls = []

    def fail(*args, **kwargs):
        calls.append(args)
        raise exc

    if where == "save_file":
        monkeypatch.setattr(safetensors.torch, "save_file", fail)
    elif where == "os.replace":
        monkeypatch.setattr(os, "replace", fail)
    else:
        monkeypatch.setattr("tempfile.mkstemp", fail)
    disk = kc.DiskPromptCache(tmp_path / "pc")
    cache = kc.PromptCache(disk=disk)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for prompts in (["one"], ["two", "three"], ["four"]):
            assert torch.equal(cache.encode(encoder, prompts), encode_prompts(encoder, prompts, cache=None))
    [warning] = _warnings(caplog)
    assert str(disk.folder) in warning and says in warning and disk.write_error is not None
    assert len(calls) == 1  # not tried again
    assert list(disk.folder.iterdir()) == []  # no entry, no temporary file left behind
    assert torch.equal(cache.encode(encoder, ["one"]), encode_prompts(encoder, ["one"], cache=None))  # memory


def test_a_hit_in_a_read_only_folder_is_served(encoder, fresh, tmp_path, caplog, monkeypatch):
    path = _stored(encoder, tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "utime", read_only)
    disk = kc.DiskPromptCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = kc.PromptCache(disk=disk).cached(loaded_encoder_identity(encoder), [PROMPT])
        again = kc.PromptCache(disk=disk).cached(loaded_encoder_identity(encoder), [PROMPT])
    assert torch.equal(got, fresh) and torch.equal(again, fresh) and disk.hits == 2
    [warning] = _warnings(caplog)
    assert str(tmp_path) in warning and "Read-only file system" in warning and path.exists()


def test_a_bad_entry_that_cannot_be_removed_is_named_once(encoder, fresh, tmp_path, caplog, monkeypatch):
    path = _stored(encoder, tmp_path)
    _rewrite(path, {"embedding": _nan(_valid(path))})
    real_unlink = pathlib.Path.unlink

    def read_only(self, *args, **kwargs):
        if self == path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            cache.clear()
            assert torch.equal(cache.encode(encoder, [PROMPT]), fresh)
    folder, entry = _warnings(caplog)
    assert str(tmp_path) in folder and "Read-only file system" in folder
    assert str(path) in entry and "cannot be removed" in entry and "NaN" in entry
    assert path.exists()  # still there, still bad, never served


def test_a_read_only_folder_by_permissions(encoder, fresh, tmp_path, caplog):
    path = _stored(encoder, tmp_path)
    os.chmod(tmp_path, 0o555)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("permissions do not bind this user (root)")
        cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert torch.equal(cache.encode(encoder, [PROMPT]), fresh)  # a hit
            assert torch.equal(cache.encode(encoder, ["new"]), encode_prompts(encoder, ["new"], cache=None))
            assert torch.equal(cache.encode(encoder, ["newer"]), encode_prompts(encoder, ["newer"], cache=None))
        [warning] = _warnings(caplog)
        assert str(tmp_path) in warning and _entries(tmp_path) == [path]
    finally:
        os.chmod(tmp_path, 0o755)


def test_a_killed_writer_leaves_nothing_that_is_served(encoder, fresh, tmp_path, caplog, monkeypatch):
    """A write cut short (the process killed while saving) leaves at most a temporary file, never a
    half entry; old temporary files are removed by later writes, young ones (a writer at work) kept."""
    real = safetensors.torch.save_file

    def killed(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise KeyboardInterrupt  # stands for the kill (nothing catches it)

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        kc.PromptCache(disk=kc.DiskPromptCache(tmp_path)).encode(encoder, [PROMPT])
    assert _entries(tmp_path) == []  # only the temporary file could have been left
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    stale, young = tmp_path / ".klein-prompt-stale.tmp", tmp_path / ".klein-prompt-young.tmp"
    stale.write_bytes(b"half an entry")
    young.write_bytes(b"being written")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert torch.equal(cache.encode(encoder, [PROMPT]), fresh)
    assert _warnings(caplog) == [] and not stale.exists() and young.exists()


def test_eviction_touches_only_entries(encoder, tmp_path):
    """The size bound counts and removes only the cache's own files, never others in the folder."""
    mine = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(100_000)}, str(mine))
    (tmp_path / "notes.txt").write_text("keep me")
    path = _stored(encoder, tmp_path)
    disk = kc.DiskPromptCache(tmp_path, max_bytes=path.stat().st_size + 100)  # room for one entry
    assert disk.size_bytes() == path.stat().st_size
    kc.PromptCache(disk=disk).encode(encoder, ["another"])
    time.sleep(0.02)
    kc.PromptCache(disk=disk).encode(encoder, ["and another"])
    assert mine.exists() and (tmp_path / "notes.txt").exists()
    assert len(_entries(tmp_path)) == 2 and disk.size_bytes() <= disk.max_bytes  # model.safetensors + one entry


def test_embeddings_with_nan_are_returned_but_never_cached(encoder, tmp_path, monkeypatch):
    real = type(encoder).encode

    def overflowing(self, ids, mask, **kwargs):
        out = real(self, ids, mask, **kwargs)
        out[0, 0, 0] = float("inf")
        return out

    monkeypatch.setattr(type(encoder), "encode", overflowing)
    cache = kc.PromptCache(disk=kc.DiskPromptCache(tmp_path))
    got = cache.encode(encoder, [PROMPT])
    assert not torch.isfinite(got).all()  # returned: the engine names the encoder for it
    assert len(cache) == 0 and _entries(tmp_path) == []


# ----- settings -------------------------------------------------------------------------------------

BAD_SIZES = [(0, ValueError), (-1, ValueError), (True, TypeError), (False, TypeError), (1.5, TypeError),
             (float("nan"), TypeError), (float("inf"), TypeError), ("1024", TypeError), (None, TypeError),
             (2.0, TypeError)]


@pytest.mark.parametrize(("value", "error"), BAD_SIZES, ids=repr)
def test_settings_are_checked(tmp_path, value, error):
    with pytest.raises(error, match=rf"max_bytes must be a whole number >= 1, got {value!r}"):
        kc.DiskPromptCache(tmp_path / "pc", max_bytes=value)
    for name in ("max_entries", "max_bytes"):
        with pytest.raises(error, match=rf"{name} must be a whole number >= 1, got {value!r}"):
            kc.PromptCache(**{name: value})
    assert not (tmp_path / "pc").exists()


def test_good_settings_are_taken(tmp_path):
    assert kc.DiskPromptCache(tmp_path, max_bytes=np.int64(1)).max_bytes == 1
    cache = kc.PromptCache(max_entries=1, max_bytes=np.int32(7))
    assert (cache.max_entries, cache.max_bytes) == (1, 7) and type(cache.max_bytes) is int


def test_a_folder_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder") as info:
        kc.DiskPromptCache(blocker)
    assert str(blocker) in info.value.strerror and blocker.read_text() == "x"


# ----- concurrency ------------------------------------------------------------------------------------

def test_threads_writing_and_reading_one_entry_never_see_half_a_file(tmp_path, caplog):
    """Two writers store two different valid embeddings under one key while two readers read it:
    every read is one of the two, whole; none is refused (a file replaced or touched while it is
    read is read again)."""
    disk = kc.DiskPromptCache(tmp_path)
    length, options, identity = 512, kc.TextOptions(), "enc|float32|None|cpu"
    values = [torch.full((1, length, 1024), float(i)) for i in (1, 2)]
    stop = threading.Event()
    seen: list[float] = []
    errors: list[BaseException] = []

    def write(v):
        try:
            while not stop.is_set():
                disk.put(identity, PROMPT, length, options, v)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    def read():
        try:
            while not stop.is_set():
                got = disk.get(identity, PROMPT, length, options, 1024)
                if got is not None:
                    assert got.shape == (1, length, 1024) and bool((got == got[0, 0, 0]).all())
                    seen.append(float(got[0, 0, 0]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(v,)) for v in values] + [threading.Thread(target=read)
                                                                              for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(seen) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == [] and _warnings(caplog) == []
    assert len(seen) >= 40 and set(seen) <= {1.0, 2.0}
    assert [p.name for p in tmp_path.iterdir()] == [_entries(tmp_path)[0].name]  # one entry, no temporary file
