"""The repository stands on its own: every document it cites is in it, no path of one machine, and
`pytest -q` reports how many tests passed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pipelines.schemas import REPO_ROOT

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg"}


def _repo_text_files() -> list:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.split()
        files = [REPO_ROOT / name for name in listed]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an sdist): walk the tree
        files = [p for p in REPO_ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.is_file() and p.name != "test_repo_self_contained.py"]


def test_nothing_cites_a_document_outside_the_repository() -> None:
    """A document named in upper case (README.md style) must be a file of the repository, or a public
    repository's file named with its owner and repository; and nothing points into a folder beside the
    repository (a reader of the repository cannot follow either)."""
    cited = re.compile(r"\b[A-Z][A-Z0-9_-]+\.md\b")
    # A public repository's file, named with its owner and repository (`NVIDIA/nccl-tests/doc/PERFORMANCE.md`),
    # is a published source anyone can open, like a cited issue; a bare upper-case name must be ours.
    public = re.compile(r"\b[\w.-]+/[\w.-]+/(?:[\w.-]+/)*[A-Z][A-Z0-9_-]+\.md\b")
    outside = re.compile(r"\.\./shared\b")
    names = {p.name for p in _repo_text_files()} | {p.name for p in REPO_ROOT.glob("*.md")}
    offenders = [
        f"{p.relative_to(REPO_ROOT)}:{n}"
        for p in _repo_text_files()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if outside.search(line) or any(m.group(0) not in names for m in cited.finditer(public.sub("", line)))
    ]
    assert not offenders, f"cite a docs/ file of the repository instead: {offenders}"


def test_no_absolute_path_of_a_particular_machine() -> None:
    """Docs, configs and code; tests may use made-up paths as data (a portability test needs one)."""
    pattern = re.compile(r"(?<![\w.:/])/(work|home|Users|root|mnt|scratch)/\w")
    offenders = [
        f"{p.relative_to(REPO_ROOT)}:{n}: {line.strip()[:80]}"
        for p in _repo_text_files()
        if p.relative_to(REPO_ROOT).parts[0] != "tests"
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_every_cited_doc_exists() -> None:
    cited = {
        m.group(0)
        for p in _repo_text_files()
        for m in re.finditer(r"\bdocs/[\w-]+\.md\b", p.read_text(errors="replace"))
    }
    assert {"docs/contract.md", "docs/seed.md", "docs/hardware.md"} <= cited
    missing = sorted(c for c in cited if not (REPO_ROOT / c).is_file())
    assert not missing, missing


def test_contract_doc_lists_every_metric_the_pipeline_test_checks() -> None:
    from tests.test_pipeline import CONTRACT_METRICS

    contract = (REPO_ROOT / "docs" / "contract.md").read_text()
    assert all(f"`{name}`" in contract for name in CONTRACT_METRICS)
    for name in ("profile.csv", "graph.json", "plan.json", "metrics.json", "trace.json", "timeline.png"):
        assert f"`{name}`" in contract


@pytest.mark.slow
def test_pytest_quiet_prints_the_pass_count(tmp_path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    # The repository's addopts (what this guards: a -q in them makes `pytest -q` -qq, which drops the
    # count), with -n 0 after them: two xdist workers for one test cost 3 s of CPU and print the same line.
    # Without the plugins that neither read addopts nor print the count (hypothesis', Hydra's, anyio's):
    # importing them was 1.2 of the run's 1.5 s of CPU.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-n", "0", "-p", "no:hypothesispytest", "-p", "no:hydra_pytest", "-p", "no:anyio",
         str(tmp_path / "test_one.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b1 passed\b", done.stdout), done.stdout
