"""The rows of the calibration table: llm-foundry's MPT benchmark tables, and the independent rows
(torchtitan, fms-fsdp; INDEPENDENT_ROWS below, with their own rule) that no fit reads.

Source: mosaicml/llm-foundry scripts/train/benchmarking/README.md at commit 8c8dd48f7; every row keeps
its table (section) and line. Which rows, by a rule fixed before any ratio was computed:

- the three bf16 tables whose GPU has a fitted preset: "H100 80GB BF16 (Large Scale, >= 128 GPUs)",
  "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" (not the FP8 table:
  FP8 GEMMs are not timed here);
- micro-batch 1 to 16 and sequence 512 to 8192 (issue 42's span), every such row, no other filter;
- held out: every third row in source order (position 2, 5, 8, ... of this list), never chosen by fit.

FOUNDRY_40GB_ROWS: the "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" table under the same
span rule, every row held out. No fit uses them: they check a100_40gb_sxm_calibrated, which carries
the A100 80GB fit unchanged on the 40GB part's HBM2 (1,555 GB/s), so they test whether that fit
transfers to another memory system of the same chip. The table was written in the same commit as the
A100 80GB table (b2a43a147), by the same script and defaults.

SWEEP_ROWS: llm-foundry's micro-batch sweep (larger_mb_1.md at commit beb8dee6922c), every row but the
two with activation CPU offload, all held out: what a micro-batch costs beside its tokens.

The runs (submit_benchmarks.py at the commits that wrote the tables, b2a43a147 and 5e85bd62d): MPT
models from scripts/train/yamls/pretrain/mpt-<size>.yaml (d_model, n_heads, n_layers, expansion 4,
vocab 50368, learned position table sized to the sequence: NumParams grows with SeqLen), attention
`attn_impl: triton` (the script's default then), `low_precision_layernorm`, Composer FSDP with the
table's sharding strategy, activation checkpointing and mixed-precision mode (DEFAULT: bf16 compute,
gradients reduced in fp32; PURE: reduced in bf16).
"""

from __future__ import annotations

FOUNDRY_README = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 8c8dd48f7)"
#: The rows' FSDP API: Composer wraps the model in FSDP1 (composer/trainer/dist_strategy.py,
#: `FullyShardedDataParallel`) and the benchmark sets limit_all_gathers: True (scripts/train/benchmarking/
#: submit_benchmarks.py, `mod_parameters`): the rate limiter runs.
COMPOSER_FSDP_API = "FullyShardedDataParallel"
SECTIONS = {
    "h100_large": "H100 80GB BF16 (Large Scale, >= 128 GPUs)",
    "h100": "H100 80GB BF16",
    "a100": "A100 80GB with 1600 Gbps node-node interconnect (RoCE)",
    "a100_40gb": "A100 40GB with 1600 Gbps node-node interconnect (RoCE)",
}
#: (n_layers, d_model, n_heads) of scripts/train/yamls/pretrain/mpt-<size>.yaml at commit 8c8dd48f7.
MPT_SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
              "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
              "70b": (80, 8192, 64)}

#: (section, line, model, seq, GPUs, MicroBatchSize, GradAccum, Throughput (T/s/GPU), Activation
#: Checkpointing, MP Mode, Sharding Strategy), as the README's row at that line gives them.
FOUNDRY_ROWS: tuple[tuple, ...] = (
    ('h100_large', 75, '70b', 2048, 512, 8, 1, 1007, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 76, '70b', 2048, 256, 8, 1, 1035, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 77, '70b', 2048, 128, 8, 1, 1058, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 78, '30b', 2048, 512, 8, 1, 2115, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 79, '30b', 2048, 256, 8, 1, 2148, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 80, '30b', 2048, 128, 8, 1, 2199, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 81, '13b', 2048, 512, 16, 1, 4952, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 82, '13b', 2048, 256, 16, 1, 4989, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 83, '13b', 2048, 128, 16, 1, 5080, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 84, '7b', 2048, 512, 6, 1, 9670, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 85, '7b', 2048, 256, 6, 1, 10119, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 86, '7b', 2048, 128, 6, 1, 10475, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100_large', 87, '3b', 2048, 512, 8, 1, 21664, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100_large', 88, '3b', 2048, 256, 8, 1, 22772, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100_large', 89, '3b', 2048, 128, 8, 1, 23422, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100_large', 90, '1b', 2048, 512, 12, 1, 39837, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100_large', 91, '1b', 2048, 256, 12, 1, 42555, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100_large', 92, '1b', 2048, 128, 12, 1, 44123, False, 'DEFAULT', 'SHARD_GRAD_OP'),
    ('h100', 98, '70b', 2048, 64, 8, 4, 1039, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 99, '70b', 2048, 32, 2, 16, 882, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 100, '30b', 8192, 8, 1, 21, 1384, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 101, '30b', 4096, 8, 1, 21, 1802, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 102, '30b', 2048, 32, 14, 3, 2308, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 103, '30b', 2048, 16, 10, 3, 2263, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 104, '30b', 2048, 8, 3, 21, 2002, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 105, '30b', 1024, 8, 6, 21, 2084, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 108, '13b', 4096, 8, 10, 3, 4717, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 109, '13b', 2048, 64, 2, 1, 4800, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 110, '13b', 2048, 32, 2, 1, 4811, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 111, '13b', 2048, 16, 2, 1, 4767, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 112, '13b', 2048, 8, 2, 1, 4792, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 116, '7b', 8192, 8, 8, 2, 6935, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 117, '7b', 4096, 8, 16, 2, 8611, True, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 118, '7b', 2048, 8, 6, 1, 10643, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 123, '3b', 8192, 8, 3, 6, 16578, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 124, '3b', 4096, 8, 5, 6, 20964, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 125, '3b', 2048, 64, 6, 3, 22525, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 126, '3b', 2048, 32, 6, 3, 23021, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 127, '3b', 2048, 16, 10, 3, 24142, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 133, '1b', 8192, 8, 3, 4, 29157, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 134, '1b', 4096, 8, 7, 4, 38535, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 138, '1b', 2048, 8, 14, 1, 45455, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 143, '760m', 8192, 8, 6, 2, 41825, False, 'DEFAULT', 'FULL_SHARD'),
    ('h100', 144, '760m', 4096, 8, 12, 2, 55459, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 166, '70b', 2048, 64, 8, 4, 410, True, 'PURE', 'FULL_SHARD'),
    ('a100', 167, '70b', 2048, 32, 2, 16, 373, True, 'PURE', 'FULL_SHARD'),
    ('a100', 168, '30b', 8192, 8, 1, 21, 574, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 169, '30b', 4096, 8, 1, 21, 814, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 170, '30b', 2048, 8, 3, 21, 916, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 171, '30b', 1024, 8, 6, 21, 946, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 172, '30b', 512, 8, 12, 21, 967, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 175, '13b', 8192, 8, 5, 3, 1795, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 176, '13b', 4096, 8, 10, 3, 2060, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 177, '13b', 2048, 8, 2, 3, 2262, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 182, '7b', 8192, 8, 8, 2, 3206, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 183, '7b', 4096, 8, 16, 2, 3684, True, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 184, '7b', 2048, 8, 6, 2, 4641, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 189, '3b', 8192, 8, 3, 6, 7695, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 190, '3b', 4096, 8, 5, 6, 9457, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 191, '3b', 2048, 8, 10, 2, 10811, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 197, '1b', 8192, 8, 3, 4, 13814, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 198, '1b', 4096, 8, 7, 4, 17807, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 199, '1b', 2048, 8, 14, 4, 20513, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 205, '760m', 8192, 8, 6, 2, 20933, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 206, '760m', 4096, 8, 12, 2, 27351, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 213, '350m', 8192, 8, 8, 2, 36569, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 214, '350m', 4096, 8, 16, 2, 49555, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 221, '125m', 8192, 8, 8, 2, 90392, False, 'DEFAULT', 'FULL_SHARD'),
    ('a100', 222, '125m', 4096, 8, 16, 2, 118396, False, 'DEFAULT', 'FULL_SHARD'),
)


def held_out(position: int) -> bool:
    """The split rule: every third row of FOUNDRY_ROWS, in source order."""
    return position % 3 == 2


#: llm-foundry's micro-batch sweep: the same run at micro-batch 1 to 6 (7B) and 1 to 2 (13B) on 8 A100
#: 80GB, seq 2048, GradAccum 2, no checkpointing, DEFAULT, FULL_SHARD, and 3B at micro-batch 1 on 8 A100
#: 40GB. Every row of the file but the two with activation CPU offload (not in the benchmark's step), all
#: held out: the check of what a micro-batch costs beside its tokens (the issue's "+34 % from micro-batch
#: 1 to 4" is 4,513 over 3,366 here).
SWEEP_SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/larger_mb_1.md (commit beb8dee6922c)"
#: (line, model, seq, GPUs, GPU, MicroBatchSize, GradAccum, Throughput (T/s/GPU), Activation
#: Checkpointing, MP Mode, Sharding Strategy), as the file's row at that line gives them.
SWEEP_ROWS: tuple[tuple, ...] = (
    (3, '13b', 2048, 8, 'a100', 2, 2, 2228, False, 'DEFAULT', 'FULL_SHARD'),
    (4, '13b', 2048, 8, 'a100', 1, 2, 1867, False, 'DEFAULT', 'FULL_SHARD'),
    (5, '7b', 2048, 8, 'a100', 6, 2, 4715, False, 'DEFAULT', 'FULL_SHARD'),
    (6, '7b', 2048, 8, 'a100', 4, 2, 4513, False, 'DEFAULT', 'FULL_SHARD'),
    (7, '7b', 2048, 8, 'a100', 2, 2, 4044, False, 'DEFAULT', 'FULL_SHARD'),
    (8, '7b', 2048, 8, 'a100', 1, 2, 3366, False, 'DEFAULT', 'FULL_SHARD'),
    (9, '3b', 2048, 8, 'a100_40gb', 1, 2, 7076, False, 'DEFAULT', 'FULL_SHARD'),
)

#: The A100 40GB table's rows under the same span rule (fields as FOUNDRY_ROWS), all held out.
FOUNDRY_40GB_ROWS: tuple[tuple, ...] = (
    ('a100_40gb', 232, '70b', 2048, 128, 4, 1, 376, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 233, '70b', 2048, 64, 2, 1, 276, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 234, '30b', 2048, 128, 6, 1, 865, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 235, '30b', 2048, 32, 4, 1, 857, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 236, '13b', 8192, 8, 1, 16, 1407, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 237, '13b', 4096, 8, 2, 16, 1603, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 238, '13b', 2048, 128, 16, 1, 1972, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 239, '13b', 2048, 64, 16, 1, 1976, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 240, '13b', 2048, 32, 14, 1, 1998, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 241, '13b', 2048, 16, 10, 1, 1993, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 242, '13b', 2048, 8, 4, 16, 1668, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 243, '13b', 1024, 8, 8, 16, 1727, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 244, '13b', 512, 8, 16, 16, 1763, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 246, '7b', 8192, 8, 3, 4, 2887, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 247, '7b', 4096, 8, 6, 4, 3366, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 251, '7b', 2048, 16, 16, 1, 3645, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 252, '7b', 2048, 8, 12, 4, 3679, True, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 257, '3b', 8192, 8, 1, 8, 7149, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 258, '3b', 4096, 8, 2, 8, 8777, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 259, '3b', 2048, 128, 6, 1, 9538, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 260, '3b', 2048, 64, 6, 1, 9736, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 261, '3b', 2048, 32, 6, 1, 9914, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 262, '3b', 2048, 16, 5, 1, 9750, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 263, '3b', 2048, 8, 5, 8, 10065, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 264, '3b', 1024, 8, 10, 8, 10731, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 268, '1b', 8192, 8, 2, 8, 13474, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 269, '1b', 4096, 8, 4, 8, 16856, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 270, '1b', 2048, 128, 10, 1, 18647, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 271, '1b', 2048, 64, 10, 1, 19001, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 272, '1b', 2048, 32, 10, 1, 15555, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 273, '1b', 2048, 16, 8, 1, 19085, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 274, '1b', 2048, 8, 8, 8, 19271, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 275, '1b', 1024, 8, 16, 8, 20959, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 279, '760m', 8192, 8, 3, 4, 20106, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 280, '760m', 4096, 8, 6, 4, 25863, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 281, '760m', 2048, 128, 12, 1, 28940, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 282, '760m', 2048, 64, 12, 1, 29344, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 283, '760m', 2048, 32, 12, 1, 29648, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 284, '760m', 2048, 16, 12, 1, 29607, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 285, '760m', 2048, 8, 12, 4, 30173, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 290, '350m', 8192, 8, 4, 4, 34933, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 291, '350m', 4096, 8, 8, 4, 46833, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 296, '350m', 2048, 8, 16, 4, 55995, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 301, '125m', 8192, 8, 5, 3, 86858, False, 'PURE', 'FULL_SHARD'),
    ('a100_40gb', 302, '125m', 4096, 8, 13, 3, 115162, False, 'PURE', 'FULL_SHARD'),
)

#: -- The independent rows: sources other than llm-foundry, never used by a fit, counted apart ------
#: Picked by one rule before any ratio was computed: every bf16 row of these tables whose run maps onto
#: the analytic graph (data parallelism with FSDP, no tensor/pipeline/context parallelism, no float8,
#: no torch.compile: the graph has one kernel set, so a compiled run's fusions are not in it) and states
#: its activation checkpointing; the rest are INDEPENDENT_EXCLUDED with their reason.
TORCHTITAN_A100 = ("pytorch/torchtitan docs/performance.md (commit 1d5815c4b1b9), 64 A100 80GB, FSDP2; "
                   "runs as train_configs/llama*.toml at the commits that wrote the rows (395a52627, Llama 2; "
                   "1ea476e9f24b, Llama 3): compile = false, SDPA flash attention, reduce_dtype float32")
TORCHTITAN_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit b5bcd76c66d0), "
                   "Llama 3.1 8B, FSDP, selective (op) activation checkpointing, H100 96GB HBM2e at 500 W, "
                   "400 Gb/s per GPU; train_configs/llama3_8b.toml at torchtitan 9dec370ad26b: seq_len 8192")
FMS_README = ("foundation-model-stack/fms-fsdp README.md (commit 5e522b4c4f8a, before torch.compile), "
              "Llama 2 shapes of fms_fsdp/utils/config_utils.py, seq_length 4096, SDPA flash attention, "
              "bfSixteen mixed precision (bf16 reduce)")
#: (n_layers, hidden, heads, kv_heads, ffn, vocab) of the runs' model code: torchtitan
#: torchtitan/models/llama/__init__.py and fms-fsdp config_utils.py at the commits above (FFN: 8h/3
#: rounded up to multiple_of, times ffn_dim_multiplier where set).
LLAMA_SHAPES = {"llama2_7b": (32, 4096, 32, 32, 11008, 32000), "llama2_13b": (40, 5120, 40, 40, 13824, 32000),
                "llama2_34b": (48, 8192, 64, 8, 22016, 32000), "llama2_70b": (80, 8192, 64, 8, 28672, 32000),
                "llama3_8b": (32, 4096, 32, 8, 14336, 128256), "llama3_70b": (80, 8192, 64, 8, 28672, 128256)}
#: (source, line, the table line as it stands (cell padding collapsed), shape, seq, GPUs, micro-batch,
#: checkpointing, sharding, published tokens/s per GPU). checkpointing: "none", "full" (every block),
#: "layers:2" (torchtitan's "selective layer": every 2nd block, its config's default selective_ac_option
#: "2"), "op" (torchtitan's selective op policy: slackswap/planners/strategies/torch_sac_torchtitan.py).
#: GPU, node and gradient reduction per source: INDEPENDENT_SOURCES below.
INDEPENDENT_ROWS: tuple[tuple, ...] = (
    ("torchtitan_a100", 27, "| 8B | 1 | selective layer | 2904 | 56.8% |", "llama3_8b", 8192, 64, 1, "layers:2",
     "FULL_SHARD", 2904),
    ("torchtitan_a100", 28, "| 8B | 1 | selective op | 2973 | 58.2% |", "llama3_8b", 8192, 64, 1, "op",
     "FULL_SHARD", 2973),
    ("torchtitan_a100", 29, "| 70B | 1 | full | 331 | 51.7% |", "llama3_70b", 8192, 64, 1, "full", "FULL_SHARD", 331),
    ("torchtitan_a100", 44, "| 13B | 2 | no | 2162 | 61.1% |", "llama2_13b", 4096, 64, 2, "none", "FULL_SHARD", 2162),
    ("torchtitan_a100", 45, "| 13B | 2 | selective layer | 1914 | 54.1% |", "llama2_13b", 4096, 64, 2, "layers:2",
     "FULL_SHARD", 1914),
    ("torchtitan_a100", 46, "| 13B | 2 | selective op | 1904 | 53.8% |", "llama2_13b", 4096, 64, 2, "op",
     "FULL_SHARD", 1904),
    ("torchtitan_a100", 47, "| 70B | 1[^3] | selective op | 355 | 50.8% |", "llama2_70b", 4096, 64, 1, "op",
     "FULL_SHARD", 355),
    ("torchtitan_a100", 48, "| 70B | 2 | full | 353 | 50.5% |", "llama2_70b", 4096, 64, 2, "full", "FULL_SHARD", 353),
    ("torchtitan_h100", 27, "Table 1 (8 GPUs, local batch size 2): | FSDP | 5,762 | 82.4 |", "llama3_8b", 8192, 8, 2,
     "op", "FULL_SHARD", 5762),
    ("torchtitan_h100", 44, "Table 3 (128 GPUs, local batch size 2): | FSDP | 5,605 | 67.0 |", "llama3_8b", 8192,
     128, 2, "op", "FULL_SHARD", 5605),
    ("fms_a100", 14, "| 7b | HSDP | No AC | 2 | 3700 | 7500 |", "llama2_7b", 4096, 128, 2, "none", "HYBRID_SHARD",
     3700),
    ("fms_a100", 16, "| 34b | FSDP | Full AC | 2 | 700 | 1550 |", "llama2_34b", 4096, 128, 2, "full", "FULL_SHARD",
     700),
    ("fms_a100", 17, "| 70b | FSDP | Full AC | 2 | 370 | 800 |", "llama2_70b", 4096, 128, 2, "full", "FULL_SHARD", 370),
    ("fms_h100", 14, "| 7b | HSDP | No AC | 2 | 3700 | 7500 |", "llama2_7b", 4096, 96, 2, "none", "HYBRID_SHARD",
     7500),
    ("fms_h100", 16, "| 34b | FSDP | Full AC | 2 | 700 | 1550 |", "llama2_34b", 4096, 96, 2, "full", "FULL_SHARD",
     1550),
    ("fms_h100", 17, "| 70b | FSDP | Full AC | 2 | 370 | 800 |", "llama2_70b", 4096, 96, 2, "full", "FULL_SHARD", 800),
)
#: The bus bandwidth NCCL reaches across nodes, as a share of the NICs' line rate: 84.8-86 of 100 GB/s
#: on 4-NIC A100 nodes (NVIDIA/nccl-tests issues 119 and 175), as conf/node's presets carry it.
NCCL_NETWORK_BUSBW_SHARE = 0.85
#: Per independent source: (family, GPU, node preset, node overrides, gradient reduce bytes, source, FSDP
#: API): torchtitan shards with FSDP2's fully_shard (torchtitan/parallelisms/parallelize_llama.py, `apply_fsdp`:
#: "FSDP2 is used here"), fms-fsdp
#: with FSDP1 and limit_all_gathers=True (main_training.py's `FSDP(...)` call).
#: torchtitan's A100 table names no network: dgx_a100's 8 x 200 Gb/s assumed. Its H100s are HBM2e parts
#: at 500 W (2.4 TB/s), nearer the H100 NVL than the SXM5 preset: h100_sxm_calibrated is the closest
#: preset, no factor for the difference. fms-fsdp's network: NETWORK_READINGS below.
INDEPENDENT_SOURCES = {
    "torchtitan_a100": ("torchtitan", "a100", "dgx_a100", (), 4, TORCHTITAN_A100, "fully_shard"),
    "torchtitan_h100": ("torchtitan", "h100", "hgx_h100", (), 4, TORCHTITAN_H100, "fully_shard"),
    "fms_a100": ("fms-fsdp", "a100", "dgx_a100", (("nics_per_node", 4), ("nic_bytes_per_s", 12.5e9),
                                                  ("network_busbw_bytes_per_s", NCCL_NETWORK_BUSBW_SHARE * 50e9)), 2,
                 FMS_README + ", A100 80G 128 GPUs with 400Gbps", "FullyShardedDataParallel"),
    "fms_h100": ("fms-fsdp", "h100", "hgx_h100", (("nic_bytes_per_s", 12.5e9),
                                                  ("network_busbw_bytes_per_s", NCCL_NETWORK_BUSBW_SHARE * 100e9)), 2,
                 FMS_README + ", H100 96 GPUs with 800 Gbps", "FullyShardedDataParallel"),
}
#: fms-fsdp states one network rate per cluster ("A100 80G 128 GPUs with 400Gbps", "H100 96 GPUs with
#: 800 Gbps") without "per node" or "per GPU". The text around it: the PyTorch blog that published the
#: same table (pytorch/pytorch.github.io _posts "Maximizing training throughput using PyTorch FSDP",
#: Team PyTorch at IBM and Meta, 2024) runs the 7B on "128 A100 GPUs with 400Gbps network connectivity
#: and GPU direct RDMA" and calls the clusters "an A100 cluster with 128 GPUs and 400Gbps inter-node
#: interconnect, and an H100 cluster with 96 GPUs and 800Gbps inter-node interconnect"; its authors'
#: earlier post on the same IBM Cloud A100 system (_posts "Scaling PyTorch FSDP for Training
#: Foundation Models on IBM Cloud", 2022) states its rate per node: "Nodes are connected by 2 x
#: 100Gbps Ethernet links". fms-fsdp's scripts/train.sh (commit a8e98a5) sets up AWS EFA and names no
#: instance. The text leans per node without settling it, so both readings are held to the physical
#: check of benchmarks/calibration_network.py: (reading, the node's NIC line rate in bytes/s under it).
#: Its step bound allows both (per node, the collectives take 0.27-0.47 of the published step); its
#: link bound rules out per GPU: 8 x 400 Gb/s out of an A100 node (50 GB/s a GPU) and 8 x 800 Gb/s
#: out of an H100 node (100 GB/s a GPU) exceed what the GPUs' PCIe 4.0 / 5.0 x16 links carry (31.5 /
#: 63 GB/s a direction), and every byte GPUDirect RDMA sends crosses the link of the GPU it leaves.
#: So the rows read per node, as INDEPENDENT_SOURCES models them (busbw NCCL_NETWORK_BUSBW_SHARE of it).
NETWORK_READINGS = {
    "fms_a100": (("per node", 400e9 / 8), ("per GPU", 8 * 400e9 / 8)),
    "fms_h100": (("per node", 800e9 / 8), ("per GPU", 8 * 800e9 / 8)),
}
#: The source family of a row (its source's first words), for the summary's split.
FAMILIES = {"NVIDIA/DeepLearningExamples": "DeepLearningExamples", "Dao 2023": "FlashAttention-2 paper",
            "mosaicml/llm-foundry": "llm-foundry", "pytorch/torchtitan": "torchtitan",
            "foundation-model-stack/fms-fsdp": "fms-fsdp"}

#: Published rows of the same sources left out, each with why it cannot be mapped as run.
INDEPENDENT_EXCLUDED = {
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md lines 28, 45 (FSDP + torch.compile, 6,667 and 6,514)":
        "torch.compile's fusions are not in the analytic graph (one kernel set for eager and compiled runs); "
        "the same run eager is the row at lines 27 and 44",
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md lines 29, 35-38, 46, 52-53, 59-60, 66-69":
        "Float8 GEMMs, context or tensor/pipeline parallelism: not timed by this step",
    "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (bf16 rows)":
        "tensor parallelism (TP 8) with torch.compile: the step prices data parallelism only",
    "torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md, llama3-8b_h200_202506_trainy-whitefiber.md":
        "every row trains with float8 GEMMs (no bf16 H200 row)",
    "torchtitan docs/performance.md (commit 1d5815c4b1b9) lines 11-13 (405B on 128 H100)": "FSDP + tensor parallelism",
    "fms-fsdp README.md (commit 5e522b4c4f8a) line 15 (13b, Selective AC, 1800 / 3800)":
        "selective_checkpointing (every k-th block) is not stated for the row; the default 1 is full AC",
    "fms-fsdp README.md (commit ed74fd5ddec0) lines 16-19 (compiled rows)":
        "torch.compile (not in the analytic graph), and 13b-70b run selective AC with k not stated",
}
#: Same run with and without checkpointing, published (row names of the pair): the slowdown of the
#: checkpointed step, simulated against published, in percentage points.
SLOWDOWN_PAIRS = (("torchtitan_llama2_13b_s4096_g64_mb2_none", "torchtitan_llama2_13b_s4096_g64_mb2_layers2"),
                  ("torchtitan_llama2_13b_s4096_g64_mb2_none", "torchtitan_llama2_13b_s4096_g64_mb2_op"))

#: Rows more than 10 % off on the committed presets, each with what the model assumes there
#: (docs/hardware.md, "Calibrated compute"); tests/test_calibration.py fails on any other miss.
KNOWN_MISSES = {
    "mpt30b_s8192_g8_mb1_a100": "published MFU drops from 51 % at seq 4096 to 39 % at 8192 (same model, "
                                "micro-batch 1) while 7B-13B at seq 8192 and 30B at 6,144 tokens per "
                                "micro-batch fit; a 30B FULL_SHARD rank holds ~60 GB of sharded state, so "
                                "memory pressure (allocator retries) is a candidate cause, unverified, not modelled; "
                                "the model's estimate of the rank's memory (printed) is above the 30B rows that "
                                "fit (0.78-0.80) and below other rows that fit (the memory line): not settled",
    "mpt30b_s8192_g8_mb1_h100": "the same seq-8192 drop on the H100 (MFU 35.9 -> 29.9 %)",
    **dict.fromkeys(
        ("mpt13b_s4096_g8_mb2_a100_40gb", "mpt13b_s2048_g8_mb4_a100_40gb", "mpt13b_s1024_g8_mb8_a100_40gb",
         "mpt13b_s512_g8_mb16_a100_40gb"),
        "held out; the same 13B at seq 2048 on 16 to 128 GPUs fits (1.02-1.04); on 8 GPUs a 13B FULL_SHARD "
        "rank holds ~26 GB of sharded state, 0.60 of the 40 GB part, with 8,192 tokens per micro-batch, as "
        "the 30B seq-8192 A100 80GB miss (0.70 of 80 GB, 8,192 tokens). Memory pressure (allocator retries) "
        "was the candidate cause, but the model's estimate of the rank's memory (printed) is below that of "
        "rows of the same table that fit (the memory line): not explained"),
    "mpt70b_s2048_g64_mb2_a100_40gb": "held out; published MFU 35.9 % against 48.9 % for the same model on 128 "
                                      "GPUs at micro-batch 4 (ratio 1.06 there), and the A100 80GB table's 70B "
                                      "at micro-batch 2 on 32 GPUs (the same sharded state per GPU and tokens "
                                      "per micro-batch, 16 accumulation steps) fits at 0.99: not explained",
    **dict.fromkeys(
        ("torchtitan_llama3_8b_s8192_g8_mb2_op", "torchtitan_llama3_8b_s8192_g128_mb2_op"),
        "independent; the run's H100s are 96GB HBM2e parts at 500 W whose peak lies 'between SXM and NVL' "
        "(the source's footnote 2); the closest preset, h100_sxm_calibrated, is the 700 W SXM5 (989 dense bf16 "
        "TFLOP/s, HBM3 3.35 TB/s); the NVL's 835 (0.84 of it) would bring 1.19 near 1.0: no preset for the part"),
    **dict.fromkeys(
        ("fms_llama2_34b_s4096_g128_mb2_full", "fms_llama2_70b_s4096_g128_mb2_full",
         "fms_llama2_34b_s4096_g96_mb2_full", "fms_llama2_70b_s4096_g96_mb2_full"),
        "independent; pessimistic. The network is read per node, the one reading of the source's rate the "
        "network check allows (benchmarks/calibration_network.py: per GPU would put 50 / 100 GB/s of NIC "
        "through each GPU's 31.5 / 63 GB/s PCIe link); there the step's FSDP collectives take 0.40-0.47 of "
        "the published step, which FSDP overlaps with compute. The model charges the fitted "
        "collective_overlap_slowdown (0.92 A100, 0.71 H100 s of compute per overlapped second, fitted on "
        "llm-foundry's rows, modelled on 1600 / 3200 Gb/s nodes) on all of it: with overlap free these rows "
        "give 1.07-1.22, so the runs paid 0.15-0.40 s per overlapped second on a network 4x slower than the "
        "fit's. A cost per second of collective does not carry across network rates; one per GB moved would, "
        "but fitted on the same rows (benchmarks/calibration_fit.py, overlap_rules) it fits the H100 rows 4.2x "
        "worse (loss 0.1071 against 0.0254; the A100's 0.0954 against 0.0944): their 256-512 GPU rings spend "
        "seconds on latency and move few bytes. Not the rule, and the 7B HYBRID_SHARD rows (cross-node traffic "
        "only their replica all-reduce, on the same network) fit and imply 0.58 / 0.83"),
    "mpt1b_s2048_g32_mb10_a100_40gb": "held out; the source's own outlier: the same 1B at seq 2048 runs 18,647 "
                                      "to 19,085 tokens/s per GPU (MFU 54-56 %) on 16, 64 and 128 GPUs and "
                                      "15,555 (MFU 45 %) on 32; nothing in the step falls and recovers with "
                                      "the GPU count",
}
#: Presets no public row checks, and why (printed; docs/hardware.md, "Calibrated compute").
UNCHECKED = {
    "a100_80gb_pcie_calibrated": "no public bf16 training run on an A100 PCIe card found",
    "a100_40gb_pcie_calibrated": "no public bf16 training run on an A100 PCIe card found",
    "h100_pcie5": "no public bf16 training run on an H100 PCIe card found",
    "h200_sxm_pcie5": "the public H200 runs found (torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md, "
                      "Llama 3.1 8B on 32 and 64 H200) train with float8 GEMMs, which this model does not time",
    "gh200_c2c": "no public bf16 training run on GH200 with a configuration to reproduce found",
}


def family(meas) -> str:
    """A row's source family (FAMILIES), for the summary's split."""
    return next(f for prefix, f in FAMILIES.items() if meas.source.startswith(prefix))


def slowdowns(rows: list[dict]) -> list[dict]:
    """Checkpointing's slowdown where a source gives the same run with and without it (SLOWDOWN_PAIRS):
    step time checkpointed over keep-all, minus one, simulated and published, in percent."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for plain, ckpt in SLOWDOWN_PAIRS:
        a, b = by_name[plain], by_name[ckpt]
        sim, pub = 100 * (a["simulated"] / b["simulated"] - 1), 100 * (a["published"] / b["published"] - 1)
        out.append({"keep_all": plain, "checkpointed": ckpt, "simulated_pct": round(sim, 2),
                    "published_pct": round(pub, 2), "error_pp": round(sim - pub, 2)})
    return out
