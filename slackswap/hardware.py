"""Hardware description: GPU compute/HBM roofline parameters and the host link.

Field names carry their units. Values come from conf/hardware/*.yaml, where each figure cites its
vendor source. Validation happens here, in the library, so a bad value is rejected the same way from
Hydra, from a script or from a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields

#: Op classes that need an efficiency figure. Kept in one place so the profile and the config
#: schema agree on the spelling.
OP_CLASSES: tuple[str, ...] = ("matmul", "attention", "elementwise")
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
#: Attention kernels a model may name (`model.attention_kernel`) and a preset may give an efficiency
#: of its own (`hardware.attention_kernels`): eager batched bmms, FlashAttention v1 / -2 / -3, Triton's
#: flash kernel, cuDNN's fused attention. Kept here, beside the op classes, so the model config and
#: the hardware agree on the spelling.
ATTENTION_KERNEL_NAMES: tuple[str, ...] = ("eager", "flash1", "flash2", "flash3", "triton", "cudnn")


@dataclass(frozen=True)
class HostLink:
    """The GPU <-> host interconnect. Each direction has its own bandwidth (NVLink-C2C is asymmetric)."""

    name: str
    d2h_theoretical_bytes_per_s: float
    h2d_theoretical_bytes_per_s: float
    d2h_effective_bytes_per_s: float
    h2d_effective_bytes_per_s: float
    latency_s: float
    d2h_engines: int = 1
    h2d_engines: int = 1
    #: Host-side work each offload pays before its copy starts (a pinned allocation per tensor when the
    #: runtime has no buffer pool; 0 with a pool). Set from the node (`slackswap.sharing`).
    d2h_setup_s: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "d2h_theoretical_bytes_per_s",
            "h2d_theoretical_bytes_per_s",
            "d2h_effective_bytes_per_s",
            "h2d_effective_bytes_per_s",
        ):
            check.positive(f"link.{name}", getattr(self, name))
        for direction in ("d2h", "h2d"):
            eff = getattr(self, f"{direction}_effective_bytes_per_s")
            theo = getattr(self, f"{direction}_theoretical_bytes_per_s")
            if eff > theo:
                raise ConfigError(
                    f"link.{direction}_effective_bytes_per_s", eff, f"exceeds the theoretical {theo}"
                )
        check.non_negative("link.latency_s", self.latency_s)
        check.non_negative("link.d2h_setup_s", self.d2h_setup_s)
        for name in ("d2h_engines", "h2d_engines"):
            check.integer(f"link.{name}", getattr(self, name), 1)


@dataclass(frozen=True)
class Hardware:
    """One GPU plus its host link, as the roofline op-timing model and the simulator see it."""

    name: str
    peak_flops_per_s: Mapping[str, float]
    hbm_bytes_per_s: float
    device_memory_bytes: int
    link: HostLink
    efficiency: Mapping[str, float]
    hbm_efficiency: float
    launch_overhead_s: float
    source: str = ""
    #: The exact part the figures describe (form factor and memory), e.g. "NVIDIA H100 PCIe 80GB".
    sku: str = ""
    #: Efficiency of named attention kernels (`ATTENTION_KERNEL_NAMES`), overriding
    #: `efficiency["attention"]` for a model that names its kernel (`model.attention_kernel`). Kernels
    #: differ more than GPUs do (FlashAttention-2 reaches 50-73 % of A100 peak and 35 % of H100's,
    #: FlashAttention-3 75 % of H100's: Dao 2023 and Shah et al. 2024, abstracts), so one number for all
    #: of them is wrong for most. A kernel the preset does not list runs at `efficiency["attention"]`.
    attention_kernels: Mapping[str, float] = field(default_factory=dict)
    #: Compute time lost per second of a data-parallel collective that overlaps it: NCCL's kernels take
    #: SMs and HBM bandwidth from the GEMMs beside them, so overlapped communication is not free.
    #: 0 (every uncalibrated preset): free, as `slackswap.communication` assumed; the calibrated presets
    #: carry a fitted value (benchmarks/calibration.py, docs/hardware.md).
    collective_overlap_slowdown: float = 0.0
    #: Seconds the GPU idles per all-gather that FSDP1's rate limiter holds the CPU thread on
    #: (`FullyShardedDataParallel(limit_all_gathers=True)`: the thread waits on a CUDA event before each
    #: all-gather, so the GPU runs dry while it resumes and launches again; 235 us of that gap measured
    #: in pytorch/pytorch#108234). Charged per rate-limited all-gather
    #: (`slackswap.communication.rate_limited_all_gathers`); 0 (every uncalibrated preset): none. The
    #: Hopper presets carry the H100 fit's value; the A100 fit's rows do not ask for one
    #: (benchmarks/calibration_fit.py, `RATE_LIMIT_ADOPTED`; docs/hardware.md).
    rate_limited_all_gather_s: float = 0.0
    #: Hockney's half-performance length per op class, in FLOPs (`n_1/2`: an op of F FLOPs runs at
    #: `efficiency[class] * F / (F + n_1/2)`; Hockney and Jesshope, *Parallel Computers 2*,
    #: 1988): a small GEMM reaches less of the peak than a large one, by a fixed cost that does not
    #: shrink with the op (packing, loop set-up, a partly filled last wave). A class not listed: 0, the
    #: plain roofline. Fitted by `slackswap.profile.fit`; docs/profile.md "Shape-aware efficiency".
    half_performance_flops: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.peak_flops_per_s:
            raise ConfigError("hardware.peak_flops_per_s", dict(self.peak_flops_per_s), "is empty")
        for dtype, flops in self.peak_flops_per_s.items():
            if dtype not in DTYPES:
                raise ConfigError(f"hardware.peak_flops_per_s.{dtype}", flops, f"unknown dtype; known: {DTYPES}")
            check.positive(f"hardware.peak_flops_per_s.{dtype}", flops)
        check.positive("hardware.hbm_bytes_per_s", self.hbm_bytes_per_s)
        check.positive("hardware.device_memory_bytes", self.device_memory_bytes)
        for op_class in OP_CLASSES:
            if op_class not in self.efficiency:
                raise ConfigError(
                    f"hardware.efficiency.{op_class}", None, "op class has no efficiency (required for timing)"
                )
        for op_class, eff in self.efficiency.items():
            if op_class not in OP_CLASSES:
                raise ConfigError(f"hardware.efficiency.{op_class}", eff, f"unknown op class; known: {OP_CLASSES}")
            check.fraction(f"hardware.efficiency.{op_class}", eff)
        for kernel, eff in dict(self.attention_kernels or {}).items():
            if kernel not in ATTENTION_KERNEL_NAMES:
                raise ConfigError(f"hardware.attention_kernels.{kernel}", eff,
                                  f"unknown kernel; known: {ATTENTION_KERNEL_NAMES}")
            check.fraction(f"hardware.attention_kernels.{kernel}", eff)
        for op_class, n_half in dict(self.half_performance_flops or {}).items():
            if op_class not in OP_CLASSES:
                raise ConfigError(f"hardware.half_performance_flops.{op_class}", n_half,
                                  f"unknown op class; known: {OP_CLASSES}")
            check.non_negative(f"hardware.half_performance_flops.{op_class}", n_half)
        check.fraction("hardware.hbm_efficiency", self.hbm_efficiency)
        check.non_negative("hardware.launch_overhead_s", self.launch_overhead_s)
        check.fraction("hardware.collective_overlap_slowdown", self.collective_overlap_slowdown, zero=True)
        check.non_negative("hardware.rate_limited_all_gather_s", self.rate_limited_all_gather_s)
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        object.__setattr__(self, "efficiency", MappingProxyType(dict(self.efficiency)))
        object.__setattr__(self, "attention_kernels", MappingProxyType(dict(self.attention_kernels or {})))
        object.__setattr__(self, "half_performance_flops", MappingProxyType(dict(self.half_performance_flops or {})))

    def attention_efficiency(self, kernel: str = "") -> float:
        """The efficiency of attention kernel `kernel` ("" or one the preset does not list: the
        preset's generic attention efficiency)."""
        return self.attention_kernels.get(kernel, self.efficiency["attention"])

    def peak_for(self, dtype: str) -> float:
        if dtype not in self.peak_flops_per_s:
            raise ConfigError("model.dtype", dtype, f"hardware {self.name!r} has no peak FLOP/s for it")
        return self.peak_flops_per_s[dtype]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hardware:
        """Build from a plain mapping (a resolved Hydra node or parsed YAML). Unknown keys are errors."""
        data = dict(data)
        link = data.pop("link", None)
        if not isinstance(link, Mapping):
            raise ConfigError("hardware.link", link, "must be a mapping of link fields")
        reject_unknown_fields("hardware", data, cls.__dataclass_fields__)
        reject_unknown_fields("hardware.link", link, HostLink.__dataclass_fields__)
        return cls(link=HostLink(**dict(link)), **data)



#: The repository's presets: `conf/hardware/<name>.yaml` beside the package (an editable install or a
#: checkout; pass `conf_dir` otherwise).
PRESET_DIR_NAME = "conf/hardware"


def preset_dir() -> Path:
    return Path(__file__).resolve().parent.parent / PRESET_DIR_NAME


def preset_names(conf_dir: str | Path | None = None) -> list[str]:
    folder = Path(conf_dir) if conf_dir is not None else preset_dir()
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_preset(name: str, conf_dir: str | Path | None = None) -> Hardware:
    """The hardware preset `name` (`load_preset("a100_80gb_pcie4")`), read from `conf/hardware/` as
    the pipeline's `hardware=<name>` reads it, without Hydra: for scripts and notebooks that call the
    library directly (docs/runtime.md). An unknown name is a ConfigError listing the known ones; a
    preset that composes others (a Hydra `defaults:` list) is refused, as only Hydra can compose it."""
    import yaml  # PyYAML: a dependency of omegaconf, imported only here

    folder = Path(conf_dir) if conf_dir is not None else preset_dir()
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("hardware", name, f"no such preset in {folder}; known: {', '.join(preset_names(folder))}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, Mapping) or "defaults" in data:
        raise ConfigError("hardware", name, f"{path} is not a plain preset (compose it with Hydra: hardware={name})")
    return Hardware.from_dict(data)
