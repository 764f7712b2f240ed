"""`python -m pipelines.measure_links --out machine.yaml [--device cpu|cuda] [--max-mib 256] [--repeats 5]
[--system-allocator]`.

Measures this machine's host <-> device copies (`slackswap.profile.torch.links`: bandwidth and
per-copy latency of each direction, pinned and pageable, one direction and both at once, sizes from
4 KiB to `--max-mib`; the cost of pinning a host buffer) and writes the machine description that
`profile.machine=<file>` loads (`slackswap.profile.machine.Machine`): a `link` node of HostLink
fields, the node's duplex fractions and pin cost, every row measured. On the CPU the device and the
host are the same memory: the file says so (`synchronous: true`) and has no pinned rows. The default
cap, 256 MiB, keeps three buffers of the largest size well inside a 24 GB machine's memory; 1024 reaches
the issue's 1 GiB where memory allows. The process keeps freed host memory first, as the runs that load
the file do (`slackswap.profile.host_allocator`: a CPU prefetch is a clone into a fresh block, which the C
library's own thresholds serve from fresh pages); `--system-allocator` leaves the C library's behaviour.
The file records which (`host_allocator`). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.measured_console import load_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.measure_links", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--system-allocator", action="store_true",
                        help="leave the host allocator as the C library sets it up (default: freed memory kept)")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        print(f"error: --device={args.device!r}: must be cpu, cuda or cuda:<index>", file=sys.stderr)
        return 2
    if not 1 <= args.max_mib <= 1024:
        print(f"error: --max-mib={args.max_mib}: must be in [1, 1024]", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: must be >= 1", file=sys.stderr)
        return 2
    import yaml

    from slackswap.profile.host_allocator import host_allocator
    from slackswap.profile.measured import MeasurementError
    from slackswap.profile.torch.links import measure_links, measurement_description

    print(f"[links] host allocator: {host_allocator(not args.system_allocator)}")
    try:
        m = measure_links(args.device, args.max_mib * 1024**2, args.repeats)
    except MeasurementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    description = measurement_description(m, args.device.replace(":", ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(description, sort_keys=False))
    h2d, d2h = description["fit"]["h2d"], description["fit"]["d2h"]
    print(f"[links] {m.device}: h2d {h2d['bytes_per_s'] / 1e9:.2f} GB/s + {h2d['latency_s'] * 1e6:.1f} us, "
          f"d2h {d2h['bytes_per_s'] / 1e9:.2f} GB/s + {d2h['latency_s'] * 1e6:.1f} us "
          f"({description['host_memory']}); {description['note']}; {load_text()}")
    for line in m.skipped:
        print(f"[links] {line}")
    print(f"[links] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
