"""Data-parallel training encodes its dataset once, not once per process: with ``shard=(rank, world)``
each process encodes items ``rank, rank + world, ...`` into the shared caches and reads the rest
from them (two gloo processes on the CPU here). A process that fails while encoding its share is
named by the others instead of leaving them waiting."""

from __future__ import annotations

import json
import socket
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from klein_core.train.data import Encoders, build_samples, scan_dataset

WORLD = 2


def _dataset(root, n=5):
    data = root / "data"
    data.mkdir()
    for i in range(n):
        Image.new("RGB", (32, 32), (i * 40, 20, 30)).save(data / f"im{i}.png")
        (data / f"im{i}.txt").write_text(f"caption {i}\n")
    return data


def _encoders(calls, fail_on=None):
    def image(px):
        calls.append(["image", round(float(px.mean()), 6)])
        return px[:, :1, ::16, ::16].repeat(1, 4, 1, 1)

    def text(caption):
        if caption == fail_on:
            raise RuntimeError(f"cannot encode {caption!r}")
        calls.append(["text", caption])
        return torch.full((1, 3, 6), float(len(caption)) + int(caption.split()[-1]))
    return Encoders(image, text, "vae-A", "te-A")


def _gather(message):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _worker(rank, port, root, fail_on, separate=False):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    calls: list = []
    result: dict = {"calls": calls}
    try:
        cache = f"{root}/cache{rank}" if separate else f"{root}/cache"  # separate: machines that share no disk
        samples = build_samples(scan_dataset(f"{root}/data"), _encoders(calls, fail_on), cache, area=32 * 32,
                                shard=(rank, WORLD), gather=_gather)
        result["samples"] = [[s.latents.tolist(), s.text.tolist()] for s in samples]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _spawn(root, fail_on=None, separate=False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(root), fail_on, separate), nprocs=WORLD, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_each_process_encodes_its_share_and_reads_the_rest(tmp_path):
    data = _dataset(tmp_path)
    ranks = _spawn(tmp_path)
    assert all("error" not in r for r in ranks), ranks
    texts = [sorted(c[1] for c in r["calls"] if c[0] == "text") for r in ranks]
    assert texts == [["caption 0", "caption 2", "caption 4"], ["caption 1", "caption 3"]]
    assert [sum(c[0] == "image" for c in r["calls"]) for r in ranks] == [3, 2]
    # both processes hold every sample, as one process encoding everything itself would
    calls: list = []
    alone = build_samples(scan_dataset(data), _encoders(calls), tmp_path / "own-cache", area=32 * 32)
    assert len(calls) == 10
    want = [[s.latents.tolist(), s.text.tolist()] for s in alone]
    assert ranks[0]["samples"] == want and ranks[1]["samples"] == want


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_processes_that_share_no_cache_encode_the_rest_themselves(tmp_path):
    data = _dataset(tmp_path)
    ranks = _spawn(tmp_path, separate=True)
    assert all("error" not in r for r in ranks), ranks
    assert [sum(c[0] == "text" for c in r["calls"]) for r in ranks] == [5, 5]  # its share first, then the rest
    assert [c[1] for c in ranks[1]["calls"] if c[0] == "text"][:2] == ["caption 1", "caption 3"]
    want = [[s.latents.tolist(), s.text.tolist()] for s in
            build_samples(scan_dataset(data), _encoders([]), tmp_path / "own-cache", area=32 * 32)]
    assert ranks[0]["samples"] == want and ranks[1]["samples"] == want


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_a_process_that_fails_its_share_is_named_by_the_others(tmp_path):
    _dataset(tmp_path)
    ranks = _spawn(tmp_path, fail_on="caption 3")  # item 3: process 1's share
    assert ranks[1]["error"] == "RuntimeError: cannot encode 'caption 3'"
    assert ranks[0]["error"] == ("DatasetError: process 1 of 2 failed while encoding its share of the dataset: "
                                 "RuntimeError: cannot encode 'caption 3'")


def test_a_shard_needs_a_valid_rank_and_a_gather(tmp_path):
    scan = scan_dataset(_dataset(tmp_path))
    with pytest.raises(ValueError, match=r"shard \(2, 2\): a shard needs a rank below the world size, and gather"):
        build_samples(scan, _encoders([]), tmp_path / "c", area=32 * 32, shard=(2, 2), gather=lambda m: [m, m])
    with pytest.raises(ValueError, match="and gather"):
        build_samples(scan, _encoders([]), tmp_path / "c", area=32 * 32, shard=(0, 2))
