"""``python -m klein_core train`` under torchrun: each process finds its rank in torchrun's environment,
trains on half of every global batch (gloo on the CPU here), the processes build one latent cache
together, and one of them writes the LoRA: the LoRA of one process with the whole global batch."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
from contextlib import redirect_stderr

import pytest
import torch
import torch.multiprocessing as mp
from train_files import tiny_training_files

from klein_core.train.cli import add_train_args, run_train

WORLD = 2


def _args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


def _common(paths, data, cache) -> list[str]:
    return ["--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
            "--transformer", str(paths["klein_base_4b"]), "--steps", "3", "--resolution", "32", "--rank", "2",
            "--device", "cpu", "--preset", "full", "--lr", "1e-2", "--seed", "5", "--cache-dir", str(cache)]


def _worker(rank: int, port: int, argv: list[str], folder: str) -> None:
    """One torchrun process: its variables, then the CLI's entry point; its exit code and stderr saved."""
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    err = io.StringIO()
    with redirect_stderr(err):
        code = run_train(_args(*argv))
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"code": code, "stderr": err.getvalue()}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_torchrun_two_processes_write_the_one_process_lora(tmp_path):
    from safetensors.torch import load_file

    paths, data = tiny_training_files(tmp_path)
    ddp_out = tmp_path / "ddp" / "l.safetensors"
    argv = [*_common(paths, data, tmp_path / "shared-cache"), "--batch-size", "1", "--output", str(ddp_out)]
    mp.spawn(_worker, args=(_free_port(), argv, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert f"wrote {ddp_out}" in ranks[0]["stderr"] and "step 3/3" in ranks[0]["stderr"]
    assert "wrote" not in ranks[1]["stderr"] and "step" not in ranks[1]["stderr"]  # one voice
    assert not list((tmp_path / "shared-cache").glob(".*.tmp"))  # each process's temporary files gone

    one_out = tmp_path / "one" / "l.safetensors"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_train(_args(*_common(paths, data, tmp_path / "own-cache"), "--batch-size", "2",
                               "--output", str(one_out))) == 0
    finally:
        torch.set_num_threads(n)
    ddp, one = load_file(str(ddp_out)), load_file(str(one_out))
    assert ddp.keys() == one.keys() and any(one[k].abs().sum() > 0 for k in one if "lora_B" in k)
    # float32, 3 AdamW steps at lr 1e-2: the gradients' sums differ in order only, which Adam's
    # normalisation lifts to ~3e-5 where a gradient is near zero (1 of 128 elements measured). A
    # process training on the wrong half would be off by the steps themselves (~1e-2).
    for k in one:
        torch.testing.assert_close(ddp[k], one[k], rtol=1e-3, atol=1e-4)


def test_torchrun_device_choices(monkeypatch):
    """Under torchrun a GPU index is refused (each process takes cuda:LOCAL_RANK), as is a process
    without a GPU of its own; without torchrun nothing starts."""
    from klein_core.train import cli

    assert cli.torchrun_device("cuda:1") == ("cuda:1", False)  # one process: as given
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(cli.OptionError, match="under torchrun each of the 4 processes trains on its own GPU"):
        cli.torchrun_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(cli.OptionError, match="torchrun process 3 has no GPU of its own .this machine has 2."):
        cli.torchrun_device("cuda")
    with pytest.raises(cli.OptionError, match="runs on CUDA GPUs .NCCL. or the CPU .gloo."):
        cli.torchrun_device("mps")
