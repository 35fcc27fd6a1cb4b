"""requirements.lock is what a fresh machine installs: every installed package at its pinned version, and
every requirement of pyproject.toml (dev extras included) satisfied by a pin (``make lock`` refreshes it)."""

from __future__ import annotations

import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in version, f"not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = version
    return pins


def test_every_installed_package_is_the_locked_version():
    pins = _pins()
    # the environment's own site-packages only: Ray puts its vendored packages (colorama, ...) on sys.path
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    installed.pop("eagle-platform")
    unlocked = sorted(set(installed) - set(pins))
    assert not unlocked, f"installed but not in requirements.lock (run `make lock`): {unlocked}"
    drift = {name: (version, pins[name]) for name, version in installed.items() if version != pins[name]}
    assert not drift, f"installed != locked (installed, locked): {drift}"


def test_every_project_requirement_is_satisfied_by_the_lock():
    pins = _pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not locked (run `make lock`)"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), f"lock pins {name}=={pins[name]}, pyproject wants {requirement}"
        for extra in requirement.extras:  # e.g. ray[serve,train]: the extra's own requirements are locked too
            for sub in metadata.requires(requirement.name) or []:
                sub_requirement = Requirement(sub)
                if sub_requirement.marker is not None and sub_requirement.marker.evaluate({"extra": extra}):
                    assert canonicalize_name(sub_requirement.name) in pins, f"{requirement.name}[{extra}] needs {sub_requirement.name}, not locked"
