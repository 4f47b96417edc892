"""Summarise a mutmut 3 run (the `mutants/**/*.meta` verdicts) as a short JSON: counts per module and the names
of the mutants that survived, had no covering test, or were not reached before the time cap.

    python3 tests/mutation/summarise.py /tmp/docpipe-mutation > /tmp/docpipe-mutation/summary.json
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# mutmut.stats.status_by_exit_code (3.8.1), copied so that this script needs no mutmut import (whose import
# reads the configuration of the current directory)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "interrupted", None: "not checked",
          33: "no tests", 34: "skipped", 35: "suspicious", 36: "timeout", 37: "caught by type check",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault"}
LISTED = ("survived", "no tests", "suspicious", "segfault")  # the verdicts a person has to look at


def summarise(work: Path) -> dict[str, Any]:
    modules: dict[str, Any] = {}
    total: Counter[str] = Counter()
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants"))[: -len(".meta")]
        verdicts = json.loads(meta.read_text())["exit_code_by_key"]
        counts = Counter(STATUS.get(code, "suspicious") for code in verdicts.values())
        total.update(counts)
        listed = {status: sorted(k for k, code in verdicts.items() if STATUS.get(code, "suspicious") == status)
                  for status in LISTED}
        modules[module] = {"counts": dict(sorted(counts.items())), **{k: v for k, v in listed.items() if v}}
    checked = sum(n for status, n in total.items() if status != "not checked")
    killed = total["killed"] + total["timeout"] + total["caught by type check"]
    return {
        "tool": "mutmut 3.8.1",
        "commit": (work / "COMMIT").read_text().strip() if (work / "COMMIT").is_file() else None,
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "total": dict(sorted(total.items())),
        "score_of_checked": round(killed / checked, 3) if checked else None,
        "modules": modules,
    }


if __name__ == "__main__":
    print(json.dumps(summarise(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/docpipe-mutation")), indent=1))
