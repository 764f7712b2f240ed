"""One table per fact: every metric's name, unit and meaning are declared once in
`slackswap.metrics_table`, and every consumer reads them there (the simulator's and the run's builders,
the sweep summary, the run record, MLflow's run description, docs/contract.md). A fake metric added to
the table shows up in each consumer, or makes a builder that does not build it fail."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import yaml

from slackswap import metrics_table
from slackswap.errors import ConfigError
from slackswap.metrics_table import METRICS, MetricSpec, check_metrics, names

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
FAKE = MetricSpec("fake_wait_s", "s", "a metric added for the test", group="run", summary=True)


def _preset(group: str, name: str) -> dict:
    data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return data


def _spec(**extra):
    from slackswap.experiment import RunSpec

    config = {"model": _preset("model", "tiny"), "hardware": _preset("hardware", "a100_80gb_pcie4"),
              "budget": {"fraction": 0.5}, "planner": _preset("planner", "slackswap"), **extra}  # fmt: skip
    return RunSpec.from_dict(config)


@pytest.fixture
def fake_metric(monkeypatch: pytest.MonkeyPatch) -> MetricSpec:
    monkeypatch.setattr(metrics_table, "METRICS", (*METRICS, FAKE))
    return FAKE


def test_the_table_declares_each_name_once_with_a_known_unit_and_kind() -> None:
    all_names = [m.name for m in METRICS]
    assert len(all_names) == len(set(all_names))
    units = {"s", "bytes", "ratio", "count", "FLOP", "tokens", "tokens/s", "GB/s", "bool", "text"}
    assert {m.unit for m in METRICS} <= units
    assert all((m.kind == "text") == (m.unit == "text") and (m.kind == "bool") == (m.unit == "bool") for m in METRICS)
    assert all(m.name.endswith("_bytes") == (m.unit == "bytes") for m in METRICS)
    assert all((m.name.endswith("_s") and not m.name.endswith("_per_s")) == (m.unit == "s") for m in METRICS)
    with pytest.raises(ConfigError, match=r"metrics.x.kind='int': must be one of"):
        MetricSpec("x", "count", "", kind="int")


def test_docs_contract_holds_the_generated_table_and_the_contracts_names() -> None:
    doc = (REPO / "docs" / "contract.md").read_text()
    block = re.search(re.escape(metrics_table.TABLE_BEGIN) + r".*?" + re.escape(metrics_table.TABLE_END) + "\n", doc,
                      re.S)  # fmt: skip
    assert block, "docs/contract.md has no metrics table between its markers"
    assert block.group(0) == metrics_table.markdown(), "regenerate it: python -m slackswap.metrics_table"
    at_least = re.search(r"^At least: (.*?)\n\n", doc, re.S | re.M)
    assert at_least and tuple(re.findall(r"`(\w+)`", at_least.group(1))) == names(contract=True)


def test_a_run_builds_exactly_the_table_groups_it_has(tmp_path) -> None:
    from slackswap.experiment import run_one

    plain = run_one(_spec()).metrics
    assert set(plain) == set(names("simulation") + names("static") + names("run"))
    full = run_one(_spec(simulate={"allocator": "caching"}, node=_preset("node", "pcie_workstation"))).metrics
    assert set(full) == set(plain) | set(names("allocator")) | set(names("node"))
    with pytest.raises(ConfigError, match="declared but not built"):
        check_metrics({k: v for k, v in full.items() if k != "peak_block_bytes"})
    with pytest.raises(ConfigError, match="not declared"):
        check_metrics(dict(plain) | {"made_up_s": 1.0})


def test_a_metric_added_to_the_table_reaches_every_consumer(fake_metric) -> None:
    from pipelines import aggregate, presentation
    from pipelines.records import RunRecord, RunStatus
    from slackswap.experiment import run_one

    # The run's builder reads the table: a declared metric it does not build is named.
    with pytest.raises(ConfigError, match="fake_wait_s"):
        run_one(_spec())
    # The summary's columns, MLflow's units, the docs' table: all from the table.
    record = RunRecord("r", {}, "tiny", "a100", "slackswap", "slackswap", 0.5, None, "run", status=RunStatus.OK,
                       metrics={"step_s": 1.0, "fake_wait_s": 0.25}, job="0")  # fmt: skip
    frame = aggregate.records_to_frame([record])
    assert "fake_wait_s" in frame.columns and frame["fake_wait_s"].iloc[0] == 0.25
    assert "- s: `step_s`, `fake_wait_s`" in presentation.units_note(record.metrics)
    assert "| `fake_wait_s` | s | number | run | a metric added for the test |" in metrics_table.markdown()
    # The record's number check covers it too (it is not text by kind).
    bad = RunRecord("r", {}, "tiny", "a100", "slackswap", "slackswap", 0.5, None, "run",
                    metrics={"fake_wait_s": "soon"})  # fmt: skip
    with pytest.raises(ConfigError, match="run_record.metrics.fake_wait_s='soon': must be a number"):
        bad.check_numbers(aggregate.metric_columns())


def test_the_simulators_builder_reads_the_table(monkeypatch) -> None:
    from slackswap.simulate.metrics import simulate_ideal, unsimulated_metrics
    from slackswap.testing import random_graph, toy_hardware

    ideal = simulate_ideal(random_graph(random.Random(0)), toy_hardware())
    assert set(unsimulated_metrics(ideal, 1, "why")) == set(names("simulation"))
    monkeypatch.setattr(metrics_table, "METRICS", (*METRICS, MetricSpec("fake_s", "s", "x", group="simulation")))
    with pytest.raises(ConfigError, match=r"metrics \(simulation\)=\['fake_s'\]: declared but not built"):
        unsimulated_metrics(ideal, 1, "why")


def test_text_metrics_are_the_tables_text_kind() -> None:
    from pipelines.records import RunRecord

    record = RunRecord("r", {}, "m", "h", "p", "p", 0.5, None, "run", metrics={"node": "dgx", "h2d_limit": "gpu_link"})
    record.check_numbers(names())  # text by kind: no error
    assert set(names(kind="text")) >= {"node", "h2d_limit", "d2h_limit", "infeasible_reason", "model_flops_source"}
