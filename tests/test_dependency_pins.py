"""The Hydra and omegaconf pins admit the next minor release and refuse its pre-releases.

pip lets a package's pre-releases in as soon as any specifier for it names one, and
hydra-joblib-launcher asks for `hydra-core>=1.1.0.dev7`. So the pins must refuse Hydra 1.4's
pre-releases by name, while still admitting 1.4.0 itself when it is released (the project runs on it:
`.ci/run` tests the fast subset against 1.4.0rc3).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
# hydra-core's 1.4 pre-releases on the package registry this project installs from.
HYDRA_1_4_PRERELEASES = ("1.4.0.dev1", "1.4.0.dev3", "1.4.0.dev4", "1.4.0.dev5", "1.4.0.dev6", "1.4.0.dev8",
                         "1.4.0.dev9", "1.4.0.dev10", "1.4.0rc1", "1.4.0rc2", "1.4.0rc3")
JOBLIB_LAUNCHER_HYDRA_SPEC = SpecifierSet(">=1.1.0.dev7")


def _pin(name: str) -> SpecifierSet:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement.specifier
    raise AssertionError(f"{name} is not a dependency")


def _as_pip_combines(spec: SpecifierSet) -> SpecifierSet:
    """Our pin and the launcher's, joined as pip joins them: pre-releases allowed by the launcher's."""
    return spec & JOBLIB_LAUNCHER_HYDRA_SPEC


@pytest.mark.parametrize("version", ["1.3.2", "1.3.8", "1.4.0", "1.4.2"])
def test_hydra_pin_admits_releases_up_to_1_4(version):
    assert _as_pip_combines(_pin("hydra-core")).contains(version)


@pytest.mark.parametrize("version", [*HYDRA_1_4_PRERELEASES, "1.5.0", "1.2.0"])
def test_hydra_pin_refuses_pre_releases_and_other_minors(version):
    combined = _as_pip_combines(_pin("hydra-core"))
    assert combined.prereleases, "the launcher's specifier lets pre-releases in, as pip sees it"
    assert not combined.contains(version)


def test_pip_would_pick_a_release_from_what_the_registry_serves():
    served = ["1.3.7", "1.3.8", *HYDRA_1_4_PRERELEASES]
    assert max(_as_pip_combines(_pin("hydra-core")).filter(served), key=served.index) == "1.3.8"


@pytest.mark.parametrize("version, admitted", [("2.3.1", True), ("2.4.0", True), ("2.4.1", True), ("2.5.0", False)])
def test_omegaconf_pin_admits_the_minor_hydra_1_4_needs(version, admitted):
    assert _pin("omegaconf").contains(version) is admitted
