"""Config composition: every preset composes and validates; bad overrides fail naming the key."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipelines import schemas
from pipelines.hydra_versions import MAIN_VERSION
from slackswap.budget import Budget
from slackswap.errors import ConfigError
from slackswap.experiment import RunSpec
from slackswap.hardware import Hardware, HostLink
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.moe_config import MoEConfig
from slackswap.node import Node
from slackswap.parallel import ParallelConfig
from slackswap.profile.torch.spec import TorchSpec

CONF = schemas.REPO_ROOT / "conf"
GROUPS = ("model", "hardware", "planner", "budget", "training", "tracking", "parallel")


def _compose(overrides: list[str], hydra_node: bool = False):
    with initialize_config_dir(config_dir=str(CONF), **MAIN_VERSION):
        return compose("config", overrides=overrides, return_hydra_config=hydra_node)


@functools.cache
def _experiment_pickled(preset: str) -> bytes:
    return pickle.dumps(_compose([f"+experiment={preset}"], hydra_node=True))


def _experiment(preset: str, hydra_node: bool = False):
    """`+experiment=<preset>` composed once per process (a fresh copy each call). Without the hydra node
    it is what `compose(..., return_hydra_config=False)` returns: the same config, `hydra` deleted."""
    cfg = pickle.loads(_experiment_pickled(preset))
    if not hydra_node:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def _resolved(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def _presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


#: Presets that need one value from the user by design (they say so with `???`).
NEEDS_VALUE = {
    ("budget", "absolute"): ["budget.bytes=1000000"],
    ("training", "adamw_fp32"): ["model.dtype=fp32"],  # the fp32 recipe needs an fp32 model
    # Expert-parallel layouts need a model with experts (ep must divide them).
    **{("parallel", name): ["model=mixtral_8x7b"] for name in ("ep4", "ep8", "gh200_x4_moe", "h100_hgx_moe")},
}


@pytest.mark.parametrize("group", GROUPS)
def test_group_has_presets(group: str) -> None:
    assert _presets(group), f"conf/{group}/ has no presets"


@pytest.mark.parametrize(
    ("group", "preset"),
    [(g, p) for g in GROUPS for p in _presets(g)],
)
def test_every_group_preset_composes_and_validates(group: str, preset: str) -> None:
    overrides = [f"{group}={preset}", *NEEDS_VALUE.get((group, preset), [])]
    cfg = _compose(overrides)
    if cfg.model.dtype not in cfg.hardware.peak_flops_per_s:  # e.g. a V100 has no bf16: run it in its own dtype
        cfg = _compose([*overrides, f"model.dtype={next(iter(cfg.hardware.peak_flops_per_s))}"])
    if cfg.model.dtype == "fp32" and cfg.training.precision != "fp32":  # an fp32 model trains with the fp32 recipe
        cfg = _compose([*overrides, "training=adamw_fp32"])
    resolved = _resolved(cfg)
    inputs = RunSpec.from_dict(resolved)  # ModelConfig / Hardware / Budget checks of the library
    assert isinstance(inputs.model, ModelConfig) and isinstance(inputs.hardware, Hardware)
    if group == "tracking" and resolved["tracking"]["enabled"]:
        assert "://" in resolved["tracking"]["uri"]


#: Experiments that run in one process instead of sweeping (their own test below).
IN_PROCESS_EXPERIMENTS = ("seed_identify",)


@pytest.mark.parametrize("preset", [p for p in _presets("experiment") if p not in IN_PROCESS_EXPERIMENTS])
def test_every_experiment_composes_and_sweeps_existing_presets(preset: str) -> None:
    RunSpec.from_dict(_resolved(_experiment(preset)))
    cfg = _experiment(preset, hydra_node=True)
    assert cfg.experiment.name == preset
    params = cfg.hydra.sweeper.params or {}
    assert params, f"experiment {preset} sweeps nothing"
    for key, value in params.items():
        if key in GROUPS and not str(value).startswith("glob("):
            for choice in str(value).split(","):
                assert (CONF / key / f"{choice.strip()}.yaml").is_file(), f"{preset}: {key}={choice} has no preset"


def test_paper_experiment_is_the_seed_setup() -> None:
    cfg = _experiment("paper", hydra_node=True)
    assert cfg.budget.fraction == 0.5 and cfg.budget.bytes is None
    assert set(cfg.experiment.paper_reference) == set(str(cfg.hydra.sweeper.params.model).split(","))
    assert "pcie" in cfg.hardware.link.name.lower() and "4" in cfg.hardware.link.name
    assert cfg.hydra.mode.name == "MULTIRUN"


def test_budget_curves_cover_fractions_point_two_to_one() -> None:
    cfg = _experiment("budget_curves", hydra_node=True)
    fractions = [float(x) for x in str(cfg.hydra.sweeper.params["budget.fraction"]).split(",")]
    assert min(fractions) == pytest.approx(0.2) and max(fractions) == pytest.approx(1.0)


def _field_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = "???"
    return out


@pytest.mark.parametrize(
    ("schema", "library"),
    [
        (schemas.ModelSchema, ModelConfig),
        (schemas.MoESchema, MoEConfig),
        (schemas.HardwareSchema, Hardware),
        (schemas.HostLinkSchema, HostLink),
        (schemas.BudgetSchema, Budget),
        (schemas.TrainingSchema, TrainingConfig),
        (schemas.TorchSchema, TorchSpec),
        (schemas.NodeSchema, Node),
        (schemas.ParallelSchema, ParallelConfig),
    ],
)
def test_schema_mirrors_library_dataclass(schema, library) -> None:
    """Same field names, same order and same defaults: the schema cannot drift from the library."""
    extra = ["torch"] if schema is schemas.ModelSchema else []  # the torch source's node (TorchSpec)
    assert [f.name for f in dataclasses.fields(schema)] == [f.name for f in dataclasses.fields(library)] + extra
    lib_defaults = {k: v for k, v in _field_defaults(library).items() if v != "???"}
    schema_defaults = _field_defaults(schema)
    for name, default in lib_defaults.items():
        if library is Budget:
            continue  # budget presets always set both keys explicitly
        assert schema_defaults[name] == default, f"{schema.__name__}.{name}"


@pytest.mark.parametrize(
    ("override", "error", "names"),
    [
        ("model.num_layer=3", ConfigCompositionException, "num_layer"),
        ("model.num_layers=three", ConfigCompositionException, "num_layers"),
        ("hardware.link.latency_s=fast", ConfigCompositionException, "latency_s"),
        ("planner.nme=x", ConfigCompositionException, "nme"),
        ("budget.fractoin=0.3", ConfigCompositionException, "fractoin"),
        ("model=no_such_model", MissingConfigException, "model/no_such_model"),
        ("planner=no_such_planner", MissingConfigException, "planner/no_such_planner"),
        ("tracking=no_such_store", MissingConfigException, "tracking/no_such_store"),
    ],
)
def test_bad_override_fails_at_compose_time_naming_it(override: str, error: type, names: str) -> None:
    with pytest.raises(error) as info:
        _compose([override])
    text = str(info.value) + str(info.value.__cause__ or "")
    assert names in text
    if error is ConfigCompositionException:
        assert isinstance(info.value.__cause__, OmegaConfBaseException)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["budget.fraction=1.5"], "budget.fraction"),
        (["budget.fraction=0"], "budget.fraction"),
        (["budget.fraction=-0.2"], "budget.fraction"),
        (["budget.bytes=1000"], "budget"),  # fraction 0.5 still set: ambiguous
        (["budget=absolute", "budget.bytes=0"], "budget.bytes"),
        (["hardware.link.h2d_effective_bytes_per_s=0"], "link.h2d_effective_bytes_per_s"),
        (["hardware.hbm_bytes_per_s=0"], "hardware.hbm_bytes_per_s"),
        (["model.num_layers=0"], "model.num_layers"),
        (["model.attention=sparse"], "model.attention"),
        (["hardware=v100_pcie3", "model.dtype=bf16"], "model.dtype"),  # no bf16 tensor cores on a V100
        (["training.optimizer=lion"], "training.optimizer"),
        (["training.zero_shards=0"], "training.zero_shards"),
        (["training.fsdp_api=fsdp3"], "training.fsdp_api"),
        (["hardware.rate_limited_all_gather_s=-0.001"], "hardware.rate_limited_all_gather_s"),
        (["training=adamw_fp32"], "training.precision"),  # fp32 recipe on a bf16 model
        (["budget=device", "budget.reserve_bytes=-1"], "budget.reserve_bytes"),
        (["budget=device", "budget.fraction=0.5"], "budget"),
        (["simulate.allocator=slab"], "simulate.allocator"),
        (["simulate.plan_against=reserved"], "simulate.plan_against"),  # needs allocator=caching
        (["simulate.plan_margin_fraction=1.0"], "simulate.plan_margin_fraction"),
    ],
)
def test_senseless_values_raise_config_error_naming_the_field(overrides: list[str], field: str) -> None:
    resolved = _resolved(_compose(overrides))
    with pytest.raises(ConfigError) as info:
        RunSpec.from_dict(resolved)
    assert info.value.field == field


def test_absolute_budget_without_bytes_names_the_budget() -> None:
    with pytest.raises(ConfigError, match="exactly one") as info:
        RunSpec.from_dict(_resolved(_compose(["budget=absolute"])))
    assert info.value.field == "budget"


def test_default_store_is_sqlite_at_repo_root() -> None:
    resolved = _resolved(_compose([]))
    assert resolved["tracking"]["uri"] == f"sqlite:///{schemas.REPO_ROOT}/mlflow.db"
    assert Path(resolved["tracking"]["artifact_location"]) == schemas.REPO_ROOT / "mlruns"


def test_budget_resolves_fraction_by_flooring() -> None:
    assert Budget(fraction=0.5).resolve_bytes(1001) == 500
    assert Budget(bytes=123).resolve_bytes(1001) == 123


def test_seed_identify_composes_its_three_models_and_validates_every_knob() -> None:
    from slackswap.experiment.identify_spec import IdentifySpec

    resolved = _resolved(_compose(["+experiment=seed_identify"]))
    spec = IdentifySpec.from_dict(resolved)  # every coarse and fine setting is a valid one
    problem = spec.problem
    assert set(problem.workloads) == set(problem.reference) == {"bert_large", "gpt2_xl", "llama7b"}
    assert not any(m.include_optimizer for m in problem.workloads.values())  # as the paper experiment
    assert set(spec.ranges) == {"attention", "dropout", "matmul_efficiency", "hbm_efficiency", "link_gbps"}
