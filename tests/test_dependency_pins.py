"""The installed packages are the ones constraints.txt pins, so a drifting resolver shows up here as one failure
naming the package, not as a mystery deep in a plugin (as when pytest 9.2 broke schemathesis' plugin)."""
from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("test",)  # what the README's test command installs


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints.txt: {raw!r} is not an exact pin (name==version)"
        found[canonical(name)] = Version(version)
    return found


def release(version: Version) -> Version:
    """Without the local label: torch's CPU wheel is 2.13.0+cpu, and `torch==2.13.0` takes it."""
    return Version(version.public)


def reachable(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution installing `root[extras]` pulls in here (markers evaluated on this interpreter),
    mapped to the name of the package that asked for it first."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...], str]] = [(root, extras, "")]
    done: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, wanted, parent = todo.pop()
        if (canonical(name), wanted) in done:
            continue
        done.add((canonical(name), wanted))
        if name != root:
            seen.setdefault(canonical(name), parent)
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, tuple(sorted(req.extras)), name))
    return seen


@pytest.fixture(scope="module")
def installed_docpipe() -> None:
    try:
        metadata.version("docpipe")
    except metadata.PackageNotFoundError:
        message = "docpipe is not installed as a package (run the README's install command)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)


def test_every_installed_dependency_is_at_its_pin(installed_docpipe: None) -> None:
    pinned = pins()
    wrong, unpinned = [], []
    for name, wanted_by in sorted(reachable("docpipe", EXTRAS).items()):
        have = Version(metadata.version(name))
        if name not in pinned:
            unpinned.append(f"{name} {have} (needed by {wanted_by})")
        elif release(have) != pinned[name]:
            wrong.append(f"{name}: installed {have}, pinned {pinned[name]}")
    assert not wrong, ("installed versions differ from constraints.txt; install with the README's command "
                       "(`pip install -c constraints.txt ...`): " + "; ".join(wrong))
    assert not unpinned, "dependencies without a pin in constraints.txt: " + "; ".join(unpinned)


def test_the_pins_satisfy_pyproject_ranges() -> None:
    """A pin outside pyproject's own range would make pip refuse the README's command."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in EXTRAS:
        declared += project["optional-dependencies"][extra]
    pinned = pins()
    missing, outside = [], []
    for text in declared:
        req = Requirement(text)
        name = canonical(req.name)
        if name not in pinned:
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                missing.append(name)
        elif not req.specifier.contains(pinned[name], prereleases=True):
            outside.append(f"{name}=={pinned[name]} is outside {req.specifier}")
    assert not missing, f"direct dependencies without a pin: {missing}"
    assert not outside, "; ".join(outside)


def test_every_direct_dependency_has_an_upper_bound() -> None:
    """Installing without the constraints (`pip install docpipe`) must not pick up a new major release either."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        declared += group
    open_ended = [text for text in declared
                  if not any(spec.operator in ("<", "<=", "==", "~=") for spec in Requirement(text).specifier)]
    assert not open_ended, f"no upper bound: {open_ended}"
