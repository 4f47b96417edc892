#!/usr/bin/env bash
# The mutation pass of issue #22 (tests/MUTATION.md): mutmut over the modules that hold the README's promises, on
# a private copy of the committed tree (HEAD), so that mutants never appear in the work tree.
#   bash tests/mutation/run.sh                  # everything not yet decided (results are cached in the copy)
#   bash tests/mutation/run.sh 'pipeline.jobs*'  # (re)run the named mutants, e.g. survivors after new tests
# Environment: MUTATION_DIR (default /tmp/docpipe-mutation), MUTATION_TIMEOUT_S (default 5400),
# MUTATION_CHILDREN (parallel mutants, default 2). Needs `pip install -e ".[test,mutation]"`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=${MUTATION_DIR:-/tmp/docpipe-mutation}
case "$(realpath -m "$work")/" in
  "$repo"/*) echo "MUTATION_DIR must be outside the work tree ($repo)" >&2; exit 2 ;;
esac
mkdir -p "$work"
# The committed tree (HEAD), not the working tree: the verdicts belong to one commit, and other people's
# unfinished edits cannot break the clean run. mutants/ (mutmut's generated code and cached verdicts) is kept.
find "$work" -mindepth 1 -maxdepth 1 ! -name mutants -exec rm -rf {} +
git -C "$repo" archive --format=tar HEAD | tar -x -C "$work"
git -C "$repo" rev-parse HEAD > "$work/COMMIT"
cp "$repo/tests/mutation/setup.cfg" "$work/setup.cfg"
# The fast direct tests first in every mutant's run (tests/mutation/fast_first.py; also_copy puts it in mutants/).
cp "$repo/tests/mutation/fast_first.py" "$work/conftest.py"
# mutmut copies a source file into mutants/ only when it is not there yet: drop the copies of the files it does not
# mutate, so they come fresh from this commit (the mutated modules and their verdicts stay).
if [ -d "$work/mutants" ]; then
  mutated=$(sed -n '/^only_mutate =/,/^[a-z]/p' "$work/setup.cfg" | grep '^    ' | sed 's/^ *//')
  for package in pipeline api workers vision gpu_engine; do
    [ -d "$work/mutants/$package" ] || continue
    find "$work/mutants/$package" -type f ! -name '*.meta' | while read -r file; do
      rel=${file#"$work/mutants/"}
      grep -qxF "$rel" <<<"$mutated" || rm -f "$file"
    done
  done
fi
cd "$work"
# One BLAS thread per mutant process: two mutants run at once on a 2-core machine.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
status=0
timeout --signal=INT "${MUTATION_TIMEOUT_S:-5400}" mutmut run --max-children "${MUTATION_CHILDREN:-2}" "$@" \
  > "$work/mutmut-run.log" 2>&1 || status=$?
python3 "$repo/tests/mutation/summarise.py" "$work" > "$work/summary.json"
echo "mutmut exit status $status; summary in $work/summary.json (copy it to tests/mutation/last_result.json)"
