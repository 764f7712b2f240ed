"""A measured machine description: the host link fitted to copy measurements, as the hardware and node
configs load it (`profile.machine=<file>`; docs/profile.md "Measured links").

    description = machine_description(rows, ...)   # a plain mapping, written as YAML
    machine = Machine.from_dict(yaml.safe_load(...))
    hardware = machine.on(hardware)                # the preset with the measured link
    machine.copy_s("d2h", nbytes)                  # one copy's time: latency + bytes / bandwidth

The fit: per direction, t = latency + bytes / bandwidth by least squares on relative error over
every measured size (small copies fix the latency, large ones the bandwidth). `HostLink` has one
latency, the larger of the two directions'. The theoretical bandwidth of a measured link is its
measured one: there is no datasheet figure to put there. The node figures are the duplex fractions
(one direction's bandwidth while the other runs, over its bandwidth alone) and the cost of pinning a
host buffer (`pin_setup_s_per_tensor`, the median pin time of the smallest buffer measured).

On the CPU the device and the host are one memory and a copy runs synchronously on the compute thread
(`synchronous: true`): the simulator's copy engines overlap copies with compute, which the CPU does
not, so a prediction there adds each copy's time to the step (`slackswap.experiment.prediction`).
A run that measures the links itself caches the description beside the op-time tables and reuses it
under the op-time table's rule (`description_refusal`: the same `load_refusal`), so a description
measured on a loaded machine is measured again rather than reused. This module needs no torch;
`slackswap.profile.torch.links` measures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from slackswap.errors import ConfigError
from slackswap.hardware import Hardware, HostLink
from slackswap.profile.measured import load_refusal


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    bytes_per_s: float

    def copy_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def fit_link(points: Iterable[tuple[int, float]]) -> LinkFit:
    """Least squares of t = latency + bytes / bandwidth, each point weighted by 1/t (relative error)."""
    pts = [(float(s), float(t)) for s, t in points if t > 0]
    if len(pts) < 2:
        raise ConfigError("machine.rows", len(pts), "need at least two copy sizes to fit a link")
    sizes, times = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    a = np.stack([np.ones_like(sizes), sizes], axis=1) / times[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(times), rcond=None)
    if per_byte <= 0:  # flat times: bandwidth from the largest copy alone
        per_byte = times[-1] / sizes[-1]
        latency = 0.0
    return LinkFit(max(0.0, float(latency)), float(1.0 / per_byte))


@dataclass(frozen=True)
class Machine:
    name: str
    device: str
    #: Host and device are one memory; copies are synchronous on the compute thread (the CPU).
    synchronous: bool
    link: HostLink
    h2d: LinkFit
    d2h: LinkFit
    #: Node fields the measurement sets (duplex fractions, pin cost).
    node: Mapping[str, float]
    source: str = ""
    #: Direction -> measured (size_bytes, seconds), ascending: `copy_s` interpolates them.
    curves: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    def on(self, hardware: Hardware) -> Hardware:
        """`hardware` with this machine's measured link."""
        return replace(hardware, link=self.link)

    def copy_s(self, direction: str, nbytes: int) -> float:
        """One copy's time: the measured times interpolated linearly in bytes between the sizes
        measured (the smallest's time below them, the last segment's slope above), where there are
        rows; else the fitted line. Why not the line alone: on a loaded CPU, copies above torch's
        parallel threshold cost far more than a line through the small sizes says."""
        curve = self.curves.get(direction)
        if not curve or len(curve) < 2:
            return (self.d2h if direction == "d2h" else self.h2d).copy_s(nbytes)
        sizes = [c[0] for c in curve]
        times = [c[1] for c in curve]
        if nbytes <= sizes[-1]:
            return float(np.interp(nbytes, sizes, times))
        slope = max(0.0, (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]))
        return times[-1] + (nbytes - sizes[-1]) * slope

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Machine:
        for key in ("name", "device", "synchronous", "link", "fit", "node"):
            if key not in d:
                raise ConfigError(f"machine.{key}", None, "missing from the machine description")
        fits = {k: LinkFit(float(v["latency_s"]), float(v["bytes_per_s"])) for k, v in d["fit"].items()}
        memory = d.get("host_memory", "pageable")
        curves = {direction: tuple(sorted((int(r["size_bytes"]), float(r["median_s"])) for r in d.get("rows", ())
                                          if r["direction"] == direction and r["host_memory"] == memory))
                  for direction in ("h2d", "d2h")}
        return cls(name=str(d["name"]), device=str(d["device"]), synchronous=bool(d["synchronous"]),
                   link=HostLink(**dict(d["link"])), h2d=fits["h2d"], d2h=fits["d2h"], node=dict(d["node"]),
                   source=str(d.get("source", "")), curves=curves)


def machine_description(name: str, device: str, same_memory: bool, rows: Iterable[Mapping[str, Any]],
                        pin_rows: Iterable[tuple[int, float]], skipped: Iterable[str], source: str) -> dict:
    """The YAML-able description of measured copy `rows` (dicts with direction, host_memory,
    size_bytes, median_s): pinned rows where there are any, else pageable ones."""
    rows = [dict(r) for r in rows]
    memory = "pinned" if any(r["host_memory"] == "pinned" for r in rows) else "pageable"
    fits: dict[str, LinkFit] = {}
    for direction in ("h2d", "d2h", "both"):
        pts = sorted((r["size_bytes"], r["median_s"]) for r in rows
                     if r["direction"] == direction and r["host_memory"] == memory)
        fits[direction] = fit_link(pts)
    # While both run, each direction's bandwidth over its own alone (the node's duplex fractions).
    h2d_duplex = min(1.0, fits["both"].bytes_per_s / fits["h2d"].bytes_per_s)
    d2h_duplex = min(1.0, fits["both"].bytes_per_s / fits["d2h"].bytes_per_s)
    pins = sorted(pin_rows)
    link = {"name": f"measured_{name}", "latency_s": max(fits["h2d"].latency_s, fits["d2h"].latency_s)}
    for direction in ("h2d", "d2h"):
        link[f"{direction}_effective_bytes_per_s"] = fits[direction].bytes_per_s
        link[f"{direction}_theoretical_bytes_per_s"] = fits[direction].bytes_per_s  # no datasheet: measured
    return {
        "name": name, "device": device, "synchronous": bool(same_memory), "host_memory": memory,
        "link": link,
        "fit": {k: {"latency_s": f.latency_s, "bytes_per_s": f.bytes_per_s} for k, f in fits.items()},
        "node": {"h2d_duplex_fraction": h2d_duplex, "d2h_duplex_fraction": d2h_duplex,
                 "pin_setup_s_per_tensor": pins[0][1] if pins else 0.0},
        "rows": rows, "pin_rows": [list(p) for p in pins], "skipped": list(skipped), "source": source,
        "note": ("host and device are the same memory: copies are synchronous on the compute thread"
                 if same_memory else "copies on their own streams, overlapping compute"),
    }


def check_finite(description: Mapping[str, Any]) -> None:
    for k, v in description["link"].items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"machine.link.{k}", v, "is not finite")


def description_refusal(description: Mapping[str, Any], artefact: str, versions: Mapping[str, str]) -> str | None:
    """Why a cached machine `description` must be measured again rather than reused (one line), or None
    to reuse it: it does not load as a `Machine` or its link is not finite, it was measured on other
    `versions` than these, or under load (`slackswap.profile.measured.load_refusal` of its `notes`: the
    op-time table's rule, so neither cache keeps a loaded measurement)."""
    try:
        Machine.from_dict(description)
        check_finite(description)
    except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"cached {artefact} is not a machine description ({first}): measuring it again"
    if description.get("versions") != dict(versions):
        return (f"cached {artefact} was measured on versions {description.get('versions')}, not "
                f"{dict(versions)}: measuring it again")
    notes = description.get("notes")
    return load_refusal(artefact, notes if isinstance(notes, Mapping) else {})
