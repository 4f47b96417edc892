"""Summarise a mutmut 3 run (the `mutants/**/*.meta` verdicts) as a short JSON: counts per module and the names
of the mutants that survived, had no covering test, or were not reached before the time cap. Survivors listed in
`equivalent.txt` (next to this script: name, a tab, the reason) are counted and listed apart as "equivalent".

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
LISTED = ("survived", "equivalent", "no tests", "suspicious", "segfault")  # the verdicts a person looks at


EQUIVALENT = Path(__file__).with_name("equivalent.txt")


def equivalents(path: Path = EQUIVALENT) -> dict[str, str]:
    """Mutant name -> why no test can tell it from the original (tests/MUTATION.md explains each group)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition("\t")
            out[name.strip()] = reason.strip()
    return out


def _status(key: str, code: int | None, equivalent: dict[str, str]) -> str:
    status = STATUS.get(code, "suspicious")
    return "equivalent" if status == "survived" and key in equivalent else status


def summarise(work: Path) -> dict[str, Any]:
    modules: dict[str, Any] = {}
    total: Counter[str] = Counter()
    equivalent = equivalents()
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants"))[: -len(".meta")]
        verdicts = json.loads(meta.read_text())["exit_code_by_key"]
        counts = Counter(_status(k, code, equivalent) for k, code in verdicts.items())
        total.update(counts)
        listed = {status: sorted(k for k, code in verdicts.items() if _status(k, code, equivalent) == status)
                  for status in LISTED}
        modules[module] = {"counts": dict(sorted(counts.items())), **{k: v for k, v in listed.items() if v}}
    checked = sum(n for status, n in total.items() if status not in ("not checked", "equivalent"))
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
