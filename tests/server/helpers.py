"""Helpers for the server tests: ``pyfast serve`` subprocesses on free loopback ports (always shut
down), uvicorn in a thread for in-process engines, Prometheus parsing."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_threads() -> int:
    """Compute threads for test servers: one by default, which leaves the other core of a 2-core
    machine to the HTTP side and the test's clients (and keeps a shared machine's noise from
    stalling a multi-threaded decode); PYFAST_SERVER_THREADS overrides."""
    return int(os.environ.get("PYFAST_SERVER_THREADS", "1"))


class ServerProcess:
    """``python -m pyfast serve ...`` on a free port; use as a context manager."""

    def __init__(self, *args: str, startup_timeout: float = 120.0):
        if "-t" not in args and "--threads" not in args:
            args = (*args, "--threads", str(server_threads()))
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyfast", "serve", "--host", HOST, "--port", str(self.port),
             "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._out: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._out.append(line)

    @property
    def output(self) -> str:
        return "".join(self._out)

    def _wait_ready(self, timeout: float) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server did not start in {timeout}s:\n{self.output}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class ThreadServer:
    """uvicorn serving an in-process app on a free port, in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cfg = uvicorn.Config(app, host=HOST, port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t_end = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text (sums the series matching ``name`` exactly,
    labels included when given)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, val = line.rpartition(" ")
        if key == name or ("{" not in name and key.split("{")[0] == name):
            total += float(val)
            found = True
    if not found:
        raise KeyError(name)
    return total


@contextlib.contextmanager
def no_leaks(url: str, timeout: float = 10.0):
    """After the block, every slot must become idle again within ``timeout``."""
    yield
    t_end = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=5).json()
        if h["slots_processing"] == 0 and h["queue_depth"] == 0:
            return
        if time.monotonic() > t_end:
            raise AssertionError(f"slots still busy: {h}")
        time.sleep(0.05)
