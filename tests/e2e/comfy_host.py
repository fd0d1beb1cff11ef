"""Drive a real, headless ComfyUI 0.3.75 server (prepared by ``setup_host.py``) for end-to-end tests.

    with ComfyServer(models_dir=...) as srv:
        assert "KSampler" in srv.object_info()
        res = srv.run_prompt(graph, timeout=60)
        png = srv.view(**res.images[0])

The server runs ``main.py --cpu`` in its own process group, with every writable folder (base, input,
output, temp, user, database in memory) in a fresh temp dir, the pack loaded as the only custom node
pack (a symlink ``klein_nodes`` -> the repository root, found through an ``extra_model_paths.yaml``
``custom_nodes`` entry, and ``--disable-all-custom-nodes --whitelist-custom-nodes klein_nodes``), and
the model folders (``diffusion_models``, ``text_encoders``, ``vae``, ``loras``) pointing at the caller's
models dir. HTTP uses urllib; the websocket uses aiohttp (a ComfyUI dependency).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from setup_host import HOST_DIR, REPO_ROOT, host_paths, host_problem  # noqa: E402

PACK_NAME = "klein_nodes"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")

_LIVE: set[ComfyServer] = set()


@atexit.register
def _stop_leftovers() -> None:  # a crashed test session must not leave servers behind
    for srv in list(_LIVE):
        srv.stop()


class ServerError(RuntimeError):
    """The server did not start, died, or answered something unexpected."""


class PromptRejected(ServerError):
    """POST /prompt answered non-200 (validation failed); ``status`` and ``body`` hold the answer."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"POST /prompt -> {status}: {json.dumps(body)[:2000]}")
        self.status = status
        self.body = body


@dataclass
class PromptResult:
    prompt_id: str
    number: int | None
    messages: list[tuple[str, Any]]  # every JSON websocket message received while following the prompt
    binary_frames: int  # previews and other binary frames
    history: dict  # /history/{prompt_id}[prompt_id] ({} if absent)
    seconds: float
    post_response: dict = field(default_factory=dict)
    node_texts: list[tuple[str, str]] = field(default_factory=list)  # (node id, text): progress-text frames

    def of_type(self, kind: str) -> list[Any]:
        """Data of this prompt's messages of one type (messages without a prompt_id are kept)."""
        mine = self.prompt_id
        return [d for t, d in self.messages
                if t == kind and (not isinstance(d, dict) or d.get("prompt_id", mine) == mine)]

    @property
    def types(self) -> list[str]:
        return [t for t, _ in self.messages]

    @property
    def status_str(self) -> str | None:
        return self.history.get("status", {}).get("status_str")

    @property
    def ok(self) -> bool:
        return self.status_str == "success" and not self.of_type("execution_error")

    @property
    def error(self) -> dict | None:
        errs = self.of_type("execution_error")
        return errs[0] if errs else None

    @property
    def interrupted(self) -> bool:
        return bool(self.of_type("execution_interrupted"))

    @property
    def outputs(self) -> dict:
        return self.history.get("outputs", {})

    @property
    def images(self) -> list[dict]:
        """``{"filename", "subfolder", "type"}`` of every image in the history outputs."""
        return [img for out in self.outputs.values() for img in out.get("images", [])]

    @property
    def progress(self) -> list[dict]:
        return self.of_type("progress")

    def describe(self) -> str:
        err = self.error
        if err:
            return (f"prompt {self.prompt_id}: execution_error in node {err.get('node_id')} "
                    f"({err.get('node_type')}): {err.get('exception_type')}: {err.get('exception_message')}\n"
                    + "".join(err.get("traceback") or []))
        return f"prompt {self.prompt_id}: status {self.status_str}, messages {self.types}"


def _progress_text(frame: bytes) -> tuple[str, str] | None:
    """(node id, text) of a binary websocket frame of type 3 (``send_progress_text``), else None:
    event type (4 bytes, big-endian), node id length (4 bytes), node id, UTF-8 text."""
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != 3:
        return None
    n = struct.unpack(">I", frame[4:8])[0]
    return frame[8:8 + n].decode(), frame[8 + n:].decode()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """A ComfyUI server process with the pack installed. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        models_dir: str | os.PathLike | None = None,
        *,
        host_dir: str | os.PathLike = HOST_DIR,
        pack_dir: str | os.PathLike = REPO_ROOT,
        pack_name: str = PACK_NAME,
        work_dir: str | os.PathLike | None = None,
        keep_work_dir: bool = False,
        port: int | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        start_timeout: float = 90.0,
        torchvision_stub: bool | None = None,
    ):
        self.paths = host_paths(Path(host_dir))
        self.pack_dir = Path(pack_dir).resolve()
        self.pack_name = pack_name
        self.python = python
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self._port_fixed = port
        self.port: int | None = None
        self._own_work_dir = work_dir is None
        self.keep_work_dir = keep_work_dir
        self.work_dir = Path(work_dir) if work_dir else None
        self.models_dir = Path(models_dir).resolve() if models_dir else None
        # The stub hides a real torchvision, so use it only where none is installed (the stub itself
        # may be importable here: the unit tests put it on sys.path).
        if torchvision_stub is None:
            spec = importlib.util.find_spec("torchvision")
            stub_dir = self.paths["stub"].resolve()
            torchvision_stub = spec is None or stub_dir in Path(spec.origin or "").resolve().parents
        self.torchvision_stub = torchvision_stub
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._log_file = None

    # ----- lifecycle ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "server.log"

    @property
    def output_dir(self) -> Path:
        return self.work_dir / "output"

    @property
    def input_dir(self) -> Path:
        return self.work_dir / "input"

    def _prepare_dirs(self) -> None:
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="comfy_e2e_"))
        w = self.work_dir
        for sub in ("base/custom_nodes", "base/models", "user", "input", "output", "temp", "pack_nodes"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        if self.models_dir is None:
            self.models_dir = w / "models"
        for sub in MODEL_FOLDERS:
            (self.models_dir / sub).mkdir(parents=True, exist_ok=True)
        link = w / "pack_nodes" / self.pack_name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(self.pack_dir, target_is_directory=True)
        # JSON is YAML; ComfyUI's loader joins base_path with each per-folder entry.
        config = {
            "klein_e2e_models": {"base_path": str(self.models_dir), **{k: k for k in MODEL_FOLDERS}},
            "klein_e2e_nodes": {"custom_nodes": str(w / "pack_nodes")},
        }
        (w / "extra_model_paths.yaml").write_text(json.dumps(config, indent=2) + "\n")

    def command(self) -> list[str]:
        w = self.work_dir
        return [
            self.python, "main.py", "--cpu",
            "--listen", "127.0.0.1", "--port", str(self.port),
            "--front-end-root", str(self.paths["frontend"]),
            "--disable-auto-launch",
            "--base-directory", str(w / "base"),
            "--output-directory", str(w / "output"),
            "--input-directory", str(w / "input"),
            "--temp-directory", str(w / "temp"),
            "--user-directory", str(w / "user"),
            "--database-url", "sqlite:///:memory:",
            "--extra-model-paths-config", str(w / "extra_model_paths.yaml"),
            "--disable-all-custom-nodes", "--whitelist-custom-nodes", self.pack_name,
            *self.extra_args,
        ]

    def start(self) -> ComfyServer:
        if self.proc is not None:
            return self
        problem = host_problem(self.paths["host"])
        if problem:
            raise ServerError(f"ComfyUI host not ready ({problem}); "
                              f"run: {sys.executable} tests/e2e/setup_host.py")
        self._prepare_dirs()
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.torchvision_stub:
            env["PYTHONPATH"] = os.pathsep.join([str(self.paths["stub"]),
                                                 *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        last_error = None
        for attempt in range(3):  # retry only if the chosen port was taken in between
            self.port = self._port_fixed or free_port()
            self._log_file = open(self.log_path, "ab")
            self._log_file.write(f"$ {' '.join(self.command())}\n".encode())
            self._log_file.flush()
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(
                self.command(), cwd=self.paths["comfyui"], env=env, stdin=subprocess.DEVNULL,
                stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )
            _LIVE.add(self)
            try:
                self._wait_ready(t0)
                self.start_seconds = time.perf_counter() - t0
                return self
            except ServerError as e:
                last_error = e
                port_taken = "address already in use" in self.log_text().lower()
                self._kill()
                if not port_taken or self._port_fixed:
                    break
        self.stop()
        raise last_error

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with code {self.proc.returncode} during start-up\n"
                                  + self.log_tail())
            try:
                status, _ = self.request("GET", "/system_stats", timeout=2)
                if status == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.perf_counter() > deadline:
                raise ServerError(f"ComfyUI not ready after {self.start_timeout:.0f}s\n" + self.log_tail())
            time.sleep(0.2)

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 10 s; removes its own temp dir."""
        self._kill()
        _LIVE.discard(self)
        if self._own_work_dir and not self.keep_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, TypeError):
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log_text()
        return f"----- server log ({self.log_path}) tail -----\n" + text[-chars:]

    # ----- HTTP --------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, bytes]:
        """(status, body bytes); HTTP error statuses are returned, not raised."""
        data = None
        headers = {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str, timeout: float = 30) -> Any:
        status, raw = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {path} -> {status}: {raw[:500]!r}")
        return json.loads(raw)

    def post_json(self, path: str, body: Any, timeout: float = 30) -> tuple[int, Any]:
        status, raw = self.request("POST", path, body, timeout=timeout)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def system_stats(self) -> dict:
        return self.get_json("/system_stats")

    def object_info(self, node_class: str | None = None) -> dict:
        if node_class is None:
            return self.get_json("/object_info", timeout=60)
        return self.get_json("/object_info/" + urllib.parse.quote(node_class))

    def models(self, folder: str) -> list[str]:
        return self.get_json("/models/" + urllib.parse.quote(folder))

    def queue(self) -> dict:
        return self.get_json("/queue")

    def history(self, prompt_id: str) -> dict:
        return self.get_json("/history/" + urllib.parse.quote(prompt_id)).get(prompt_id, {})

    def post_prompt(self, graph: dict, client_id: str | None = None, extra_data: dict | None = None,
                    prompt_id: str | None = None) -> tuple[int, Any]:
        body: dict[str, Any] = {"prompt": graph, "client_id": client_id or uuid.uuid4().hex}
        if extra_data:
            body["extra_data"] = extra_data
        if prompt_id:
            body["prompt_id"] = prompt_id
        return self.post_json("/prompt", body)

    def view(self, filename: str, subfolder: str = "", type: str = "output") -> bytes:
        q = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        status, raw = self.request("GET", "/view?" + q)
        if status != 200:
            raise ServerError(f"GET /view?{q} -> {status}: {raw[:300]!r}")
        return raw

    def interrupt(self, prompt_id: str | None = None) -> int:
        return self.post_json("/interrupt", {"prompt_id": prompt_id} if prompt_id else {})[0]

    def free(self, unload_models: bool = True, free_memory: bool = True) -> int:
        return self.post_json("/free", {"unload_models": unload_models, "free_memory": free_memory})[0]

    # ----- websocket-followed prompts ----------------------------------------------------------------

    def run_prompt(
        self,
        graph: dict,
        timeout: float = 120,
        *,
        on_message: Callable[[str, Any], None] | None = None,
        extra_data: dict | None = None,
    ) -> PromptResult:
        """Open /ws, POST the prompt, collect messages until ``executing`` with ``node: null`` for it,
        then read /history. Raises PromptRejected on a non-200 POST, TimeoutError past ``timeout``.
        ``on_message(type, data)`` is called for each JSON message (e.g. to interrupt mid-run)."""
        return asyncio.run(self._run_prompt(graph, timeout, on_message, extra_data))

    async def _run_prompt(self, graph, timeout, on_message, extra_data) -> PromptResult:
        import aiohttp

        client_id = uuid.uuid4().hex
        body: dict[str, Any] = {"prompt": graph, "client_id": client_id}
        if extra_data:
            body["extra_data"] = extra_data
        messages: list[tuple[str, Any]] = []
        node_texts: list[tuple[str, str]] = []
        binary = 0
        t0 = time.perf_counter()
        deadline = t0 + timeout
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async with session.ws_connect(f"ws://127.0.0.1:{self.port}/ws?clientId={client_id}",
                                          max_msg_size=0, autoping=True) as ws:
                async with session.post(self.base_url + "/prompt", json=body) as r:
                    status = r.status
                    text = await r.text()
                try:
                    answer = json.loads(text)
                except ValueError:
                    answer = text
                if status != 200:
                    raise PromptRejected(status, answer)
                prompt_id = answer["prompt_id"]
                while True:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise TimeoutError(f"prompt {prompt_id} not finished after {timeout}s; messages so "
                                           f"far: {[t for t, _ in messages]}\n{self.log_tail(3000)}")
                    try:
                        msg = await ws.receive(timeout=remaining)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        m = json.loads(msg.data)
                        kind, data = m.get("type"), m.get("data")
                        messages.append((kind, data))
                        if on_message is not None:
                            await loop.run_in_executor(None, on_message, kind, data)
                        if (kind == "executing" and isinstance(data, dict) and data.get("node") is None
                                and data.get("prompt_id") == prompt_id):
                            break
                    elif msg.type == aiohttp.WSMsgType.BINARY:
                        binary += 1
                        text = _progress_text(msg.data)
                        if text is not None:
                            node_texts.append(text)
                    elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                      aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        raise ServerError(f"websocket closed while following prompt {prompt_id} "
                                          f"({msg.type}); server alive: {self.alive}\n{self.log_tail(3000)}")
        seconds = time.perf_counter() - t0
        return PromptResult(prompt_id=prompt_id, number=answer.get("number"), messages=messages,
                            binary_frames=binary, history=self.history(prompt_id), seconds=seconds, node_texts=node_texts,
                            post_response=answer)


# ----- small graph helpers (core nodes only) -------------------------------------------------------------

def empty_image_graph(width: int = 64, height: int = 64, color: int = 0, prefix: str = "e2e") -> dict:
    """EmptyImage -> SaveImage. Vary ``color`` to defeat ComfyUI's output cache between runs."""
    return {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": width, "height": height, "batch_size": 1, "color": color}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }


def traceback_blocks(text: str) -> list[list[str]]:
    """Each logged traceback, from its header to its exception line (the first unindented line)."""
    blocks, cur = [], None
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            cur = [line]
            blocks.append(cur)
        elif cur is not None:
            cur.append(line)
            if line and not line.startswith((" ", "\t")) and not line.startswith("During handling"):
                cur = None
    return blocks
