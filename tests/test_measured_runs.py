"""`benchmarks/measured_profile.py --runs K`: every run's counts and every row's error kept side by side;
`--plan NAME@FRACTION` adds a plan, bad input one line."""

from __future__ import annotations

import re

import pytest

from benchmarks.measured_profile import _runs_line, across_runs


def _run(within: int, gap: float, fit: float | None, loads: tuple[float, float]) -> dict:
    rows = [{"model": "m", "plan": "keep_all", "rel_error": 0.01, "overhead_gap_pp": 0.0,
             "overhead_gap_pp_paired": 0.5, "load": loads[0]},
            {"model": "m", "plan": "slackswap@0.5", "rel_error": -0.2, "overhead_gap_pp": gap,
             "overhead_gap_pp_paired": gap / 4, "load": loads[1]},
            {"model": "m", "plan": "torch_sac", "infeasible": "over budget", "load": loads[1]}]
    summary = {"within_10pct": within, "overhead_within_3pp": within - 1, "overhead_within_3pp_paired": within - 2}
    return {"summary": summary, "rows": rows, "wall_s": 13.0,
            "cross_shape_fit": None if fit is None else {"rel_error": fit}}


def test_repeated_runs_keep_each_runs_counts_and_each_rows_errors_in_run_order():
    together = across_runs([_run(23, -4.0, 0.114, (0.6, 0.7)), _run(13, 12.5, -0.266, (1.0, 1.01))])
    assert [r["summary"]["within_10pct"] for r in together["runs"]] == [23, 13]
    assert [(r["load_min"], r["load_max"]) for r in together["runs"]] == [(0.6, 0.7), (1.0, 1.01)]
    assert together["rows"]["m slackswap@0.5"] == {"rel_error": [-0.2, -0.2], "overhead_gap_pp": [-4.0, 12.5],
                                                   "overhead_gap_pp_paired": [-1.0, 3.125]}
    # A row that did not predict (infeasible, refused) keeps its place as None in every run.
    assert together["rows"]["m torch_sac"] == {"rel_error": [None, None], "overhead_gap_pp": [None, None],
                                               "overhead_gap_pp_paired": [None, None]}
    assert [r["noise_floor_pp"] for r in together["runs"]] == [[0.5, 0.5], [0.5, 0.5]]
    assert _runs_line(together) == ("[runs] 2 runs: steps within 10 %: 23, 13; overheads within 3 pp: 22, 12, "
                                    "paired: 21, 11; cross-shape fit: +11.4 %, -26.6 %; noise floor (keep_all's "
                                    "paired gap): +0.5 to +0.5, +0.5 to +0.5 pp")


def test_the_noise_floor_is_the_keep_all_rows_paired_gaps_and_none_without_one():
    from benchmarks.measured_profile import noise_floor

    rows = [{"model": m, "plan": "keep_all", "overhead_gap_pp_paired": g} for m, g in (("a", -2.2), ("b", 0.8))]
    rows += [{"model": "a", "plan": "full_recompute", "overhead_gap_pp_paired": -20.0},  # a plan's gap: not noise
             {"model": "c", "plan": "keep_all", "infeasible": "over budget"}]              # no gap: left out
    assert noise_floor(rows) == [-2.2, 0.8]
    assert noise_floor(rows[2:]) is None


def test_a_run_without_a_cross_shape_fit_is_left_out_of_the_fit_list():
    line = _runs_line(across_runs([_run(5, 0.0, None, (0.1, 0.2)), _run(6, 0.0, 0.05, (0.1, 0.2))]))
    assert line.endswith("cross-shape fit: +5.0 %; noise floor (keep_all's paired gap): +0.5 to +0.5, +0.5 to +0.5 pp")


def test_an_extra_plan_is_a_planner_and_a_fraction_of_the_peak():
    from benchmarks.measured_profile import parse_plan

    assert parse_plan("recompute_knapsack@0.5") == ("recompute_knapsack", 0.5)
    assert parse_plan("keep_all") == ("keep_all", None)
    for bad, says in (("no_such@0.5", "unknown planner 'no_such'"), ("slackswap@0", "in (0, 1]"),
                      ("slackswap@1.5", "in (0, 1]"), ("slackswap@half", "in (0, 1]")):
        with pytest.raises(SystemExit, match=re.escape(says)) as caught:
            parse_plan(bad)
        assert str(caught.value).startswith(f"error: --plan={bad!r}:") and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv, says", [(["--rounds", "0"], "error: --rounds=0: must be >= 1"),
                                        (["--runs", "0"], "error: --runs=0: must be >= 1")])
def test_a_count_below_one_is_one_line_before_anything_runs(monkeypatch, argv, says):
    from benchmarks import measured_profile

    monkeypatch.setattr(measured_profile, "run", lambda *a, **k: pytest.fail("ran with a bad count"))
    monkeypatch.setattr("sys.argv", ["measured_profile.py", *argv])
    with pytest.raises(SystemExit) as caught:
        measured_profile.main()
    assert str(caught.value) == says


@pytest.mark.parametrize("argv, kept, saved", [([], True, "measured_profile.json"),
                                               (["--system-allocator"], False,
                                                "measured_profile_system_allocator.json")])
def test_freed_host_memory_is_kept_unless_asked_and_a_run_without_saves_apart(monkeypatch, argv, kept, saved):
    from benchmarks import measured_profile
    from slackswap.profile import host_allocator

    calls, names = [], []
    monkeypatch.setattr(host_allocator, "keep_freed_memory",
                        lambda: calls.append(1) or host_allocator.HostAllocatorSetting(True, "kept (stand-in)"))
    monkeypatch.setattr(measured_profile, "run", lambda *a, **k: {"rows": []})
    monkeypatch.setattr(measured_profile, "across_runs", lambda results: {})
    monkeypatch.setattr(measured_profile, "save_result", lambda name, result: names.append(name) or name)
    monkeypatch.setattr("sys.argv", ["measured_profile.py", *argv])
    measured_profile.main()
    assert (bool(calls), names) == (kept, [saved])  # the record is never written by a run without it
