"""Bringing one's own model, as docs/torch_profile.md ("Your own model, end to end") and
docs/runtime.md tell it: every documented command runs as written (plus where its files go), and
the runtime snippet of docs/runtime.md is the runnable example's code.

The commands run in this process (tests/cli_support.py), with their `PYTHONPATH=` folder put first on
`sys.path` as the interpreter would: four interpreters importing torch cost ~10 s more, and the exit
code, what is printed and the files written are what is checked."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from dataclasses import dataclass

import pytest

from pipelines.schemas import REPO_ROOT
from tests.cli_support import run_cli_in_process
from tests.extras import require_torch_extra

require_torch_extra()

EXAMPLE = REPO_ROOT / "examples" / "byo_model"


def _documented_commands() -> list[str]:
    text = (REPO_ROOT / "docs" / "torch_profile.md").read_text()
    section = text[text.index("### Your own model, end to end") :]
    block = section[section.index("```bash") : section.index("```\n", section.index("```bash") + 7)]
    return [line for line in block.splitlines() if line.startswith("PYTHONPATH=")]


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def _run(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *extra: str) -> Done:
    """`command` as the shell would run it from the repository root: `PYTHONPATH=<folder>` then
    `python -m <module> ARGS` or `python <script>`, here in this process."""
    assignment, *argv = shlex.split(command)
    key, _, value = assignment.partition("=")
    assert key == "PYTHONPATH" and argv[0] == "python", command
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.syspath_prepend(str(REPO_ROOT / value))
    capsys.readouterr()
    if argv[1] == "-m":
        code = run_cli_in_process(monkeypatch, argv[2], [*argv[3:], *extra])
    else:
        monkeypatch.setattr(sys, "argv", [argv[1], *argv[2:], *extra])
        try:
            runpy.run_path(str(REPO_ROOT / argv[1]), run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code
    out = capsys.readouterr()
    return Done(0 if code is None else code, out.out, out.err)


def test_the_documented_commands_are_the_four_entry_points() -> None:
    commands = _documented_commands()
    assert [shlex.split(c)[1:3] for c in commands] == [
        ["python", "-m"], ["python", "-m"], ["python", "-m"], ["python", "examples/byo_model/plan_and_step.py"],
    ]  # fmt: skip
    assert all("model.name=my_mlp" in c for c in commands[:3])


@pytest.mark.slow
def test_every_documented_byo_command_runs_and_names_the_users_model(tmp_path, monkeypatch, capsys) -> None:
    run_cmd, profile_cmd, train_cmd, script_cmd = _documented_commands()
    files = ["tracking=off", "hydra/hydra_logging=disabled"]

    done = _run(run_cmd, monkeypatch, capsys, *files, f"hydra.run.dir={tmp_path}/run")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run" / "run_record.json").read_text())
    assert record["status"] == "ok" and record["model"] == "my_mlp" and record["run_name"].count("my_mlp") == 1
    assert record["choices"]["model"] == "tiny_torch"  # the base preset, as Hydra composed it
    profile_line = next(line for line in done.stdout.splitlines() if line.startswith("profile "))
    # Like with like only: no analytic twin describes a user's module, so no "vs analytic".
    assert "traced hook my_model:build" in profile_line and "analytic" not in profile_line
    assert "analytic_keep_all_peak_bytes" not in record["metrics"]
    assert not re.search(r"(?<![\d.])0\.000 GiB", done.stdout) and "MiB" in done.stdout  # toy sizes keep digits

    done = _run(profile_cmd, monkeypatch, capsys, f"hydra.run.dir={tmp_path}/profile")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "profile" / "graph.json").is_file() and (tmp_path / "profile" / "profile.csv").is_file()

    done = _run(train_cmd, monkeypatch, capsys, *files, f"hydra.run.dir={tmp_path}/train")
    assert done.returncode == 0, done.stderr
    assert f"[train] run dir {tmp_path / 'train'}" in done.stdout
    figures = json.loads((tmp_path / "train" / "train.json").read_text())
    assert figures["status"] == "ok" and figures["grad_check_bit_exact"] is True

    done = _run(script_cmd, monkeypatch, capsys)
    assert done.returncode == 0, done.stderr
    assert re.search(r"my_mlp: \d+ ops; .* \d+ offloads", done.stdout), done.stdout


def test_the_runtime_snippet_is_the_examples_code() -> None:
    text = (REPO_ROOT / "docs" / "runtime.md").read_text()
    snippet = text[text.index("```python") + len("```python") : text.index("```", text.index("```python") + 9)]
    script = {line.strip() for line in (EXAMPLE / "plan_and_step.py").read_text().splitlines()}
    missing = [line for line in snippet.strip().splitlines() if line.strip() not in script]
    assert not missing, missing


def test_a_hardware_preset_loads_by_name_as_the_pipeline_composes_it() -> None:
    import yaml

    from slackswap.errors import ConfigError
    from slackswap.hardware import Hardware, load_preset, preset_names

    names = preset_names()
    assert "a100_80gb_pcie4" in names and len(names) == len(list((REPO_ROOT / "conf" / "hardware").glob("*.yaml")))
    for name in names:
        raw = yaml.safe_load((REPO_ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
        assert load_preset(name) == Hardware.from_dict(raw)
    with pytest.raises(ConfigError, match="hardware='a100': no such preset .*known: a100_40gb_pcie4"):
        load_preset("a100")
