"""The least-squares fit the calibrated presets are written from (benchmarks/calibration.py).

One set of figures per GPU (never per model), fitted on the rows marked `held_out=False` by least
squares on log(simulated / published), inside the plausible ranges of BOUNDS. Each GPU is fitted twice:
with the efficiencies alone and with Hockney's half-performance length (n_half) of GEMMs and attention
added, and Akaike's information criterion on the fitted rows alone says which the rows prefer (its
two extra figures must buy more than they cost: Akaike 1974, AIC = n ln(RSS/n) + 2k for least squares).
The presets hold the fit without n_half on every GPU (N_HALF_ADOPTED is empty): the H100 rows prefer
n_half at its range's top, but that per-op cost is charged per graph op, and a traced graph runs about
twice the analytic graph's GEMM kernels (HF Llama: 45 against 22), so traced and analytic steps part
(1.040 -> 1.118 on h100_sxm_calibrated, tests/test_traced_vs_analytic.py allows 5 %), and a tiny
model's GEMM would cost 44 us: docs/hardware.md, "Shape-dependent GEMM cost".

    python benchmarks/calibration_fit.py           # the fits, both variants, and the one kept
    python benchmarks/calibration_fit.py --check   # and that the committed presets hold it (exit 1 if not)

It is the benchmarks' check, not a unit test: the global search with n_half takes about a minute.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.calibration import (  # noqa: E402
    A100_PRESETS,
    BASE_PRESETS,
    H100_CITED,
    HOPPER_PRESETS,
    MEASUREMENTS,
    PRESETS,
    SEED,
    Measurement,
    _phase_masks,
    _step_from_masks,
    hardware,
    micro_collectives,
    to_unit,
    workload,
)
from benchmarks.common import REPO  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402

#: The plausible range of each efficiency; the fit stays inside it.
#: - matmul: large bf16 GEMMs on A100 reach 70-80 % of dense peak in cuBLAS; end-to-end Megatron MFU
#:   52-56 % (Narayanan et al. 2021; Korthikanti et al. 2022) bounds it from below: 0.5-0.85 (Hopper:
#:   its end-to-end MFU is lower, 38-43 % for Llama 3 405B, Dubey et al. 2024: 0.4-0.85).
#: - attention kernels: FlashAttention-2 reaches 50-73 % of A100 peak and 35 % of H100's (Dao 2023,
#:   abstract); eager batched bmms and FlashAttention v1 are not faster than FlashAttention-2: 0.2-0.73.
#: - HBM-bound ops: streaming kernels reach 80-90 % of datasheet HBM bandwidth (BabelStream-class
#:   results); unfused PyTorch elementwise / norm kernels reach less: 0.4-0.9.
#: - n_half_matmul / n_half_attention (Hockney's half-performance length per op class, GFLOP: an op of
#:   F FLOPs runs at efficiency * F / (F + n_half); docs/profile.md "Shape-aware efficiency"): wave
#:   quantisation alone (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, 2023,
#:   section 3.2: a GEMM runs ceil(tiles / SMs) waves, the last one part-filled) costs on average half a
#:   wave, SMs x tm x tn x k FLOPs for 2 x tm x tn x k per tile; with cuBLAS's 256 x 128 tiles at k = 8192
#:   that is 29 GFLOP on the A100's 108 SMs, 35 GFLOP on the H100's 132: 0 to 30.
#: - slowdown: compute seconds an overlapped FSDP collective costs per second of it (NCCL's kernels hold
#:   SMs and stream HBM beside the GEMMs), 0 (free) to 1 (none of it hidden): 0-1. slowdown_per_gb, the
#:   variant `overlap_rules` weighs: the same per GB the collectives move through the rank; 0-0.05 s spans
#:   the per-second range at the bus rates of the rows (0.8-0.9 s/s at 25-230 GB/s: 0.004-0.037 s/GB).
#: - rate_limit_ms: the GPU's idle time per all-gather FSDP1's rate limiter holds the CPU thread on
#:   (`Hardware.rate_limited_all_gather_s`, in ms: a scale Powell's unit steps suit): from 0 (none) to
#:   3 ms, the resumed thread's 235 us gap (pytorch/pytorch#108234) plus its relaunch of a unit's kernels
#:   before the GPU has work again (a transformer layer's tens of eager launches at about 10-40 us of host
#:   time each).
BOUNDS = {"matmul": (0.4, 0.85), "attention": (0.5, 0.73), "eager": (0.2, 0.73), "flash1": (0.2, 0.73),
          "triton": (0.2, 0.73), "hbm": (0.4, 0.9), "slowdown": (0.0, 1.0), "slowdown_per_gb": (0.0, 0.05),
          "n_half_matmul": (0.0, 30.0), "n_half_attention": (0.0, 30.0), "rate_limit_ms": (0.0, 3.0)}
#: Where the fit starts the rate limiter's stall again (ms; `fit`).
RATE_LIMIT_STARTS_MS = (0.25, 0.5, 1.0, 2.0)
#: The fit's n_half keys, in GFLOP (a scale Powell's unit steps suit), and the op class each times.
N_HALF = {"n_half_matmul": "matmul", "n_half_attention": "attention"}


def _op_table(meas: Measurement, base: Hardware) -> dict:
    """Per op its FLOPs, bytes and which efficiency key times it; the phase masks the step sums by,
    the collectives and the model config (`to_unit`), all found once for the fit's many evaluations."""
    model, training = workload(meas)
    graph = build_graph(model, base, training)
    kernel = {"": "attention", "flash2": "attention"}.get(model.attention_kernel, model.attention_kernel)
    return {
        "flops": np.array([op.flops for op in graph.ops]),
        "moved": np.array([op.moved_bytes for op in graph.ops], dtype=float),
        "key": np.array([kernel if str(op.op_class) == "attention" else str(op.op_class) for op in graph.ops]),
        "comm": micro_collectives(meas, graph.meta["num_params"], base),
        "masks": _phase_masks([str(op.phase) for op in graph.ops], [op.layer for op in graph.ops]),
        "model": model,
    }


def fit(gpu: str, free: tuple[str, ...], fixed: dict[str, float] | None = None) -> dict[str, float]:
    """Least squares on log(simulated / published) over this GPU's fitted rows, for the `free`
    efficiencies (the others keep `fixed`, else the seed values). `attention` is the generic fused
    kernel and FlashAttention-2 (the flash backend of PyTorch's SDPA); `eager`, `flash1` their kernels."""
    from scipy.optimize import minimize

    base = hardware(BASE_PRESETS[gpu])
    rows = [m for m in MEASUREMENTS if m.gpu == gpu and not m.held_out]
    tables = [_op_table(m, base) for m in rows]
    peak = base.peak_for("bf16")

    def params(x: np.ndarray) -> dict[str, float]:
        p = dict(SEED[gpu]) | (fixed or {})
        p.update(dict(zip(free, (float(v) for v in x), strict=True)))
        return p

    # Per table, the efficiency key timing each op as an index into the values `loss` looks up
    # (0: elementwise, efficiency 1), found once: the optimizer evaluates the loss thousands of times.
    keys = sorted({k for t in tables for k in np.unique(t["key"]) if k != "elementwise"})
    key_index = [np.searchsorted(keys, t["key"]) + 1 for t in tables]
    for t, index in zip(tables, key_index, strict=True):
        index[t["key"] == "elementwise"] = 0
    # Per table, each op's n_half class as an index (0: none; an attention kernel's ops are the attention
    # class): the FLOP ops of the matmul class, else of the attention class.
    classes = list(N_HALF)
    class_index = [np.where((t["flops"] > 0) & (t["key"] != "elementwise"),
                            np.where(t["key"] == "matmul", 1 + classes.index("n_half_matmul"),
                                     1 + classes.index("n_half_attention")), 0) for t in tables]

    def loss(x: np.ndarray) -> float:
        p = params(x)
        efficiencies = np.array([1.0, *(p.get(k, p["attention"]) for k in keys)])
        halves = np.array([0.0, *(p.get(k, 0.0) * 1e9 for k in classes)])
        total = 0.0
        for meas, t, by_key, by_class in zip(rows, tables, key_index, class_index, strict=True):
            eff = efficiencies[by_key]
            n_half = halves[by_class]
            dur = np.maximum((t["flops"] + n_half) / (peak * eff), t["moved"] / (base.hbm_bytes_per_s * p["hbm"]))
            dur = dur + base.launch_overhead_s
            per_gb = "slowdown_per_gb" in p
            slowdown = p.get("slowdown_per_gb" if per_gb else "slowdown", 0.0)
            step = _step_from_masks(meas, t["masks"], dur, t["comm"], slowdown, per_gb=per_gb,
                                    rate_limit_s=p.get("rate_limit_ms", 0.0) / 1e3)
            total += math.log(to_unit(meas, step, t["model"]) / meas.published) ** 2
        return total

    bounds = [BOUNDS[k] for k in free]
    start = np.array([sum(b) / 2 for b in bounds])
    best = minimize(loss, start, method="Powell", bounds=bounds, options={"xtol": 1e-6, "ftol": 1e-14})
    if "rate_limit_ms" in free:
        # The rate limiter's stall trades against the overlap slowdown and the GEMM efficiency, and Powell
        # from mid-range stops in a local minimum (H100: 0.29 ms, loss 0.033, where 0.5 ms gives 0.025):
        # started again from each of these stalls, the lowest kept.
        at = free.index("rate_limit_ms")
        for stall_ms in RATE_LIMIT_STARTS_MS:
            again = minimize(loss, np.where(np.arange(len(free)) == at, stall_ms, start), method="Powell",
                             bounds=bounds, options={"xtol": 1e-6, "ftol": 1e-14})
            best = again if again.fun < best.fun else best
    if any(k in N_HALF for k in free):
        # With n_half free the loss has several local minima Powell stops in (from mid-range it ended
        # above the fit without n_half, which is inside the box): a seeded global search, polished.
        from scipy.optimize import differential_evolution

        found = differential_evolution(loss, bounds, seed=0, tol=1e-8, x0=best.x, polish=True)
        best = found if found.fun < best.fun else best
    return params(best.x) | {"loss": float(best.fun)}


#: GPUs whose presets hold FSDP1's rate-limiter stall (`rate_limit_rules`): the H100 rows ask for it
#: (Akaike's criterion), the A100 rows do not, and llm-foundry's A100 micro-batch sweep (held out, 7B at
#: micro-batch 1 to 6) follows the fit without it (docs/hardware.md, "FSDP1's rate limiter").
RATE_LIMIT_ADOPTED: frozenset[str] = frozenset({"h100"})
#: Per GPU, the figures its fit frees (the rate limiter's stall apart: `free_figures`) and those it holds
#: fixed: the H100's FlashAttention-2 is cited, no H100 row runs it.
FIGURES: dict[str, tuple[tuple[str, ...], dict[str, float] | None]] = {
    "a100": (("matmul", "attention", "eager", "flash1", "triton", "hbm", "slowdown"), None),
    "h100": (("matmul", "triton", "hbm", "slowdown"), {"attention": H100_CITED["attention"]}),
}


def free_figures(gpu: str, stall: bool | None = None) -> tuple[str, ...]:
    """The figures `gpu`'s fit frees: FIGURES', and the rate limiter's stall where `stall` (None: where
    the GPU has adopted it, `RATE_LIMIT_ADOPTED`)."""
    stall = gpu in RATE_LIMIT_ADOPTED if stall is None else stall
    return (*FIGURES[gpu][0], *(("rate_limit_ms",) if stall else ()))


def aic(loss: float, rows: int, figures: int) -> float:
    """Akaike's criterion for a least-squares fit of `figures` free values to `rows` residuals."""
    return rows * math.log(loss / rows) + 2 * figures


#: GPUs whose presets hold the fit with n_half (none: see the module docstring).
N_HALF_ADOPTED: frozenset[str] = frozenset()


def fit_gpu(gpu: str, free: tuple[str, ...], fixed: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Both variants on this GPU's fitted rows, the one AIC prefers and the one the presets hold:
    {"without", "with", "preferred", "kept"}."""
    rows = sum(m.gpu == gpu and not m.held_out for m in MEASUREMENTS)
    without = fit(gpu, free, fixed) | {"n_half_matmul": 0.0, "n_half_attention": 0.0}
    with_half = fit(gpu, free + tuple(N_HALF), fixed)
    for variant, k in ((without, len(free)), (with_half, len(free) + len(N_HALF))):
        variant["aic"] = aic(variant["loss"], rows, k)
    preferred = min(without, with_half, key=lambda v: v["aic"])
    return {"without": without, "with": with_half, "preferred": preferred,
            "kept": preferred if gpu in N_HALF_ADOPTED else without}


def fit_all() -> dict[str, dict[str, dict[str, float]]]:
    """The fits the presets are written from, each on its GPU's fitted rows only: the A100's seven
    figures (GEMM, HBM, four attention kernels, the overlap slowdown); the H100's five (GEMM, HBM,
    Triton's kernel, the overlap slowdown, FSDP1's rate-limiter stall), FlashAttention-2 and -3 cited (no
    H100 row runs them); each with and without n_half of GEMMs and attention (`fit_gpu`)."""
    return {gpu: fit_gpu(gpu, free_figures(gpu), fixed) for gpu, (_, fixed) in FIGURES.items()}


def overlap_rules(kept: dict[str, dict[str, dict[str, float]]] | None = None) -> dict[str, dict[str, float]]:
    """Per GPU, the kept fit with the overlapped collectives priced per second (what the presets hold)
    and per GB moved, on the same fitted rows with the same free efficiencies: {"per_second", "per_gb"}
    (each with its "loss"). A per-byte cost would carry across network rates where a per-second one
    does not (fms-fsdp's 400 / 800 Gb/s rows, KNOWN_MISSES); the fitted rows say which they support.
    `kept`: `kept_fits()` where the caller has it (not fitted again)."""
    kept = kept or kept_fits()
    return {gpu: {"per_second": kept[gpu]["kept"],
                  "per_gb": fit(gpu, tuple("slowdown_per_gb" if k == "slowdown" else k for k in free_figures(gpu)),
                                fixed)}
            for gpu, (_, fixed) in FIGURES.items()}


def rate_limit_rules(kept: dict[str, dict[str, dict[str, float]]] | None = None) -> dict[str, dict[str, float]]:
    """Per GPU, its fit without n_half with FSDP1's rate-limiter stall left out and with it free, each
    with its loss and Akaike's criterion on the fitted rows: {"without", "with"} (`RATE_LIMIT_ADOPTED`).
    The variant the presets hold is `kept`'s (`kept_fits()` where the caller has it); the other is fitted."""
    kept = kept or kept_fits()
    out = {}
    for gpu, (_, fixed) in FIGURES.items():
        adopted = gpu in RATE_LIMIT_ADOPTED
        other = fit(gpu, free_figures(gpu, not adopted), fixed)
        held = kept[gpu]["kept"]
        without, with_stall = (other, held) if adopted else (held, other)
        rows = sum(m.gpu == gpu and not m.held_out for m in MEASUREMENTS)
        base = len(FIGURES[gpu][0])
        out[gpu] = {"without": {"rate_limit_ms": 0.0} | without | {"aic": aic(without["loss"], rows, base)},
                    "with": with_stall | {"aic": aic(with_stall["loss"], rows, base + 1)}}
    return out


def kept_fits() -> dict[str, dict[str, dict[str, float]]]:
    """Only the fits the presets hold (`fit_gpu`'s "kept"), for `check`: without n_half on a GPU that
    has not adopted it this is one local fit per GPU (seconds), not the global search (a minute)."""
    kept = {}
    for gpu, (_, fixed) in FIGURES.items():
        if gpu in N_HALF_ADOPTED:
            kept[gpu] = fit_gpu(gpu, free_figures(gpu), fixed)
        else:
            kept[gpu] = {"kept": fit(gpu, free_figures(gpu), fixed) | {key: 0.0 for key in N_HALF}}
    return kept


def preset_values(name: str) -> dict[str, float]:
    """A committed preset's figures under the fit's keys (n_half in GFLOP, 0 where it sets none)."""
    p = yaml.safe_load((REPO / "conf/hardware" / f"{name}.yaml").read_text())
    half = p.get("half_performance_flops") or {}
    return {"matmul": p["efficiency"]["matmul"], "attention": p["efficiency"]["attention"],
            **p.get("attention_kernels", {}), "hbm": p["hbm_efficiency"],
            "slowdown": p["collective_overlap_slowdown"],
            "rate_limit_ms": 1e3 * p.get("rate_limited_all_gather_s", 0.0),
            **{key: half.get(cls, 0.0) / 1e9 for key, cls in N_HALF.items()}}


def check(fits: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Where a preset carrying a fit differs from the kept fit beyond its rounding (0.006 for an
    efficiency, 0.6 GFLOP for n_half): one line each; empty when every preset holds its fit."""
    carriers = {"a100": (PRESETS["a100"], *A100_PRESETS), "h100": (PRESETS["h100"], *HOPPER_PRESETS)}
    keys = {gpu: (*free_figures(gpu), *N_HALF) for gpu in FIGURES}
    bad = []
    for gpu, names in carriers.items():
        kept = fits[gpu]["kept"]
        for name in names:
            have = preset_values(name)
            for key in keys[gpu]:
                tol = 0.6 if key in N_HALF else 0.006
                if abs(have.get(key, 0.0) - kept[key]) > tol:
                    bad.append(f"{name}: {key} is {have.get(key, 0.0)}, the fit gives {kept[key]:.4f}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless the presets hold the kept fit")
    args = parser.parse_args(argv)
    fits = fit_all()
    for gpu, variants in fits.items():
        for label in ("without", "with"):
            print(f"{gpu} {label:<7} n_half:", {k: round(v, 4) for k, v in variants[label].items()})
        print(f"{gpu}: AIC prefers {'with' if variants['preferred'] is variants['with'] else 'without'} n_half; "
              f"the presets hold the fit {'with' if variants['kept'] is variants['with'] else 'without'}")
    for gpu, rules in overlap_rules(fits).items():
        second, gb = rules["per_second"], rules["per_gb"]
        print(f"{gpu} overlapped collectives: per second {second['slowdown']:.4f} s/s, loss {second['loss']:.4f}; "
              f"per GB {gb['slowdown_per_gb']:.5f} s/GB, loss {gb['loss']:.4f}; the presets hold per second")
    for gpu, rules in rate_limit_rules(fits).items():
        off, on = rules["without"], rules["with"]
        print(f"{gpu} rate limiter: without, loss {off['loss']:.4f} (AIC {off['aic']:.1f}); with "
              f"{on['rate_limit_ms']:.2f} ms, loss {on['loss']:.4f} (AIC {on['aic']:.1f}); the presets hold it "
              f"{'with' if gpu in RATE_LIMIT_ADOPTED else 'without'}")
    if args.check:
        bad = check(fits)
        print("\n".join(bad) if bad else "every preset carrying a fit holds it")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
