"""The network check of the independent rows (benchmarks/calibration_network.py): the bytes FSDP moves
through a node's NICs per step, worked by hand, the two bounds, and that the fms-fsdp rows are modelled
on the one reading of the source's network rate the check allows."""

from __future__ import annotations

import pytest

from benchmarks import calibration
from benchmarks.calibration_network import (
    ReadingCheck,
    independent_checks,
    llama_params,
    network_bytes_per_step,
    network_lines,
)
from benchmarks.calibration_rows import (
    INDEPENDENT_ROWS,
    INDEPENDENT_SOURCES,
    LLAMA_SHAPES,
    NCCL_NETWORK_BUSBW_SHARE,
    NETWORK_READINGS,
)


def test_full_shard_moves_two_gathers_and_a_reduce_scatter_across_nodes() -> None:
    """1e9 parameters on 16 GPUs of 8-GPU nodes, bf16 parameters and reduction: (2 + 2 + 2) x 1e9 x 15/16
    = 5.625e9 bus bytes a step; fp32 reduction (2 + 2 + 4) x 1e9 x 15/16 = 7.5e9; two micro-batches
    twice; within one node, none."""
    assert network_bytes_per_step(10**9, "FULL_SHARD", 16, 16, 8, 2) == pytest.approx(5.625e9)
    assert network_bytes_per_step(10**9, "FULL_SHARD", 16, 16, 8, 4) == pytest.approx(7.5e9)
    assert network_bytes_per_step(10**9, "FULL_SHARD", 16, 16, 8, 2, micro_batches=2) == pytest.approx(11.25e9)
    assert network_bytes_per_step(10**9, "FULL_SHARD", 8, 8, 8, 2) == 0.0


def test_hybrid_shard_moves_only_the_replica_all_reduce() -> None:
    """8e9 parameters, 8-GPU shard groups, 4 nodes, bf16: each GPU all-reduces 2 x 8e9 / 8 = 2e9 bytes
    over 4 replicas (2 x 3/4 of it = 3e9 bus bytes), 8 rings through the node's NICs: 24e9."""
    assert network_bytes_per_step(8 * 10**9, "HYBRID_SHARD", 32, 8, 8, 2) == pytest.approx(24e9)
    with pytest.raises(ValueError):
        network_bytes_per_step(8 * 10**9, "HYBRID_SHARD", 8, 8, 8, 2)  # one node: no replicas
    with pytest.raises(ValueError):
        network_bytes_per_step(8 * 10**9, "SHARD_GRAD_OP", 32, 32, 8, 2)


def test_a_reading_is_ruled_out_by_either_bound() -> None:
    """5.625e9 bus bytes at 0.85 x 50 GB/s take 0.1324 s: within an 8.192 s step, not within 0.1 s; a node
    line rate of 8 x 50 GB/s exceeds 8 GPUs' 31.5 GB/s links."""
    ok = ReadingCheck("per node", 50e9, 5.625e9, 8.192, 31.5e9, 8)
    assert ok.collectives_s == pytest.approx(5.625e9 / 42.5e9) and ok.allowed
    slow = ReadingCheck("per node", 50e9, 5.625e9, 0.1, 31.5e9, 8)
    assert not slow.fits_step and slow.fits_links and "outlast the step" in slow.describe()
    fast = ReadingCheck("per GPU", 400e9, 5.625e9, 8.192, 31.5e9, 8)
    assert fast.fits_step and not fast.fits_links and "PCIe links" in fast.describe()


def test_fms_70b_on_a100_by_hand() -> None:
    """Llama 2 70B (68,976,648,192 parameters) FULL_SHARD on 128 A100, bf16: 6 x P x 127/128 = 410.6 GB a
    step; per node (400 Gb/s, busbw 42.5 GB/s) 9.66 s of the published 2 x 4096 / 370 = 22.14 s step."""
    row, checks = next((r, c) for r, c in independent_checks(calibration.PRESETS) if r[0] == "fms_a100" and r[1] == 17)
    per_node, per_gpu = checks
    assert per_node.bus_bytes == pytest.approx(410.62e9, rel=1e-4)
    assert per_node.collectives_s == pytest.approx(9.662, rel=1e-3)
    assert per_node.step_s == pytest.approx(22.14, rel=1e-3) and row[9] == 370
    assert per_node.allowed and not per_gpu.allowed and per_gpu.fits_step


def test_fms_rows_are_modelled_on_the_one_reading_the_check_allows() -> None:
    """Each fms-fsdp row allows exactly one reading of its source's rate, and INDEPENDENT_SOURCES models
    that one: its node's NICs at that line rate, busbw NCCL_NETWORK_BUSBW_SHARE of it."""
    from benchmarks.common import conf

    checked = [(row, checks) for row, checks in independent_checks(calibration.PRESETS) if row[0] in NETWORK_READINGS]
    assert len(checked) == 6
    for row, checks in checked:
        allowed = [c for c in checks if c.allowed]
        assert [c.reading for c in allowed] == ["per node"], row
        node = conf("node", INDEPENDENT_SOURCES[row[0]][2]) | dict(INDEPENDENT_SOURCES[row[0]][3])
        assert node["nics_per_node"] * node["nic_bytes_per_s"] == pytest.approx(allowed[0].node_line_bytes_per_s)
        assert node["network_busbw_bytes_per_s"] == pytest.approx(NCCL_NETWORK_BUSBW_SHARE
                                                                  * allowed[0].node_line_bytes_per_s)


def test_every_independent_row_is_checked_and_printed() -> None:
    """One line per row and reading; every row's modelled network passes (torchtitan's as its presets)."""
    lines = network_lines(calibration.PRESETS)
    assert len(lines) == sum(len(NETWORK_READINGS.get(row[0], ((),))) for row in INDEPENDENT_ROWS) == 22
    assert sum("ruled out" in line for line in lines) == 6 and all(line.startswith("network  ") for line in lines)
    for row, checks in independent_checks(calibration.PRESETS):
        if row[0] not in NETWORK_READINGS:
            assert [c.reading for c in checks] == ["as modelled"] and checks[0].allowed, row


@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
def test_the_analytic_parameter_count_is_the_graphs(shape: str) -> None:
    from dataclasses import replace

    meas = next(m for m in calibration.MEASUREMENTS if m.independent)
    layers, width, heads, kv, ffn, vocab = LLAMA_SHAPES[shape]
    meas = replace(meas, model=dict(meas.model, num_layers=layers, hidden_size=width, num_heads=heads,
                                    num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=vocab), seq_len=512)
    model, training = calibration.workload(meas)
    graph = calibration.build_graph(model, calibration.hardware(calibration.PRESETS[meas.gpu]), training)
    assert llama_params(shape) == graph.meta["num_params"]
