"""Regressions found by hunting the text side: the prompt caches (memory and disk).

- ``PromptCache.cached`` concatenated entries the encoder made (on its device) with entries read
  from disk (on the CPU): a device mismatch error on the second run of a prompt whose negative came
  from an earlier session's disk cache. The machine under test has no GPU, so the meta device stands
  in for it (an encoder whose outputs live there).
- ``DiskPromptCache`` eviction: an entry just written was removed at once when other entries were
  timed ahead of the clock, and an entry read within one tick of the kernel's coarse file clock
  after another was written lost its place in the LRU order half of the time.
- ``DiskPromptCache("~/...")`` (the docs' example) made a folder named ``~`` in the working folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

import klein_core as kc
from klein_core import checks
from klein_core.pipeline import prompts
from klein_core.pipeline.prompts import DiskPromptCache, PromptCache, TextOptions, loaded_encoder_identity

WIDTH = 24
OPTS = TextOptions()


class _EncoderOnMeta(nn.Module):
    """Stands for a Qwen3 encoder placed on a GPU: its weights and outputs are on another device
    than the CPU, where disk entries are read."""

    def __init__(self, source: Path) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(151936, 8, device="meta")
        self.config = type("Config", (), {"text_dim": WIDTH})()
        self.source = str(source)
        self.calls = 0

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(ids.shape[0], ids.shape[1], WIDTH, device="meta")


def test_cached_joins_an_entry_made_on_the_encoder_device_with_one_read_from_disk(tmp_path, monkeypatch):
    real_isfinite = torch.isfinite
    # A meta tensor has no values to check; the encoder's output counts as finite, as on a GPU.
    monkeypatch.setattr(torch, "isfinite", lambda t: torch.ones((), dtype=torch.bool) if t.is_meta else real_isfinite(t))
    real_is_finite = checks.is_finite  # the cache's checks (of a disk entry, of a new embedding): the same stand-in
    for module in (prompts, checks):
        monkeypatch.setattr(module, "is_finite", lambda t: True if t.is_meta else real_is_finite(t))
    source = tmp_path / "qwen_3_4b.safetensors"
    source.write_bytes(b"\0" * 64)
    encoder = _EncoderOnMeta(source)
    identity = loaded_encoder_identity(encoder)
    assert identity is not None and identity.endswith("|meta")

    disk = DiskPromptCache(tmp_path / "prompts")
    negative = torch.full((1, 512, WIDTH), 0.5)
    disk.put(identity, "", 512, OPTS, negative)  # stored by an earlier session

    cache = PromptCache()
    cache.encode(encoder, ["a red fox"])  # this session's prompt: kept in memory on the encoder's device
    cache.disk = disk  # (the nodes attach the disk cache to the prompt cache this way)
    assert cache.cached(identity, [""]).device.type == "cpu"  # read from disk, also kept in memory

    out = cache.cached(identity, ["a red fox", ""])  # raised "Tensor on device cpu is not on ... meta"
    assert out is not None and out.shape == (2, 512, WIDTH)
    assert out.device.type == "meta"  # where the encoder's own entries are
    assert encoder.calls == 1


def _entry_bytes(tmp_path: Path) -> int:
    probe = DiskPromptCache(tmp_path / "probe")
    probe.put("id", "probe", 16, OPTS, torch.ones(1, 16, 4))
    return probe.size_bytes()


def test_the_entry_just_written_is_kept_when_others_are_timed_ahead_of_the_clock(tmp_path):
    size = _entry_bytes(tmp_path)
    disk = DiskPromptCache(tmp_path / "pc", max_bytes=2 * size + size // 2)  # room for two entries
    for prompt in ("old 1", "old 2"):
        disk.put("id", prompt, 16, OPTS, torch.ones(1, 16, 4))
    ahead = time.time_ns() + 3600 * 10**9  # e.g. a folder copied from a machine whose clock ran an hour ahead
    for path in disk.folder.iterdir():
        os.utime(path, ns=(ahead, ahead))

    new = torch.full((1, 16, 4), 2.0)
    disk.put("id", "new", 16, OPTS, new)
    got = disk.get("id", "new", 16, OPTS, 4)
    assert got is not None and torch.equal(got, new)  # was removed as soon as written
    assert disk.size_bytes() <= disk.max_bytes
    assert sum(disk.get("id", p, 16, OPTS, 4) is not None for p in ("old 1", "old 2")) == 1
    assert disk.write_error is None


def test_a_read_entry_outlives_an_older_unread_one(tmp_path):
    # Written, read and written again within a few ms: the kernel's file clock gave the read entry and
    # the one written before it the same time about half of the time, and eviction then picked by name.
    size = _entry_bytes(tmp_path)
    for trial in range(20):
        disk = DiskPromptCache(tmp_path / f"pc{trial}", max_bytes=2 * size + size // 2)  # room for two
        disk.put("id", f"read {trial}", 16, OPTS, torch.ones(1, 16, 4))
        disk.put("id", f"unread {trial}", 16, OPTS, torch.ones(1, 16, 4))
        assert disk.get("id", f"read {trial}", 16, OPTS, 4) is not None  # now the most recently used
        disk.put("id", f"new {trial}", 16, OPTS, torch.ones(1, 16, 4))
        kept = {p for p in (f"read {trial}", f"unread {trial}", f"new {trial}")
                if disk._path("id", p, 16, OPTS).exists()}
        assert kept == {f"read {trial}", f"new {trial}"}, f"trial {trial}"


def test_a_folder_under_the_home_folder_is_expanded(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USERPROFILE", str(home))  # what expanduser reads on Windows
    monkeypatch.chdir(work)
    disk = kc.DiskPromptCache("~/.cache/klein-prompts")
    assert disk.folder == home / ".cache" / "klein-prompts" and disk.folder.is_dir()
    assert not (work / "~").exists()
    disk.put("id", "a cat", 16, OPTS, torch.ones(1, 16, 4))
    assert len(list((home / ".cache" / "klein-prompts").glob("*.safetensors"))) == 1
