"""Serving on Ray Serve (klein_core.distributed.serve): CPU, tiny models, a local 2-CPU Ray cluster,
HTTP on a free local port. Batching, 4xx, 503 backpressure, health and readiness."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from klein_core.distributed.models import ModelSpec
from klein_core.distributed.serve import ServeOptions, deployment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ModelSpec(demo=True)
    serve.run(deployment(spec, ServeOptions(max_ongoing=16, max_batch=8, batch_wait_s=0.5, cpus=0.5), "main"),
              name="main", route_prefix="/", blocking=False)
    serve.run(deployment(spec, ServeOptions(max_ongoing=1, max_queued=1, max_batch=1, cpus=0.5), "bp"),
              name="bp", route_prefix="/bp", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    for path in ("/ready", "/bp/ready"):
        while True:
            try:
                if requests.get(base + path, timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, f"{path} never became ready"
            time.sleep(0.2)
    yield base
    serve.shutdown()
    ray.shutdown()


def _pixels(payload: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["image_base64"]))))


def _body(i: int, **kw) -> dict:
    return {"prompt": f"a lighthouse {i}", "seed": 100 + i, "width": 64, "height": 64, "steps": 2, **kw}


def test_concurrent_requests_are_batched_and_equal_single_ones(url):
    with ThreadPoolExecutor(8) as pool:
        batched = list(pool.map(lambda i: requests.post(url + "/generate", json=_body(i), timeout=120), range(8)))
    assert [r.status_code for r in batched] == [200] * 8
    sizes = [r.json()["batch_size"] for r in batched]
    assert max(sizes) > 1  # several requests went through one @serve.batch call
    assert {r.json()["seed"] for r in batched} == set(range(100, 108))
    for i, r in enumerate(batched):
        single = requests.post(url + "/generate", json=_body(i), timeout=120).json()
        assert single["batch_size"] == 1
        assert np.array_equal(_pixels(r.json()), _pixels(single)), i
    timings = batched[0].json()["timings"]
    assert {"text", "denoise", "decode", "queue", "total"} <= set(timings)


def test_png_response_health_and_readiness(url):
    r = requests.post(url + "/generate", json=_body(1, response="png", id="one"), timeout=120)
    assert (r.status_code, r.headers["content-type"], r.headers["x-klein-seed"], r.headers["x-klein-id"]) == (
        200, "image/png", "101", "one")
    img = Image.open(io.BytesIO(r.content))
    assert img.size == (64, 64) and json.loads(img.text["parameters"])["seed"] == 101
    assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert requests.get(url + "/ready", timeout=10).json()["status"] == "ready"


@pytest.mark.parametrize("body, message", [
    (b"{nope", "request body is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (json.dumps({"prompt": "x", "width": 32, "height": 64}).encode(),
     "Output size 32x64 is too small: both sides must be at least 64 px."),
    (json.dumps({"prompt": "x", "steps": 0}).encode(), "request: steps must be from 1 to 10000, got 0"),
    (json.dumps({"prompt": "x", "references": ["%%%"]}).encode(),
     "references[1]: not valid base64 (send the image file's bytes base64-encoded)"),
    (json.dumps({"prompt": "x", "references": [base64.b64encode(b"not an image").decode()]}).encode(),
     "references[1]: not an image file (or a format PIL cannot read)"),
    (json.dumps({"prompt": "x", "response": "gif"}).encode(), "response must be one of ('json', 'png'), got 'gif'"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(url, body, message):
    r = requests.post(url + "/generate", data=body, timeout=60)
    assert (r.status_code, r.json()["error"]) == (400, message)
    assert requests.post(url + "/generate", json=_body(0), timeout=120).status_code == 200


def test_backpressure_gives_503_with_retry_after(url):
    body = _body(0, width=256, height=256, steps=6)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: requests.post(url + "/bp/generate", json=body, timeout=120), range(8)))
    codes = sorted(r.status_code for r in answers)
    assert 200 in codes and 503 in codes and set(codes) == {200, 503}, codes
    assert {r.headers.get("retry-after") for r in answers if r.status_code == 503} == {"5"}
    assert requests.post(url + "/bp/generate", json=_body(1), timeout=120).status_code == 200
