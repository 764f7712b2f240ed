"""Freed host memory kept in the process (`slackswap.profile.host_allocator`): a block freed and asked
for again is served without page faults, where glibc's own thresholds fault it back in; a C library
other than glibc is left alone, and says so. Each check runs in a fresh interpreter: the setting holds
for the rest of a process, and pytest's own must keep the C library's behaviour."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from slackswap.profile import host_allocator
from slackswap.profile.host_allocator import SYSTEM_DEFAULT_ALLOCATOR

#: In a fresh interpreter: malloc 8 MiB, write every page, free it, malloc it again and write it again;
#: prints the minor faults of the second write (one per 4 KiB page the kernel hands over afresh).
_REFAULT = """
import ctypes, resource, sys
from slackswap.profile.host_allocator import host_allocator_label, keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory().applied
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 8 * 1024 * 1024
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); ctypes.memset(block, 2, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, host_allocator_label())
"""

PAGES = 8 * 1024 * 1024 // 4096

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _refaults(mode: str) -> tuple[int, str]:
    # glibc's own thresholds as it starts them: none of its malloc settings from the environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _REFAULT, mode], capture_output=True, text=True, check=True,
                         env=env)
    faults, label = out.stdout.split(" ", 1)
    return int(faults), label.strip()


@glibc_only
def test_a_freed_block_asked_for_again_takes_no_page_faults_when_kept() -> None:
    kept, label = _refaults("keep")
    assert kept < PAGES // 10, f"{kept} faults of {PAGES} pages with freed memory kept"
    assert label.startswith("glibc ") and "freed memory kept" in label


@glibc_only
def test_glibcs_own_thresholds_fault_the_block_back_in() -> None:
    # The case the setting exists for: the first 8 MiB block is mapped (over glibc's 128 KiB start
    # threshold) and unmapped when freed, so the second comes from pages the kernel hands over afresh.
    default, label = _refaults("system")
    assert default > PAGES // 2, f"only {default} faults of {PAGES} pages with glibc's defaults"
    assert label == SYSTEM_DEFAULT_ALLOCATOR


def test_another_c_library_is_left_alone_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_allocator.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(host_allocator, "_applied", None)
    setting = host_allocator.keep_freed_memory()
    assert not setting.applied and "not glibc" in setting.detail
    assert host_allocator.host_allocator_label() == SYSTEM_DEFAULT_ALLOCATOR


def _as_glibc(monkeypatch: pytest.MonkeyPatch, libc: object) -> None:
    """This test's process as a glibc 2.99 whose library is `libc`, with no setting made yet."""
    monkeypatch.setattr(host_allocator.platform, "libc_ver", lambda: ("glibc", "2.99"))
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(host_allocator, "_applied", None)


class _RefusingLibc:
    """A C library whose mallopt takes one parameter and refuses the other (glibc 2.36 takes any int)."""

    def __init__(self, refused: int):
        self.refused, self.calls = refused, []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 0 if parameter == self.refused else 1


def test_a_trim_threshold_the_c_library_refuses_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _RefusingLibc(host_allocator.M_TRIM_THRESHOLD)
    _as_glibc(monkeypatch, libc)
    setting = host_allocator.keep_freed_memory()
    assert not setting.applied and "refused mallopt(M_TRIM_THRESHOLD, 2147483647)" in setting.detail
    assert libc.calls == [(host_allocator.M_TRIM_THRESHOLD, 2**31 - 1)]  # no other threshold touched
    assert host_allocator.host_allocator_label() == SYSTEM_DEFAULT_ALLOCATOR


def test_an_mmap_threshold_refused_leaves_the_trim_threshold_set_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _RefusingLibc(host_allocator.M_MMAP_THRESHOLD)
    _as_glibc(monkeypatch, libc)
    setting = host_allocator.keep_freed_memory()
    assert not setting.applied and "refused for v in (2147483647, 33554432)" in setting.detail
    # The largest value first, then glibc's documented largest; what did change is the process's label.
    assert [v for p, v in libc.calls if p == host_allocator.M_MMAP_THRESHOLD] == [2**31 - 1, 32 * 1024 * 1024]
    assert host_allocator.host_allocator_label() == setting.detail != SYSTEM_DEFAULT_ALLOCATOR


def test_kept_once_it_stays_kept_without_asking_the_library_again(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _RefusingLibc(refused=0)
    _as_glibc(monkeypatch, libc)
    first = host_allocator.keep_freed_memory()
    assert first.applied and host_allocator.host_allocator_label() == first.detail
    assert host_allocator.keep_freed_memory() is first and len(libc.calls) == 2


def test_a_machine_description_is_cached_apart_once_freed_memory_is_kept(monkeypatch, tmp_path) -> None:
    # A CPU prefetch is a clone into a fresh block: its measured time depends on how the allocator runs.
    from tests.extras import require_torch_extra

    require_torch_extra("torch")
    from slackswap.profile.torch import links

    monkeypatch.setattr(host_allocator, "_applied", None)
    plain = links.machine_cache_path(tmp_path, "cpu")
    assert "-alloc" not in plain.name
    assert links.measurement_description(links.measure_links("cpu", 16 * 1024, 1), "cpu")["host_allocator"] == (
        SYSTEM_DEFAULT_ALLOCATOR)
    monkeypatch.setattr(host_allocator, "_applied", host_allocator.HostAllocatorSetting(True, "kept, as set"))
    kept = links.machine_cache_path(tmp_path, "cpu")
    assert kept != plain and kept.name.startswith(plain.stem + "-alloc")
    assert links.measurement_description(links.measure_links("cpu", 16 * 1024, 1), "cpu")["host_allocator"] == (
        "kept, as set")


@pytest.mark.parametrize("argv, kept", [([], True), (["--system-allocator"], False)])
def test_measure_links_keeps_freed_memory_unless_told_and_the_file_says_so(monkeypatch, tmp_path, capsys, argv,
                                                                         kept) -> None:
    from tests.extras import require_torch_extra

    require_torch_extra("torch")
    import yaml

    from pipelines.measure_links import main

    monkeypatch.setattr(host_allocator, "_applied", None)

    def keep() -> host_allocator.HostAllocatorSetting:  # a stand-in: pytest's own process stays as it is
        host_allocator._applied = host_allocator.HostAllocatorSetting(True, "kept, as set")
        return host_allocator._applied

    monkeypatch.setattr(host_allocator, "keep_freed_memory", keep)
    out = tmp_path / "machine.yaml"
    assert main(["--out", str(out), "--max-mib", "1", "--repeats", "1", *argv]) == 0
    said = "kept, as set" if kept else SYSTEM_DEFAULT_ALLOCATOR
    assert f"[links] host allocator: {said}" in capsys.readouterr().out
    assert yaml.safe_load(out.read_text())["host_allocator"] == said
