"""BLAS thread cap of the entry points: a default from the CPU count, the user's own setting always wins."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from pipeline.threads import BLAS_ENV_VARS, cap_blas_threads, default_blas_threads

REPO = Path(__file__).resolve().parents[2]


def test_default_is_half_the_cpus_between_one_and_four() -> None:
    assert [default_blas_threads(n) for n in (1, 2, 3, 4, 8, 9, 64)] == [1, 1, 1, 2, 4, 4, 4]


def test_unset_variables_get_the_default_and_set_ones_are_kept() -> None:
    env: dict[str, str] = {}
    cap_blas_threads(env, cpus=8)
    assert {env[name] for name in BLAS_ENV_VARS} == {"4"}

    mine = str(random.randint(2, 64))
    env = {"OMP_NUM_THREADS": mine, "MKL_NUM_THREADS": "7"}
    cap_blas_threads(env, cpus=2)
    assert env["OMP_NUM_THREADS"] == mine and env["OPENBLAS_NUM_THREADS"] == mine  # the OpenMP value carries over
    assert env["MKL_NUM_THREADS"] == "7"  # a variable the user set is never overwritten


def _entry_point_env(code: str, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV_VARS}
    env.update(PYTHONPATH=str(REPO), **extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout.split()


def test_importing_the_api_caps_before_numpy_loads_and_respects_the_user() -> None:
    code = ("import os, sys, api; print('numpy' in sys.modules, os.environ['OPENBLAS_NUM_THREADS'], "
            "os.environ['OMP_NUM_THREADS'])")
    numpy_loaded, openblas, omp = _entry_point_env(code)
    assert numpy_loaded == "False" and openblas == omp == str(default_blas_threads())
    assert _entry_point_env(code, OMP_NUM_THREADS="3")[1:] == ["3", "3"]
