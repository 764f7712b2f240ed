"""`python -m pipelines.calibrate [hydra overrides] --out fitted.yaml [--holdout-every 5]`.

Fits a hardware preset's efficiencies and launch overhead to the op times of a torch preset measured
on this machine (`slackswap.experiment.calibrate`) and writes the fitted preset, provenance in its
comments and `source`. Overrides are `pipelines.train`'s (conf/train.yaml): `model=hf_gpt2_2l
hardware=h200_sxm_pcie5 train.device=cpu profile.repeats=7`. Prints the fit on every op (the preset
written) and a check fit's on the ops it held out. Bad input: one line naming the field, exit 2,
nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.measured_console import load_text
from slackswap.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    parser.add_argument("--out", required=True, help="path of the fitted preset YAML")
    parser.add_argument("--holdout-every", type=int, default=5, help="every k-th op is held out of the check fit")
    parser.add_argument("--name", default=None, help="name of the fitted preset")
    args = parser.parse_args(argv)
    try:
        import yaml
        from hydra import compose, initialize_config_dir
        from hydra.errors import HydraException
        from omegaconf import OmegaConf

        import pipelines.schemas  # noqa: F401  (registers the schemas)
        from pipelines.job import resolve_config
        from slackswap.experiment.calibrate import calibrate
        from slackswap.experiment.training_run import TrainingRunSpec

        try:
            with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
                cfg = compose("train", overrides=[*args.overrides, "tracking=off"])
        except HydraException as exc:
            raise ConfigError("overrides", args.overrides, str(exc).splitlines()[0]) from None
        resolved = resolve_config(cfg)
        spec = TrainingRunSpec.from_dict(resolved)
        base = OmegaConf.to_container(cfg.hardware, resolve=True)
        if args.holdout_every < 2:
            raise ConfigError("--holdout-every", args.holdout_every, "must be an integer >= 2")
        out = Path(args.out)
        result = calibrate(spec, base, args.holdout_every, args.name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r = result.report
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.yaml)
    yaml.safe_load(out.read_text())  # what is written loads
    cached = " (cached table)" if result.cached else ""
    print(f"[calibrate] {len(result.table.times)} ops timed on {result.table.key.device}{cached}; {load_text()}")
    print(f"[calibrate] fitted {r.hardware.name}: efficiency {dict(r.hardware.efficiency)}, hbm_efficiency "
          f"{r.hardware.hbm_efficiency:.3g}, launch_overhead_s {r.hardware.launch_overhead_s:.3g}")
    print(f"[calibrate] fit on all {r.fit_ops} ops: median |error| {r.fit_median_rel_error:.1%}; a check fit "
          f"without {r.holdout_ops} of them, on those: median |error| {r.holdout_median_rel_error:.1%}, "
          f"sum {r.holdout_sum_rel_error:+.1%}")
    if r.unfitted_classes:
        print(f"[calibrate] not fitted (no op of the class with FLOPs measured): {', '.join(r.unfitted_classes)}")
    print(f"[calibrate] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
