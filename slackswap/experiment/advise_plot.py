"""advise_pareto.png: tokens/s per GPU against peak device memory, one colour per GPU count, the
Pareto front drawn, the device's capacity as a vertical line. Drawn like the timeline (a bare Figure
on the Agg canvas, matplotlib imported only here)."""

from __future__ import annotations

from pathlib import Path

from slackswap.experiment.advise import Advice, pareto_front


def write_pareto_png(advice: Advice, path: Path, device_memory_bytes: int, title: str) -> int:
    """Draw every evaluated configuration that has a throughput; returns how many points were drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 5.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.12, 0.62, 0.78))
    rows = [r for r in advice.rows if r.tokens_per_s is not None]
    drawn = 0
    for gpus in sorted({r.candidate.layout.gpus for r in rows}):
        for fits, marker in ((True, "o"), (False, "x")):
            sel = [r for r in rows if r.candidate.layout.gpus == gpus and r.fits_device == fits]
            if not sel:
                continue
            ax.scatter([r.peak_bytes / 2**30 for r in sel], [r.tokens_per_s for r in sel], s=14, marker=marker,
                       alpha=0.7, label=f"{gpus} GPU{'s' if gpus > 1 else ''}{'' if fits else ', does not fit'}")
            drawn += len(sel)
    fitting = [r for r in rows if r.fits_device]
    front = pareto_front([(r.peak_bytes, r.tokens_per_s) for r in fitting])
    if front:
        pts = [fitting[i] for i in front]
        ax.step([r.peak_bytes / 2**30 for r in pts], [r.tokens_per_s for r in pts], where="post", color="black",
                linewidth=1.0, label="Pareto front (fits)")
    ax.axvline(device_memory_bytes / 2**30, color="red", linestyle="--", linewidth=1.0, label="device memory")
    ax.set_xlabel("peak device memory per GPU (GiB: static + reserve + reserved activations)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.savefig(path)
    return drawn
