"""The experiment layer: one run of the library, from a plain config mapping to typed figures.

Above planners, simulate, memory and profile; below `pipelines/` (docs/architecture.md). A caller
(the Hydra job, a search over configurations, a benchmark) does

    spec = RunSpec.from_dict(config)     # every check, ConfigError naming field and value
    outcome = run_one(spec)              # profile -> budget -> plan -> simulate -> allocator -> metrics
    outcome.tokens_per_s, outcome.mfu, outcome.fits_device, outcome.metrics   # typed figures, metrics.json

and, to keep the run directory of docs/contract.md, `write_run_files(spec, outcome, run_dir, timings)`.
"""

from slackswap.experiment.baseline import Baseline, analytic_twin, load_baseline
from slackswap.experiment.files import write_run_files
from slackswap.experiment.fitting import FitOptions, FittedPlan, plan_and_simulate
from slackswap.experiment.run import RunOutcome, Verdict, device_capacity, run_metrics, run_one
from slackswap.experiment.spec import RunSpec, hardware_from_config

__all__ = [
    "Baseline",
    "FitOptions",
    "FittedPlan",
    "RunOutcome",
    "RunSpec",
    "Verdict",
    "analytic_twin",
    "load_baseline",
    "device_capacity",
    "hardware_from_config",
    "plan_and_simulate",
    "run_metrics",
    "run_one",
    "write_run_files",
]
