"""`docpipe serve` through the pipeline CLI's plugin loader, as a real process: binds loopback, serves, stops."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import httpx
import typer
from apitest_support import REPO, free_port

from pipeline.cli import load_plugins

ENTRY_POINT = metadata.EntryPoint(name="serve", value="api.cli:register", group="docpipe.commands")

# The CLI as installed would find the entry point in the package metadata; here it is handed over explicitly so
# the test also runs from a source checkout that was never pip-installed.
LAUNCH = (
    "import sys; from importlib import metadata; from pipeline import cli; "
    "cli.load_plugins(cli.app, [metadata.EntryPoint(name='serve', value='api.cli:register', "
    "group='docpipe.commands')]); cli.app(args=sys.argv[1:], prog_name='docpipe')"
)


def test_entry_point_registers_serve() -> None:
    target = typer.Typer()

    @target.callback()
    def main() -> None:
        """docpipe"""

    assert load_plugins(target, [ENTRY_POINT]) == ["serve"]
    assert [c.name for c in target.registered_commands] == ["serve"]


def test_serve_runs_on_loopback_with_keys(tmp_path: Path) -> None:
    key = "serve-key-" + uuid.uuid4().hex
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), DOCPIPE_DATA_DIR=str(tmp_path), DOCPIPE_API_KEYS=key,
               OMP_NUM_THREADS="1")
    env.pop("DOCPIPE_BROKER_URL", None)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--port", str(port), "--log-level", "warning"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(base + "/v1/schemas", timeout=10).status_code == 401
        assert httpx.get(base + "/v1/schemas", headers={"X-API-Key": key}, timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    text = out.decode()
    assert f"http://127.0.0.1:{port}/" in text and "auth: API keys" in text


def test_serve_refuses_several_processes_in_embedded_mode(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), DOCPIPE_DATA_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("DOCPIPE_BROKER_URL", None)
    done = subprocess.run([sys.executable, "-c", LAUNCH, "serve", "--port", str(free_port()), "--workers", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--workers needs a broker" in done.stderr, done.stderr
