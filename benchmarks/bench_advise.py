"""How long `python -m pipelines.advise` takes over >= 100 configurations of a 7B model, MLflow included.

    python benchmarks/bench_advise.py            # the headline command (hf_llama7b, 1 and 8 GPUs, every default)
    python benchmarks/bench_advise.py --quick    # llama7b on 8 GPUs, mixed AdamW, allocated peak: ~180 configurations
    python benchmarks/bench_advise.py --layout   # llama3_70b on 64 H100s, every default layout (target < 60 s)

Runs the command as a user would (a subprocess, MLflow on a temporary SQLite store), reads the
configuration count and the search and MLflow times from the parent run's metrics, and records the
process's wall and CPU time and the machine's load average before and after (the machine is shared:
wall time alone says little under load; CPU time is what the command itself needs). Saves
benchmarks/results/advise.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine, main_with_quick, save_result  # noqa: E402

HEADLINE = ["model=hf_llama7b", "hardware=a100_80gb_pcie4", "node=dgx_a100"]
#: The layout search's target: a 70B model on 64 GPUs of H100 nodes, every default (tp, pp, cp, sp,
#: micro-batches per pipeline), answered in under 60 s (docs/advise.md, "Layouts").
LAYOUT = ["model=llama3_70b", "hardware=h100_sxm_pcie5", "node=hgx_h100", "advise.gpus=[64]"]
QUICK = ["model=llama7b", "hardware=a100_80gb_pcie4", "node=dgx_a100", "advise.gpus=[8]",
         "advise.recipes=[adamw_mixed]", "advise.plan_against=[allocated]"]


def run(quick: bool, layout: bool = False) -> None:
    args = LAYOUT if layout else QUICK if quick else HEADLINE
    with tempfile.TemporaryDirectory(prefix="slackswap-bench-advise-") as tmp:
        cmd = [sys.executable, "-m", "pipelines.advise", *args, f"tracking.uri=sqlite:///{tmp}/mlflow.db",
               f"tracking.artifact_location={tmp}/mlruns", f"hydra.run.dir={tmp}/run"]
        load_before = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode:
            raise SystemExit(f"advise failed ({out.returncode}): {out.stderr[-2000:]}")
        data = json.loads((Path(tmp) / "run" / "advice.json").read_text())
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
        exp = client.get_experiment_by_name("slackswap")
        parent = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
                  if "mlflow.parentRunId" not in r.data.tags][0]
    result = {
        "command": "python -m pipelines.advise " + " ".join(args),
        "configurations_evaluated": data["evaluated"],
        "configurations_pruned": data["pruned"],
        "best": {g: {k: data["rows"][i][k] for k in ("layout", "recipe", "micro_batch", "tokens_per_s", "mfu",
                                                     "headroom_bytes", "numerics")} for g, i in data["best"].items()},
        "wall_s": round(wall_s, 2),
        "cpu_user_s": round(after.ru_utime - before.ru_utime, 2),
        "cpu_sys_s": round(after.ru_stime - before.ru_stime, 2),
        "search_wall_s": round(parent.data.metrics["search_wall_s"], 2),
        "mlflow_children_s": round(parent.data.metrics["mlflow_children_s"], 2),
        "load_average_before": [round(x, 2) for x in load_before],
        "machine": machine(),
    }
    print(json.dumps(result, indent=2))
    save_result("advise_layout_70b.json" if layout else "advise_quick.json" if quick else "advise.json", result)


if __name__ == "__main__":
    if "--layout" in sys.argv:
        run(False, layout=True)
    else:
        main_with_quick(run)
