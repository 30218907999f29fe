"""Fixtures: the real replayd binary, started from a config in a temporary
directory (as tests/common/mod.rs does for the Rust tests), on the CPU backend
with a small bucket grid so that start-up is quick on a 2-core box."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
MINILM_DIR = REPO / "models" / "all-MiniLM-L6-v2"
MINILM = "all-MiniLM-L6-v2"
MLP = "mlp"
DIM = 384


def replayd_bin() -> Path:
    env = os.environ.get("REPLAYD_BIN")
    if env:
        p = Path(env)
        if not p.exists():
            pytest.exit(f"REPLAYD_BIN={env} does not exist", returncode=2)
        return p
    for p in (REPO / "target" / "debug" / "replayd", REPO / "target" / "release" / "replayd"):
        if p.exists():
            return p
    pytest.exit(
        "no replayd binary: build it (cargo build) or set REPLAYD_BIN=/path/to/replayd",
        returncode=2,
    )


def _die_with_parent() -> None:  # runs in the child, before exec
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minilm_toml() -> str:
    if not (MINILM_DIR / "model.safetensors").exists():
        pytest.exit(f"{MINILM_DIR} is missing: run scripts/dev/fetch-model.sh", returncode=2)
    return f"""
[[models]]
name = "{MINILM}"
kind = "bert"
path = "{MINILM_DIR}"
batch_buckets = [1, 8, 32]
seq_buckets = [16, 32, 128, 256]
batching = "padded"
"""


def mlp_toml() -> str:
    return f"""
[[models]]
name = "{MLP}"
kind = "mlp"
path = "{DATA / 'mlp_seed.safetensors'}"
activation = "relu"
batch_buckets = [1, 8, 32]
"""


class Daemon:
    """A replayd process. ``port=None`` lets it choose (port 0); a fixed port
    survives restarts, so connected clients find it again."""

    def __init__(
        self,
        tmp: Path,
        models: str,
        *,
        port: Optional[int] = None,
        batching: str = "",
        server: str = "",
        name: str = "replayd",
    ) -> None:
        self.dir = tmp
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = port
        self.ready_file = self.dir / "ready.json"
        self.log_path = self.dir / "replayd.log"
        endpoint = f"tcp://127.0.0.1:{port if port is not None else 0}"
        self.config_path = self.dir / "replayd.toml"
        self.config_path.write_text(
            f"""[server]
endpoint = "{endpoint}"
control_endpoint = "tcp://127.0.0.1:0"
runtime_dir = "{self.dir / 'run'}"
{server}

[batching]
{batching}

[devices]
backend = "cpu"
restart_backoff_ms = 50

[eager]
workers = 1
{models}
"""
        )
        self.proc: Optional[subprocess.Popen] = None
        self.endpoint: Optional[str] = None
        self.starts = 0

    def start(self, timeout: float = 120.0) -> "Daemon":
        # Daemons get SIGKILL when the thread that started them ends (so that a
        # crashed test run leaves none behind): start them from the main thread.
        assert threading.current_thread() is threading.main_thread(), "start daemons on the main thread"
        assert self.proc is None or self.proc.poll() is not None, "already running"
        if self.ready_file.exists():
            self.ready_file.unlink()
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [str(replayd_bin()), "--config", str(self.config_path), "--ready-file", str(self.ready_file)],
            cwd=str(REPO),
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "REPLAYD_LOG": "info"},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        end = time.monotonic() + timeout
        while True:
            if self.ready_file.exists():
                try:
                    info = json.loads(self.ready_file.read_text())
                except ValueError:  # being written
                    info = None
                if info:
                    self.endpoint = info["endpoint"]
                    self.control = info["control_endpoint"]
                    return self
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} exited ({code}) before ready:\n{self.log()[-4000:]}")
            if time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"{self.name} not ready in {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> "Daemon":
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            return self
        return self.start()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread of it has stopped."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        end = time.monotonic() + 10
        task = Path(f"/proc/{self.proc.pid}/task")
        while time.monotonic() < end:
            try:
                states = [
                    (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in task.iterdir()
                ]
            except OSError:
                states = []
            if states and all(s in ("T", "t") for s in states):
                return
            time.sleep(0.001)
        raise RuntimeError(f"{self.name} did not stop")

    def thaw(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (its workers die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    """One daemon with both models for every test that does not kill it."""
    d = Daemon(tmp_path_factory.mktemp("shared"), minilm_toml() + mlp_toml(), name="shared")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def endpoint(shared_daemon) -> str:
    return shared_daemon.endpoint


# ------------------------------------------------------------- reference data


def _jsonl(name: str) -> List[dict]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def minilm_set():
    rows = _jsonl("minilm_set_a.jsonl")
    texts = [r["text"] for r in rows]
    ids = [r["ids"] for r in rows]
    emb = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    return texts, ids, emb


@pytest.fixture(scope="session")
def mlp_io():
    return [
        (np.asarray(r["input"], dtype=np.float32), np.asarray(r["output"], dtype=np.float64))
        for r in _jsonl("mlp_seed_io.jsonl")
    ]


def load_safetensors(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", v
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[base + a : base + b], dtype="<f4").reshape(v["shape"])
    return out


@pytest.fixture(scope="session")
def mlp_reference():
    """The seed MLP in float64: x -> Linear(128,256) -> ReLU -> Linear(256,10)."""
    w = {k: v.astype(np.float64) for k, v in load_safetensors(DATA / "mlp_seed.safetensors").items()}

    def forward(x):
        h = np.maximum(np.asarray(x, np.float64) @ w["0.weight"].T + w["0.bias"], 0.0)
        return h @ w["2.weight"].T + w["2.bias"]

    return forward


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (as tests/common/mod.rs)."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))
