"""Summarise a mutmut 3 run (the `mutants/**/*.meta` verdicts) as a short JSON: counts per module and the names
of the mutants that survived, had no covering test, or were not reached before the time cap. Survivors listed in
`equivalent.txt` (next to this script: name, a tab, the reason) are counted and listed apart as "equivalent".

    python3 tests/mutation/summarise.py /tmp/docpipe-mutation > /tmp/docpipe-mutation/summary.json
    python3 tests/mutation/summarise.py /tmp/docpipe-mutation --previous tests/mutation/last_result.json
    python3 tests/mutation/summarise.py /tmp/docpipe-mutation --previous tests/mutation/last_result.json --markdown
    python3 tests/mutation/summarise.py --markdown-from tests/mutation/last_result.json

With `--previous`, a module this run did not check at all (a fresh verdict cache, a run of other modules only)
keeps its counts from the previous summary when its source is unchanged since that summary's commit; such a
module says `checked_at` (that commit). Survivors now listed in equivalent.txt move to "equivalent" there too.
"""
from __future__ import annotations

import json
import subprocess
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


REPO = Path(__file__).resolve().parents[2]


def _unchanged(module: str, since: str, until: str | None) -> bool:
    """Whether `module` is the same at `until` (this run's commit) as at `since` (git says; unknown -> False)."""
    if until is None:
        return False
    return subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", since, until, "--", module],
                          capture_output=True).returncode == 0


def carry_forward(current: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """`current` with each module it did not check at all taken from `previous` (same source, same mutant count)."""
    equivalent = equivalents()
    since = previous.get("commit") or ""
    for module, entry in current["modules"].items():
        old = previous.get("modules", {}).get(module)
        if (old is None or set(entry["counts"]) != {"not checked"} or not since
                or sum(old["counts"].values()) != entry["counts"]["not checked"]
                or not _unchanged(module, since, current.get("commit"))):
            continue
        counts: Counter[str] = Counter(old["counts"])
        survived = [n for n in old.get("survived", []) if n not in equivalent]
        now_equivalent = sorted(old.get("equivalent", []) + [n for n in old.get("survived", []) if n in equivalent])
        counts["equivalent"] += len(now_equivalent) - len(old.get("equivalent", []))
        counts["survived"] = len(survived)
        carried: dict[str, Any] = {**old, "counts": {k: n for k, n in sorted(counts.items()) if n},
                                   "survived": survived, "equivalent": now_equivalent}
        carried = {k: v for k, v in carried.items() if v != []}
        carried["checked_at"] = old.get("checked_at", since)
        current["modules"][module] = carried
    total: Counter[str] = Counter()
    for entry in current["modules"].values():
        total.update(entry["counts"])
    checked = sum(n for status, n in total.items() if status not in ("not checked", "equivalent"))
    killed = total["killed"] + total["timeout"] + total["caught by type check"]
    current["total"] = dict(sorted(total.items()))
    current["score_of_checked"] = round(killed / checked, 3) if checked else None
    return current


def markdown_table(summary: dict[str, Any]) -> str:
    """The table of tests/MUTATION.md's "Last result" (per module; `checked at` names a carried module's commit)."""
    head = ("| module | mutants | killed (+timeout) | survived: equivalent | survived: not classified | no covering "
            "test | not checked | checked at |")
    rows = [head, "|" + " --- |" * 8]

    def row(name: str, counts: dict[str, int], at: str) -> str:
        killed = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("caught by type check", 0)
        cells = [name, sum(counts.values()), killed, counts.get("equivalent", 0), counts.get("survived", 0),
                 counts.get("no tests", 0), counts.get("not checked", 0), at]
        return "| " + " | ".join(str(c) for c in cells) + " |"

    for module, entry in summary["modules"].items():  # a module checked by this summary's runs says "this pass"
        rows.append(row(module, entry["counts"], (entry.get("checked_at") or "")[:7] or "this pass"))
    rows.append(row("**all**", summary["total"], ""))
    return "\n".join(rows)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--markdown-from"]:  # the table of a committed summary, e.g. tests/mutation/last_result.json
        print(markdown_table(json.loads(Path(args[1]).read_text())))
        sys.exit(0)
    as_table = "--markdown" in args
    if as_table:
        args.remove("--markdown")
    previous_path = None
    if "--previous" in args:
        at = args.index("--previous")
        previous_path = Path(args[at + 1])
        del args[at : at + 2]
    summary = summarise(Path(args[0] if args else "/tmp/docpipe-mutation"))
    if previous_path is not None:
        summary = carry_forward(summary, json.loads(previous_path.read_text()))
    print(markdown_table(summary) if as_table else json.dumps(summary, indent=1))
