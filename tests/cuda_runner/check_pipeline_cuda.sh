#!/usr/bin/env bash
# One device call: does the pipeline's GPU worker (`docpipe worker --queues gpu`, Celery + Redis) run with
# DOCPIPE_RUNNER=cuda and nothing else changed? tests/cuda_runner/check_pipeline_cuda.py does the work; this script puts
# its dependencies in place on the GPU machine, which has torch/numpy/pillow/tokenizers/jinja2/cuda-python/typer
# but not the rest of docpipe's runtime dependencies, and no redis-server:
#   .whl/*.whl           the missing dependencies (and nvmath-python), installed into /tmp/site
#   .whl/fallback/*.whl  installed only where the machine's own copy is older than we need (typing_extensions)
#   .redis/*.tar.xz      Debian 12's redis-server 7.0.15 with the non-glibc libraries it links
#     bash tests/cuda_runner/check_pipeline_cuda.sh        (carry [".whl", ".redis"]; $OUT collects summary.json + logs)
# Making them (both folders are git-ignored; ~61 MB together, under the 64 MiB carry limit; session 5's set):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#     --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==PIN...   (pins: constraints.txt)
#     for SQLAlchemy fastapi starlette opentelemetry-api redis celery kombu billiard vine amqp click-didyoumean
#     click-repl click-plugins prompt_toolkit wcwidth tzlocal alembic Mako uvicorn python-multipart pydantic
#     pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection jsonschema
#     jsonschema-specifications referencing rpds-py llguidance pymupdf pillow_heif filetype ImageHash PyWavelets,
#     and nvmath-python==1.0.0; typing_extensions into .whl/fallback
#   .redis: on Debian 12, redis-server (cp -L /usr/bin/redis-server) and lib/ holding what `ldd` lists for it
#     except libc and libm, as one redis-*.tar.xz with both at its top level
# Extra arguments go to the driver, e.g. `--runners cuda` to skip the reference runs.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
if [ -z "${NO_WHEELS:-}" ]; then  # NO_WHEELS=1: everything is installed already (a CPU check of this script)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || exit 1
fi
# Versions the machine brings itself, against pyproject.toml's minimums (and the pinned pydantic's typing_extensions
# need: pydantic 2.14.4 and pydantic-core 2.50.5 require >= 4.16.0).
versions=$(mktemp)
fallback=$(python3 - 2>"$versions" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

def tup(v):
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in v.split(".")[:3])

need = {"typing_extensions": "4.16.0", "pillow": "11.2.1", "numpy": "1.26", "tokenizers": "0.20", "jinja2": "3.1",
        "safetensors": "0.4", "typer": "0.12", "rich": "13.0", "click": "8.3.1", "attrs": "22.2.0",
        "python-dateutil": "2.8.2", "markupsafe": "2.0", "packaging": "20.0", "cuda-core": "1.0",
        "cuda-bindings": "12.6", "torch": "0"}
old = []
for name, minimum in need.items():
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "missing"
    ok = have != "missing" and tup(have) >= tup(minimum)
    print(f"machine's {name} {have} (need >= {minimum}){'' if ok else '  <-- missing or too old'}", file=sys.stderr)
    if not ok:
        old.append(name)
print(" ".join(old))
EOF
)
cat "$versions" >"$OUT/check.log"
if [[ " $fallback " == *" typing_extensions "* ]] && [ -z "${NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/fallback/typing_extensions-*.whl || exit 1
    echo "installed the carried typing_extensions (the machine's is too old for pydantic)" >>"$OUT/check.log"
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1; date -u +%FT%TZ; } \
    >>"$OUT/check.log"
cat "$OUT/check.log"
archive=$(ls .redis/redis-*.tar.xz 2>/dev/null | head -n 1)
# SIGTERM first: the driver stops its workers and keeps their logs; KILL 40 s later if that hangs.
timeout -k 40 "${CHECK_TIMEOUT:-500}" python3 -m tests.cuda_runner.check_pipeline_cuda --out "$OUT" \
    ${archive:+--redis-archive "$archive"} "$@" 2>&1 | tee -a "$OUT/check.log"
rc=${PIPESTATUS[0]}
{ date -u +%FT%TZ; echo "exit code: check_pipeline_cuda=$rc"; } | tee -a "$OUT/check.log"
exit "$rc"
