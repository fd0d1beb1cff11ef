"""One Ray Serve replica's own behaviour, without a Ray cluster: readiness while the models load, a
load failure, a request the client abandons (its work stops within a step) and row LoRAs applied
and removed again. tests/test_ray_serve.py drives the deployment over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("starlette")  # Ray Serve's HTTP layer (the ray extra)

import klein_core as kc  # noqa: E402
from klein_core.distributed import runner as runner_module  # noqa: E402
from klein_core.distributed.models import ModelSpec  # noqa: E402
from klein_core.distributed.rows import parse_row  # noqa: E402
from klein_core.distributed.serve import KleinServer, ServeOptions  # noqa: E402
from klein_core.errors import GenerationCancelled  # noqa: E402


class _Replica(KleinServer):
    """KleinServer without ``@serve.batch``: one job at a time (what Serve adds is tested over HTTP)."""

    async def generate_batch(self, job):  # type: ignore[override]
        return (await asyncio.to_thread(self._run_jobs, [job]))[0]


# what ``__init__`` configures on Serve's batch wrapper; nothing to configure here
_Replica.generate_batch.set_max_batch_size = lambda n: None  # type: ignore[attr-defined]
_Replica.generate_batch.set_batch_wait_timeout_s = lambda s: None  # type: ignore[attr-defined]


class _Request:
    """What the replica reads of Starlette's Request: the path, the method, the headers and the body
    as a stream of chunks."""

    def __init__(self, path: str, method: str = "GET", body: dict | bytes | None = None) -> None:
        self.url = type("URL", (), {"path": path})()
        self.method = method
        self._body = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        self.headers = {"content-length": str(len(self._body))}

    async def body(self) -> bytes:
        return self._body

    async def stream(self):
        yield self._body


def _call(server: KleinServer, path: str, method: str = "GET", body: dict | None = None):
    return asyncio.run(server(_Request(path, method, body)))


def _wait(predicate, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_ready_answers_503_until_the_models_are_loaded(monkeypatch):
    release = threading.Event()
    real = runner_module.RowRunner

    class SlowRunner(real):
        def __init__(self, spec):
            release.wait(30)
            super().__init__(spec)

    monkeypatch.setattr(runner_module, "RowRunner", SlowRunner)
    server = _Replica(ModelSpec(demo=True), ServeOptions())
    ready = _call(server, "/ready")
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
    assert json.loads(ready.body)["status"] == "loading models"
    generate = _call(server, "/generate", "POST", {"prompt": "a kite", "width": 64, "height": 64})
    assert generate.status_code == 503 and "still loading" in json.loads(generate.body)["error"]
    assert _call(server, "/health").status_code == 200  # alive while loading
    release.set()
    _wait(lambda: server.runner is not None)
    assert _call(server, "/ready").status_code == 200


def test_a_load_failure_is_not_ready_and_fails_the_health_check(monkeypatch):
    def broken(spec):
        raise FileNotFoundError("flux-2-klein-4b.safetensors: no such file")

    monkeypatch.setattr(runner_module, "RowRunner", broken)
    server = _Replica(ModelSpec(demo=True), ServeOptions())
    _wait(lambda: server.load_error is not None)
    ready = _call(server, "/ready")
    assert ready.status_code == 503 and "no such file" in json.loads(ready.body)["status"]
    with pytest.raises(RuntimeError, match="no such file"):
        server.check_health()  # Serve restarts such a replica


@pytest.fixture(scope="module")
def replica():
    server = _Replica(ModelSpec(demo=True), ServeOptions())
    _wait(lambda: server.runner is not None or server.load_error is not None)
    assert server.load_error is None
    return server


def test_an_abandoned_request_stops_within_a_step(replica, monkeypatch):
    steps: list[int] = []
    outcomes: list[BaseException | object] = []
    real_run = replica.runner.run

    def counting_run(row, images, *, callback=None):
        def each(step, total, latents, **kw):
            steps.append(step)
            time.sleep(0.05)  # slow enough that the cancel lands mid-run
            return callback(step, total, latents)

        try:
            out = real_run(row, images, callback=each)
        except BaseException as exc:
            outcomes.append(exc)
            raise
        outcomes.append(out)
        return out

    monkeypatch.setattr(replica.runner, "run", counting_run)

    async def client_goes_away():
        task = asyncio.ensure_future(replica(_Request("/generate", "POST", {
            "prompt": "a long walk", "width": 64, "height": 64, "steps": 200, "seed": 1})))
        while not steps:
            assert not task.done(), f"the request ended before its first step: {task.result()}"
            await asyncio.sleep(0.01)
        task.cancel()  # what Serve does when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(client_goes_away())
    _wait(lambda: bool(outcomes))
    assert isinstance(outcomes[0], GenerationCancelled)
    assert len(steps) < 200
    ran = len(steps)
    time.sleep(0.3)
    assert len(steps) == ran  # nothing runs on after the cancel
    ok = _call(replica, "/generate", "POST", {"prompt": "a kite", "width": 64, "height": 64, "steps": 1})
    assert ok.status_code == 200  # and the replica keeps serving


def test_corrupt_model_weights_are_the_servers_fault_not_the_requests(replica, monkeypatch, caplog):
    """A request that meets corrupt weights (NonFiniteWeights, a ValueError) is answered 500 and
    logged for the operator; a bad request stays a 400."""
    def corrupt(row, images, *, callback=None):
        raise kc.NonFiniteWeights("The sampler produced NaN/Inf because its weights are corrupt: tensor "
                                  "'img_in.weight' of flux-2-klein-4b.safetensors contains NaN or infinite values.")

    bad = _call(replica, "/generate", "POST", {"prompt": "a kite", "width": 60, "height": 64, "steps": 1})
    assert bad.status_code == 400
    monkeypatch.setattr(replica.runner, "run", corrupt)
    with caplog.at_level("ERROR", logger="klein_core.distributed.serve"):
        answer = _call(replica, "/generate", "POST", {"prompt": "a kite", "width": 64, "height": 64, "steps": 1})
    assert answer.status_code == 500 and "img_in.weight" in json.loads(answer.body)["error"]
    assert "failed on the server's model files" in caplog.text


def test_a_row_lora_applies_to_its_row_only(replica, tmp_path):
    tr = replica.runner.engine.transformer
    qkv = tr.double_blocks[0].img_attn.qkv.weight
    rank = 2
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(rank, qkv.shape[1], generator=g),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], rank, generator=g)},
              tmp_path / "style.safetensors")
    spec = ModelSpec(demo=True, lora_dir=tmp_path)
    runner = runner_module.RowRunner(spec, engine=replica.runner.engine)
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    base = dict(id="r", prompt="a lighthouse", seed=3, width=64, height=64, steps=2)
    plain = np.asarray(runner.run(parse_row(base), []).result.images[0])
    styled = np.asarray(runner.run(parse_row({**base, "loras": "style:1.0"}), []).result.images[0])
    again = np.asarray(runner.run(parse_row(base), []).result.images[0])
    assert not np.array_equal(plain, styled)  # the LoRA took effect on its row
    assert np.array_equal(plain, again)  # and was removed: the next row is as before
    assert all(torch.equal(before[k], v) for k, v in tr.state_dict().items())


@pytest.mark.parametrize("options, words", [
    ({"max_ongoing": 2, "max_batch": 4}, "max_ongoing (--max-ongoing) must be at least max_batch (4)"),
    ({"max_batch": 0}, "max_batch (--max-batch) must be an integer >= 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas (--min-replicas) must be an integer from 0 to"),
    ({"max_queued": -5}, "max_queued (--max-queued)"),
    ({"batch_wait_s": float("nan")}, "batch_wait_s (--batch-wait) must be a finite number >= 0"),
    ({"target_ongoing": 0.0}, "target_ongoing (--target-ongoing) must be a finite number > 0"),
    ({"gpus": -1.0}, "gpus (--gpus-per-worker)"),
])
def test_serve_options_are_checked_when_made(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ServeOptions(**options)
    ServeOptions(min_replicas=0, max_queued=-1, batch_wait_s=0.0, gpus=0.5)  # the edges Ray accepts


def test_the_serve_command_refuses_bad_options_before_ray_starts(monkeypatch, capsys):
    from klein_core import cli
    from klein_core.distributed import ray_support

    def no_ray(*a, **k):
        raise AssertionError("Ray was started before the options were checked")

    monkeypatch.setattr(ray_support, "init_ray", no_ray)
    rc = cli.main(["serve", "--demo", "--max-ongoing", "2", "--max-batch", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "max_ongoing (--max-ongoing) must be at least max_batch (4)" in err, err
