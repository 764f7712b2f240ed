"""`runtime.compare` on traced plans: the copies a plan has alive per step, from the resolved schedule.

A plan of a CUDA-semantics trace that recomputes dropout (`native_dropout`, a random op) stashes the
op's RNG state as a copy named `<op>#rng_state`, which is no graph tensor: `plan_live_copies` raised
`KeyError` on it.
"""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.graph import FORWARD_PHASES  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.runtime.compare import plan_live_copies  # noqa: E402
from slackswap.schedule import build_schedule, resolve_schedule  # noqa: E402
from slackswap.simulate.saved_peak import simulated_saved_peak_bytes  # noqa: E402
from tests.runtime_support import h200  # noqa: E402


@pytest.mark.slow
def test_plan_live_copies_of_a_plan_that_recomputes_dropout():
    model = ModelConfig(name="small_gpt2", family="gpt2", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4,
                        ffn_hidden_size=128, seq_len=16, micro_batch_size=2, vocab_size=64, dtype="fp32", dropout=True)
    graph = build_torch_graph(model, TorchSpec("hf_gpt2", attention="eager", semantics="cuda"), h200())
    random_outputs = {t for op in graph.ops if op.random and op.phase in FORWARD_PHASES for t in op.outputs}
    decisions = {t.name: Decision.RECOMPUTE if t.name in random_outputs else Decision.KEEP
                 for t in graph.saved_tensors}
    assert Decision.RECOMPUTE in decisions.values()
    plan = build_schedule(graph, decisions, planner="t", budget_bytes=None, hardware=h200())
    s = resolve_schedule(graph, plan)
    rng_states = [c for c, t in enumerate(s.copy_tensor) if t.endswith("#rng_state")]
    assert rng_states
    live = plan_live_copies(graph, plan)
    assert set(live) == set(range(len(plan.steps)))
    assert not any(c in cs for cs in live.values() for c in rng_states)  # not a saved tensor
    # Each saved copy is alive from its producer through its resolved last use, no longer.
    for c, copy in enumerate(s.copies):
        if c in rng_states or not graph.tensors[copy.tensor].saved or copy.source == "prefetch":
            continue
        alive = sorted(j for j, cs in live.items() if c in cs)
        assert alive == list(range(copy.source_index, max(copy.source_index, copy.last_use) + 1))
    # With the stashed RNG states (16 B each, from the run step to the last recompute) the live bytes
    # peak where the simulator of saved bytes does.
    for c in rng_states:
        for j in range(s.copy_source_index[c], s.copy_last_use[c] + 1):
            live[j] = live[j] | {c}
    peak = max(sum(s.copy_size[c] for c in cs) for cs in live.values())
    assert peak == simulated_saved_peak_bytes(graph, plan, h200())
