"""`docpipe worker --queues gpu --gpus 0,1,...`: one GPU worker process per GPU, kept running.

Each child is a plain `python -m workers worker --queues gpu --gpu N` (CUDA_VISIBLE_DEVICES=N, its own engine,
its own thread pool). A child that dies (a driver fault, an out-of-memory kill) is started again after a short
backoff; its jobs are recovered like any crashed worker's (the reconciler, the attempt cap). SIGTERM or SIGINT
stops every child (warm shutdown: running tasks finish) and then the supervisor. Under systemd or Kubernetes you
may instead run one `--gpu N` unit per GPU and let the service manager do this job.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

log = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0  # a child that ran this long is healthy again: its restart backoff starts over
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 60.0  # warm shutdown lets running tasks finish; past this, children are killed


class GpuListError(ValueError):
    """--gpus could not be understood or no GPU was found."""


def parse_gpus(text: str) -> list[str]:
    """"0,1,3" -> ["0", "1", "3"]; "all" -> every GPU `nvidia-smi -L` lists."""
    if text.strip() == "all":
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuListError(f"--gpus all needs nvidia-smi to list the GPUs ({exc}); give indices: "
                               "--gpus 0,1") from None
        gpus = [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]
    else:
        gpus = [part.strip() for part in text.split(",") if part.strip()]
        bad = [g for g in gpus if not g.isdigit()]
        if bad:
            raise GpuListError(f"--gpus takes GPU indices like 0,1,2 or 'all', got {text!r}")
    if not gpus or len(set(gpus)) != len(gpus):
        raise GpuListError(f"--gpus must name each GPU once, got {text!r}")
    return gpus


@dataclass
class _Child:
    gpu: str
    process: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)


class GpuSupervisor:
    def __init__(self, gpus: list[str], worker_args: list[str]) -> None:
        self.children = [_Child(g) for g in gpus]
        self.worker_args = worker_args
        self.stopping = False

    def command(self, gpu: str) -> list[str]:
        return [sys.executable, "-m", "workers", "worker", "--queues", "gpu", "--gpu", gpu, *self.worker_args]

    def _start(self, child: _Child) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=child.gpu)  # in the child's environment from its first instant
        child.process = subprocess.Popen(self.command(child.gpu), env=env)
        child.started = time.monotonic()
        log.info("GPU %s: worker pid %d started", child.gpu, child.process.pid)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True

    def run(self, poll_s: float = 0.5) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            self._start(child)
        while not self.stopping:
            time.sleep(poll_s)
            now = time.monotonic()
            for child in self.children:
                proc = child.process
                if proc is not None and proc.poll() is not None:
                    child.exits.append(proc.returncode)
                    child.failures = 1 if now - child.started >= STABLE_AFTER_S else child.failures + 1
                    delay = min(MAX_BACKOFF_S, 2.0 ** (child.failures - 1))
                    log.error("GPU %s: worker pid %d exited with %s; starting it again in %.0f s",
                              child.gpu, proc.pid, proc.returncode, delay)
                    child.process, child.next_start = None, now + delay
                if child.process is None and now >= child.next_start and not self.stopping:
                    self._start(child)
        return self._stop_all()

    def _stop_all(self) -> int:
        running = [c.process for c in self.children if c.process is not None and c.process.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop within %.0f s; killing it", proc.pid, STOP_GRACE_S)
                proc.kill()
                proc.wait()
        return 0
