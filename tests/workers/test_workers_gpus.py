"""`worker --queues gpu --gpus 0,1`: one worker process per GPU (CUDA_VISIBLE_DEVICES set per child), a child that
dies is started again, SIGTERM stops them all. The reference runner stands in for the GPUs here."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from workers_harness import FLAG_SCHEMA, png


def _children(pid: int) -> dict[int, str]:
    """{child pid: its CUDA_VISIBLE_DEVICES} of a process (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry.name)] = env.get("CUDA_VISIBLE_DEVICES", "")
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads child processes from /proc (Linux)")
def test_one_supervised_worker_per_gpu_restarted_when_it_dies(redis_url, make_cluster):
    cluster = make_cluster(redis_url, DOCPIPE_ENGINE_MAX_NUM_SEQS="2")
    cluster.register_schema("flag", FLAG_SCHEMA)
    supervisor = cluster.start_worker("gpu", "--gpus", "0,1")
    pid = supervisor.popen.pid
    cluster.wait_for("two GPU workers", lambda: sorted(_children(pid).values()) == ["0", "1"], timeout=30)

    jobs = [cluster.ingest(png(size=20), f"g{i}.png", "flag") for i in range(8)]
    cluster.wait_for("8 jobs succeeded", lambda: cluster.job_states() == {"succeeded": 8}, timeout=90)
    assert all(sorted(cluster.result_units()[j]) == ["document", "page:0"] for j in jobs)

    [(victim, _)] = [(p, gpu) for p, gpu in _children(pid).items() if gpu == "1"]
    os.kill(victim, signal.SIGKILL)
    cluster.wait_for("GPU 1's worker started again",
                     lambda: sorted(_children(pid).values()) == ["0", "1"] and victim not in _children(pid),
                     timeout=30)

    supervisor.popen.send_signal(signal.SIGTERM)
    assert supervisor.popen.wait(timeout=60) == 0, supervisor.tail()
    time.sleep(0.2)
    assert _children(pid) == {}
    assert "exited with -9; starting it again" in supervisor.log.read_text(errors="replace")
