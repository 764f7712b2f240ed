"""Plans and simulations are unchanged by speed work: every fingerprint of `tests/fingerprints.py`
matches the stored one, which was computed by running that module on the code before the change."""

from __future__ import annotations

import json

import pytest

from tests.fingerprints import DATA, compute

#: Computing every fingerprint takes several seconds (the module fixture below).
pytestmark = pytest.mark.slow

STORED = json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def current() -> dict[str, dict]:
    return compute()


def test_same_cases(current):
    assert sorted(current) == sorted(STORED)


@pytest.mark.parametrize("key", sorted(STORED))
def test_fingerprint_unchanged(current, key):
    assert current[key] == STORED[key], key
