"""The HTTP endpoint on Ray Serve: :class:`KleinServer` replicas, each loading the models once.

``POST /generate`` takes a JSON object with the fields of a batch row (``references`` as base64
images; no URLs are fetched) and ``"response": "json"`` (default: the PNG base64-encoded, with the
seed and timings) or ``"png"`` (the PNG bytes; seed and timings in ``X-Klein-*`` headers).
``GET /health``: 200 while the replica runs. ``GET /ready``: 503 until the models are loaded.
A bad request gets 400 with the CLI's message; a full queue gets 503 with ``Retry-After``.
Requests arriving together are grouped by ``@serve.batch``; each runs its own forward in the
batch (see :mod:`.runner`), so a batched answer equals an unbatched one.
"""

from __future__ import annotations

import asyncio
import base64
import decimal
import json
import logging
import math
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ..errors import GenerationCancelled, KleinOutOfMemory, WeightFormatError
from .manifest import png_bytes
from .models import ModelSpec
from .ray_support import require_ray
from .rows import RowError, RowSpec, check_row, exact_numbers, open_reference, parse_row
from .runner import MAX_CACHED_LORAS

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
RETRY_AFTER_S = 5
MAX_REQUEST_LORAS = MAX_CACHED_LORAS  # as many as a replica keeps loaded
RESPONSES = ("json", "png")


@dataclass(frozen=True)
class ServeOptions:
    """Replicas, backpressure and batching. ``max_ongoing`` must be at least ``max_batch`` for
    batches to fill; ``max_queued`` requests wait per proxy, more get 503 + ``Retry-After``."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing: float = 2.0
    max_ongoing: int = 8
    max_queued: int = 32
    max_batch: int = 4
    batch_wait_s: float = 0.05
    cpus: float = 1.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        # Checked here, before Ray starts: Ray took some of these only at deployment, others never
        # (max_ongoing < max_batch: batches could never fill, each waited batch_wait_s for nothing).
        def bad(name: str, rule: str) -> ValueError:
            flag = {"batch_wait_s": "--batch-wait", "cpus": "--cpus-per-worker",
                    "gpus": "--gpus-per-worker"}.get(name, "--" + name.replace("_", "-"))
            return ValueError(f"{name} ({flag}) must be {rule}, got {getattr(self, name)!r}")

        for name in ("max_replicas", "max_ongoing", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an integer >= 1")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or \
                not 0 <= self.min_replicas <= self.max_replicas:
            raise bad("min_replicas", f"an integer from 0 to max_replicas ({self.max_replicas})")
        if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < -1:
            raise bad("max_queued", "an integer >= 0 (-1: no limit)")
        if self.max_ongoing < self.max_batch:
            raise bad("max_ongoing", f"at least max_batch ({self.max_batch}), so that batches can fill")
        for name, low, strict in (("target_ongoing", 0.0, True), ("batch_wait_s", 0.0, False),
                                  ("cpus", 0.0, False), ("gpus", 0.0, False)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
                (value > low if strict else value >= low)
            if not ok:
                raise bad(name, f"a finite number {'>' if strict else '>='} {low:g}")


@dataclass
class Job:
    """One admitted request: its row, its opened references, and a flag the client's cancel sets."""

    row: RowSpec
    images: list[Image.Image]
    response: str
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


def parse_request(body: bytes, *, kind: str, max_tokens: int | None, lora_dir) -> Job:
    """A request body -> :class:`Job`; raises :class:`RowError` with the message for a 400."""
    if len(body) > MAX_BODY_BYTES:
        raise RowError(f"request body is {len(body)} bytes; at most {MAX_BODY_BYTES}")
    try:
        # Fractions and exponents as Decimal: a seed 9007199254740993.0 is read exactly (or refused), not
        # rounded by a binary float to another seed.
        obj = json.loads(body, parse_float=decimal.Decimal)
    except ValueError as exc:
        raise RowError(f"request body is not JSON ({exc})") from None
    except RecursionError:  # json's decoder recurses per level: "[[[[..." would otherwise be a 500
        raise RowError("request body is JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise RowError(f"request body must be a JSON object, got {type(obj).__name__}")
    obj = exact_numbers(obj)
    response = obj.pop("response", "json")
    if response not in RESPONSES:
        raise RowError(f"response must be one of {RESPONSES}, got {response!r}")
    where = f"request (id {obj['id']!r})" if obj.get("id") is not None else "request"
    if obj.get("id") is None:  # absent or null, as every other field's null: the default
        obj["id"] = f"req-{uuid.uuid4().hex[:12]}"
    row = parse_row(obj, where=where)
    if len(row.loras) > MAX_REQUEST_LORAS:  # each is read and applied per request: a long list is a cheap DoS
        raise RowError(f"{where}: {len(row.loras)} LoRAs; at most {MAX_REQUEST_LORAS}")
    images = [open_reference(r, i, base64_data=True) for i, r in enumerate(row.references, 1)]
    row = RowSpec(**{**row.__dict__, "references": tuple(f"<base64 {i}>" for i in range(1, len(images) + 1))})
    check_row(row, images, kind=kind, max_tokens=max_tokens, lora_dir=lora_dir)
    return Job(row, images, response)


async def _read_body(request) -> bytes:
    """The request's body, read up to :data:`MAX_BODY_BYTES`: a larger one (declared, or sent) is
    refused before it is held in memory. Raises :class:`RowError` for the 413."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RowError(f"request body is {int(declared)} bytes; at most {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RowError(f"request body is over {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES}")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(status: int, payload: dict, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(payload, status_code=status, headers=headers)


class KleinServer:
    """A Serve replica: loads the models in the background (``/ready`` says when), then answers
    ``/generate`` through :meth:`generate_batch`."""

    def __init__(self, spec: ModelSpec, options: ServeOptions) -> None:
        from .runner import worker_name

        self.spec = spec
        self.runner = None
        self.load_error: str | None = None
        self.worker = worker_name()
        # One generation at a time on the replica's one engine: @serve.batch runs the sub-batches of
        # different multiplexed model ids (a header any client may send) concurrently, and a LoRA
        # merged for one request would otherwise be in another's weights.
        self._run_lock = threading.Lock()
        # This process is the replica's: PIL's bomb warning goes, refuse_bomb answers such a reference
        # with a 400 (set here, before any request thread runs: warnings filters are process-wide).
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        self.generate_batch.set_max_batch_size(options.max_batch)
        self.generate_batch.set_batch_wait_timeout_s(options.batch_wait_s)
        threading.Thread(target=self._load, name="klein-load", daemon=True).start()

    def _load(self) -> None:
        from .runner import RowRunner

        try:
            self.runner = RowRunner(self.spec)
        except Exception as exc:
            logger.exception("loading the models failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def check_health(self) -> None:
        """Serve's health check: a replica whose models failed to load is restarted."""
        if self.load_error is not None:
            raise RuntimeError(self.load_error)

    async def __call__(self, request) -> Any:
        route = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if request.method == "GET" and route == "health":
            return _json(200, {"status": "ok", "worker": self.worker})
        if route in ("health", "ready") and request.method != "GET":
            return _json(405, {"error": f"GET /{route}, not {request.method}"}, {"Allow": "GET"})
        if request.method == "GET" and route == "ready":
            if self.runner is not None:
                return _json(200, {"status": "ready", "worker": self.worker})
            status = "failed: " + self.load_error if self.load_error else "loading models"
            return _json(503, {"status": status}, {"Retry-After": str(RETRY_AFTER_S)})
        if route != "generate":
            return _json(404, {"error": f"no route {request.url.path!r}; POST /generate, GET /health, GET /ready"})
        if request.method != "POST":
            return _json(405, {"error": "POST a JSON request to /generate"}, {"Allow": "POST"})
        if self.runner is None:
            return _json(503, {"error": "the models are still loading"}, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            body = await _read_body(request)
        except RowError as exc:
            return _json(413, {"error": str(exc)})
        try:
            # In a thread: decoding references (up to 64 MiB of base64) would stall the event loop,
            # and with it /health and every other request of this replica.
            job = await asyncio.to_thread(parse_request, body, kind=self.spec.kind,
                                          max_tokens=self.spec.max_tokens, lora_dir=self.spec.lora_dir)
        except RowError as exc:
            return _json(400, {"error": str(exc)})
        try:
            outcome = await self.generate_batch(job)
        except asyncio.CancelledError:
            job.cancelled.set()  # the running forward stops at its next step
            raise
        return self._respond(job, outcome)

    def _respond(self, job: Job, outcome: dict) -> Any:
        from starlette.responses import Response

        if "error" in outcome:
            return _json(outcome["status"], {"error": outcome["error"], "id": job.row.id})
        meta = {k: v for k, v in outcome.items() if k != "png"}
        if job.response == "png":
            headers = {"X-Klein-Seed": str(meta["seed"]), "X-Klein-Timings": json.dumps(meta["timings"]),
                       "X-Klein-Batch-Size": str(meta["batch_size"]), "X-Klein-Id": job.row.id}
            return Response(outcome["png"], media_type="image/png", headers=headers)
        return _json(200, {**meta, "image_base64": base64.b64encode(outcome["png"]).decode("ascii")})

    async def generate_batch(self, jobs: list[Job]) -> list[dict]:
        """``@serve.batch``: the jobs that arrived together, run one after another in a thread (each
        its own forward), grouped by shape; one outcome dict per job, in order."""
        return await asyncio.to_thread(self._run_jobs, jobs)

    def _run_jobs(self, jobs: list[Job]) -> list[dict]:
        with self._run_lock:
            return self._run_jobs_locked(jobs)

    def _run_jobs_locked(self, jobs: list[Job]) -> list[dict]:
        batch_id = uuid.uuid4().hex[:8]
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].row.shape_key())
        outcomes: list[dict] = [{}] * len(jobs)
        for i in order:
            outcomes[i] = self._run_one(jobs[i], batch_id, len(jobs))
        return outcomes

    def _run_one(self, job: Job, batch_id: str, batch_size: int) -> dict:
        if job.cancelled.is_set():
            return {"error": "cancelled by the client", "status": 499}
        started = time.perf_counter()
        try:
            out = self.runner.run(job.row, job.images, callback=lambda *_: not job.cancelled.is_set())
        except GenerationCancelled:
            return {"error": "cancelled by the client", "status": 499}
        except KleinOutOfMemory as exc:
            return {"error": str(exc), "status": 503}
        except WeightFormatError as exc:  # a ValueError, but the server's file is at fault (corrupt weights)
            logger.exception("request %s failed on the server's model files", job.row.id)
            return {"error": str(exc), "status": 500}
        except (ValueError, TypeError) as exc:
            return {"error": str(exc), "status": 400}
        except Exception as exc:
            logger.exception("request %s failed", job.row.id)
            return {"error": f"{type(exc).__name__}: {exc}", "status": 500}
        r = out.result
        timings = {**{k: round(v, 4) for k, v in r.timings.items()},
                   "queue": round(started - job.arrived, 4), "total": round(time.perf_counter() - job.arrived, 4)}
        return {"id": job.row.id, "seed": job.row.seed, "width": r.width, "height": r.height, "steps": r.steps,
                "guidance": r.guidance, "timings": timings, "batch_size": batch_size, "batch_id": batch_id,
                "worker": self.worker, "png": png_bytes(r.images[0], out.params)}


def deployment(spec: ModelSpec, options: ServeOptions, name: str = "klein"):
    """The bound Serve application for ``spec``: autoscaling between ``min_replicas`` and
    ``max_replicas``, ``max_ongoing_requests`` / ``max_queued_requests`` and, where this Ray has it,
    a ``Retry-After`` on 503."""
    serve = require_ray("serve")
    cls = type("KleinServer", (KleinServer,), {
        "generate_batch": serve.batch(max_batch_size=options.max_batch,
                                      batch_wait_timeout_s=options.batch_wait_s)(KleinServer.generate_batch)})
    kwargs: dict = {"name": name, "max_ongoing_requests": options.max_ongoing,
                    "max_queued_requests": options.max_queued,
                    "ray_actor_options": {"num_cpus": options.cpus, "num_gpus": options.gpus}}
    if options.min_replicas == options.max_replicas:
        kwargs["num_replicas"] = options.min_replicas
    else:
        kwargs["autoscaling_config"] = {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                                        "target_ongoing_requests": options.target_ongoing}
    try:
        from ray.serve.config import BackpressureConfig

        kwargs["backpressure_config"] = BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S)
    except ImportError:  # older Ray: 503 without Retry-After
        logger.warning("this Ray has no BackpressureConfig: 503 answers carry no Retry-After")
    return serve.deployment(cls, **kwargs).bind(spec, options)


def start(spec: ModelSpec, options: ServeOptions, *, host: str = "127.0.0.1", port: int = 8000,
          name: str = "klein", route_prefix: str = "/") -> None:
    """Start Serve's HTTP proxy on ``host:port`` (if not running) and deploy the app under ``route_prefix``;
    returns once the replicas run (their models may still be loading: see ``/ready``)."""
    serve = require_ray("serve")
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(spec, options, name), name=name, route_prefix=route_prefix, blocking=False)
