"""What check_pipeline_cuda starts around the pipeline: a throw-away Redis, the `docpipe` command, and processes.

- `start_redis`: a redis-server on 127.0.0.1, a free port, no persistence, in a temp dir. The GPU machine has no
  redis-server, so it can come from a carried archive (`.redis/*.tar.xz`: the binary plus the non-glibc libraries
  it links, used through LD_LIBRARY_PATH).
- `install_docpipe_command`: the `docpipe` console script and the `docpipe.commands` entry points (which add
  `worker`, `submit`, `status`) for a checkout that was not pip-installed, the same as an editable install: a
  dist-info folder written from pyproject.toml plus a launcher, both in a folder put first on PYTHONPATH / PATH.
- `Service`: one long-running process in its own session with its output in a log file, stopped by its own id.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

# Libraries a Debian redis-server links that a newer glibc system already has in compatible versions. If the
# carried copies cannot load (they need GLIBC_2.36 at most), the system's are used instead.
_SYSTEM_FALLBACK_LIBS = ("libstdc++.so.6", "libgcc_s.so.1")


class ServiceError(RuntimeError):
    """A service could not be started or did not become ready; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_ping(port: int, timeout: float = 1.0) -> bool:
    """True when a Redis server answers PING on 127.0.0.1:port (raw protocol: no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def unpack_redis(archive: Path, into: Path) -> tuple[Path, Path]:
    """Extract a carried redis archive (redis-server + lib/); returns (binary, library folder)."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    binary, libs = into / "redis-server", into / "lib"
    if not binary.is_file():
        raise ServiceError(f"{archive} holds no redis-server at its top level")
    binary.chmod(0o755)
    return binary, libs


def redis_env(libs: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if libs is not None and libs.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libs)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return env


def runnable_redis(binary: Path, libs: Path | None) -> dict[str, str]:
    """The environment in which `binary --version` runs; drops carried C++ runtime libraries if they cannot load."""
    env = redis_env(libs)
    probe = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
    if probe.returncode == 0:
        return env
    if libs is not None:
        for name in _SYSTEM_FALLBACK_LIBS:
            (libs / name).unlink(missing_ok=True)
        env = redis_env(libs)
        retry = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
        if retry.returncode == 0:
            return env
    raise ServiceError(f"{binary} does not run here: {probe.stderr.strip() or probe.stdout.strip()}")


class Service:
    """A process in a new session, output to `log`; `stop` sends SIGTERM to it, then SIGKILL to its group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        if not self._fh.closed:
            self._fh.flush()
        return self.log.read_text(errors="replace")

    def wait_for(self, marker: str, timeout: float) -> float:
        """Seconds until `marker` appears in the log; ServiceError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.log_text():
                return time.monotonic() - self.started
            if not self.alive():
                raise ServiceError(f"{self.name} exited with code {self.proc.returncode} before {marker!r}:\n"
                                   + tail(self.log_text()))
            time.sleep(0.5)
        raise ServiceError(f"{self.name}: no {marker!r} within {timeout:.0f} s:\n" + tail(self.log_text()))

    def stop(self, grace: float = 30.0) -> int | None:
        """Warm shutdown first (Celery finishes its tasks on SIGTERM), then the whole group is killed."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: leftover pool children, nothing else
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        self._fh.close()
        return code


def start_redis(workdir: Path, *, binary: Path | None = None, archive: Path | None = None,
                timeout: float = 20.0) -> tuple[Service, int]:
    """A redis-server for this check only: 127.0.0.1, a free port, no RDB/AOF, its files under `workdir`."""
    libs: Path | None = None
    if archive is not None:
        binary, libs = unpack_redis(archive, workdir / "redis-bin")
    elif binary is None:
        found = shutil.which("redis-server")
        if found is None:
            raise ServiceError("no redis-server on PATH and no --redis-archive given")
        binary = Path(found)
    env = runnable_redis(binary, libs)
    port = free_port()
    data = workdir / "redis-data"
    data.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(data), "--daemonize", "no", "--protected-mode", "yes"]
    service = Service("redis-server", argv, env, workdir / "redis.log")
    deadline = time.monotonic() + timeout
    while not redis_ping(port):
        if not service.alive() or time.monotonic() > deadline:
            service.stop(grace=1)
            raise ServiceError("redis-server did not answer PING:\n" + tail(service.log_text()))
        time.sleep(0.1)
    return service, port


def install_docpipe_command(repo: Path, target: Path) -> tuple[Path, Path]:
    """Write `docpipe`'s dist-info (entry points from pyproject.toml) and launcher under `target`.

    Returns (folder for PYTHONPATH, folder for PATH). Like an editable install, the code itself is the checkout's
    (`repo` must be on PYTHONPATH too)."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    site, bin_dir = target / "site", target / "bin"
    dist = site / f"{name}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (dist / "entry_points.txt").write_text("\n".join(lines))
    for script, spec in project.get("scripts", {}).items():
        module, _, attr = spec.partition(":")
        launcher = bin_dir / script
        launcher.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {attr}\n"
                            f"sys.exit({attr}())\n")
        launcher.chmod(0o755)
    return site, bin_dir


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
