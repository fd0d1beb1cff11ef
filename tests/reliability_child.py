"""Run in a child process by test_robustness.py: a loaded model whose file changes under it.

    python reliability_child.py <component> <file> <scratch dir>

Loads ``component`` ("transformer", "text_encoder" or "vae") from ``file``, computes a fixed
output, then for each mutation of a fresh copy of the file (truncated, rewritten in place, replaced,
deleted) loads the copy, mutates it and computes the output again. Prints one JSON line per
mutation: ``{"mutation": ..., "same": true}`` when the live model still gives the first output
bit for bit. A crash (SIGBUS from a memory-mapped file) ends the process: the parent sees it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

import klein_core as kc
from klein_core.files.loaders import LOADERS
from klein_core.pipeline.sampling import position_ids, text_position_ids

MUTATIONS = ("truncate to half", "truncate to the header", "rewrite in place with zeros",
             "rewrite in place with random bytes", "replace by another file", "delete")


def output(component: str, model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        if component == "vae":
            return model.decode(torch.randn(1, 128, 4, 4))
        if component == "text_encoder":
            ids = torch.randint(0, 1000, (1, 16))
            return model.encode(ids, torch.ones_like(ids))
        c = model.config
        return model(img=torch.randn(1, 16, c.in_channels), img_ids=position_ids(4, 4),
                     txt=torch.randn(1, 8, c.context_dim), txt_ids=text_position_ids(8),
                     timesteps=torch.tensor([0.5]))


def mutate(path: Path, how: str, other: Path) -> None:
    size = path.stat().st_size
    if how == "truncate to half":
        os.truncate(path, size // 2)
    elif how == "truncate to the header":
        os.truncate(path, 8 + int.from_bytes(path.read_bytes()[:8], "little"))
    elif how.startswith("rewrite in place"):
        with open(path, "r+b") as fh:  # same inode: a memory map would see the new bytes
            fh.write(bytes(size) if "zeros" in how else os.urandom(size))
    elif how == "replace by another file":
        os.replace(other, path)
    else:
        path.unlink()


def main() -> int:
    component, source, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    load = LOADERS[component]
    for how in MUTATIONS:
        copy = scratch / f"{component}.safetensors"
        other = scratch / "other.safetensors"
        shutil.copy(source, copy)
        shutil.copy(source, other)
        model = load(copy)
        before = output(component, model)
        mutate(copy, how, other)
        after = output(component, model)  # the live model must not depend on the file any more
        print(json.dumps({"mutation": how, "same": bool(torch.equal(before, after))}), flush=True)
        try:  # and a new load of the changed file is refused with a clear error, or works
            load(copy)
        except (kc.WeightFormatError, FileNotFoundError):
            pass
        for p in (copy, other):
            p.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
