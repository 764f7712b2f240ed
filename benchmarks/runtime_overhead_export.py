"""What `benchmarks/runtime_overhead.py` reports for its export rows beside their times: the plan
made for the export against slackswap's own (simulated step, kept and swapped bytes), and the bytes
the eager and the compiled export save for backward against the bytes the plan keeps. A mixin of
`Variants` (`benchmarks/runtime_overhead_variants.py`): it reads the variants' plans, graphs, exports
and partitions."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

from benchmarks.runtime_overhead_measures import train_step, zero_grads


def same_decisions_policy(table: dict) -> object:
    """What a user would hand-write to make the export's decisions with torch's own selective
    checkpointing: a lookup keyed by the op overload and its call count in the layer (`table`: the
    export's audited decisions, `PlanExport.call_table(i).policies()`, decided once). A fresh one per
    layer call, as the counts start at zero."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts: dict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        k = counts[func]
        counts[func] = k + 1
        return table.get((func, k), CheckpointPolicy.PREFER_RECOMPUTE)

    return policy


class ExportAccounting:
    """The export rows' accounting (module docstring), and the torch_sac_same_decisions row: each layer
    under `torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=partial(
    create_selective_checkpoint_contexts, policy))`, `policy` the hand-written lookup of
    `same_decisions_policy` holding the export's decisions."""

    _sac_tables: list[dict] | None = None

    def torch_sac_same_decisions(self) -> None:
        with self._sac_installed():
            train_step(self.w)

    @contextmanager
    def _sac_installed(self, storages: list | None = None):
        """Every layer under torch's SAC with the export's decisions (`storages`: each layer call's cache,
        appended, for the check). `allow_cache_entry_mutation`: the decisions save CPU dropout's noise,
        which the layer writes in place after its op (empty_like, bernoulli_, div_); torch refuses a
        mutated cache entry unless told, and the replay then hands back the written tensor, as the export's."""
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self._sac_tables is None:  # decided once, from the export's audited step
            if not self.export._tables:
                self.export_eager()
            self._sac_tables = [self.export.call_table(r).policies() for r in range(len(self.layers))]

        def contexts(table: dict) -> tuple:
            modes = create_selective_checkpoint_contexts(same_decisions_policy(table), allow_cache_entry_mutation=True)
            if storages is not None:
                storages.append(modes[0].storage)
            return modes

        originals = [layer.forward for layer in self.layers]
        try:
            for layer, f, table in zip(self.layers, originals, self._sac_tables, strict=True):
                layer.forward = partial(checkpoint, f, use_reentrant=False, context_fn=partial(contexts, table))
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)

    def _sac_same_as_export(self) -> dict:
        """One audited export step and one torch SAC step from the same seed: the same ops saved per layer,
        the same bytes in the checkpoint caches, the same loss and gradients (asserted: the rows compare
        the same decisions). Where the export offloads, torch 2.13's eager SAC recomputes
        (MUST_CPU_OFFLOAD is not an offload in eager): those bytes are reported."""
        from torch.utils._pytree import tree_leaves
        from torch.utils.checkpoint import CheckpointPolicy, _VersionWrapper

        torch, w, export = self.torch, self.w, self.export

        def step(context) -> tuple:
            torch.manual_seed(1)
            zero_grads(w)
            with context:
                loss = w.loss_fn(w.model(w.batch))
                cached = {s._cdata: s.nbytes() for cache in storages for entries in cache.values()
                          for e in entries.values() for x in tree_leaves(e)
                          if isinstance(x, _VersionWrapper) and isinstance(x.val, torch.Tensor)
                          for s in [x.val.untyped_storage()]}
                saved_ops = [{(f, i) for f, entries in cache.items() for i, e in entries.items()
                              if any(isinstance(x, _VersionWrapper) for x in tree_leaves(e))} for cache in storages]
                loss.backward()  # consumes the caches
            return loss.detach(), [p.grad.clone() for p in w.model.parameters()], cached, saved_ops

        storages: list = []
        export.audit_next_step()
        loss, grads, _, _ = step(export.installed(w.model))
        export_cached = sum(export.record.saved_storages.values())
        sac_loss, sac_grads, cached, saved_ops = step(self._sac_installed(storages))
        planned_ops = [{k for k, p in t.items() if p == CheckpointPolicy.MUST_SAVE} for t in self._sac_tables]
        assert saved_ops == planned_ops, "torch's SAC saved other ops than the export"
        assert sum(cached.values()) == export_cached, (sum(cached.values()), export_cached)
        assert torch.equal(loss, sac_loss) and all(torch.equal(a, b) for a, b in zip(grads, sac_grads, strict=True))
        return {"same_decisions_as_export_eager": True, "checkpoint_cached_bytes": export_cached,
                "export_offloaded_bytes_torch_recomputes": export.record.offloaded_bytes}

    def _plan_accounting(self, key: str = "export") -> dict:
        """The plan made for the export (`key`: for eager, "export"; for compile, "export_compiled") against
        slackswap's plan of the same budget (what fitting PyTorch's plan space costs, simulated on the H200
        preset, each on the graph it was made on), and the bytes it keeps and swaps."""
        from slackswap.simulate import simulate
        from tests.runtime_support import h200

        plan, graph = self.plans[key], self.plan_graphs.get(key, self.graph)
        sizes = graph.tensors
        return {"planned_offloaded_bytes": sum(sizes[n].size_bytes for n, d in plan.decisions.items()
                                               if str(d) == "swap"),
                "plan_fixed_keep": plan.notes["fixed_keep"], "plan_fixed_keep_bytes": plan.notes["fixed_keep_bytes"],
                "sim_step_s_plan_for_export": simulate(graph, plan, h200(), None).step_s,
                "sim_step_s_slackswap_plan": simulate(self.graph, self.plans["slackswap"], h200(), None).step_s}

    def _eager_saved(self) -> dict:
        """One extra eager export step inside `counting_saved`: the device bytes of every storage it saves
        for backward (checkpoint caches and autograd's), against the plan's kept bytes."""
        torch, export, model = self.torch, self.export, self.w.model
        torch.manual_seed(1)
        zero_grads(self.w)
        with export.counting_saved(model) as count, export.installed(model):
            train_step(self.w)
        saved = export.saved_activation_bytes(count)
        planned = self._kept_bytes("export")
        return {"export_saved_bytes": saved, "export_offloaded_bytes": export.record.offloaded_bytes,
                "export_differences": len(export.step_differences()),
                "export_saved_equals_planned": saved == planned, **self._plan_accounting()}

    def _compiled_saved(self) -> dict:
        """The compiled partitions' device bytes (activations, each layer of a compile group counted)
        plus what autograd holds outside them whatever the policy (tensors outside every layer, the layers'
        outputs, `ExportFacts.fixed_keep`, and the layer inputs the checkpoints hold, `held_inputs`: kept by
        the plan), against the plan's kept bytes; the values the plan does not name (inside ops'
        decompositions) and the planned tensors the partition lacks."""
        from slackswap.runtime.export import (
            LAYER_OUTPUT,
            OUTSIDE,
            differences_by_reason,
            partition_differences,
            saved_bytes,
        )
        from slackswap.runtime.export_facts import module_path, region_of

        export, plan = self.compiled_export, self.plans["export_compiled"]
        sizes = export.graph.tensors  # the graph the plan was made on: dropout masks at their compiled bytes
        decisions = plan.decisions
        device, host = saved_bytes(self.partitions, export)
        unplanned, _ = saved_bytes(self.partitions, export, lambda v: v.plan_tensor not in decisions)
        saved = {v.plan_tensor for part in self.partitions for v in part if not v.is_input}
        regions = {n: region_of(module_path(n), export.regions) for n in export.facts().fixed_keep}
        held = sum(sizes[n].size_bytes for n, why in export.facts().fixed_keep.items()
                   if why in (OUTSIDE, LAYER_OUTPUT)  # held by autograd unless the partition saves it
                   and (regions[n] is None or export.translate(n, regions[n]) not in saved))
        held += sum(sizes[n].size_bytes for n in export.facts().held_inputs)  # inputs of the compiled layers
        differences = export.static_differences() + partition_differences(export, self.partitions)
        planned = self._kept_bytes("export_compiled")
        accounting = self._plan_accounting("export_compiled")
        # The dropout masks inside the layers, as this plan prices them (bool under compile) and as the
        # eager plan prices CPU eager's fp32 noise.
        masks = [n for r in range(len(export.regions)) for ds in export.eager_dropouts(r).values() for _, n in ds]
        return {"export_saved_bytes": device + held, "export_partition_saved_bytes": device,
                "export_held_outside_partition_bytes": held, "export_offloaded_bytes": host,
                "export_saved_unplanned_bytes": unplanned,
                "export_saved_minus_planned_bytes": device + held - planned,
                "export_offloaded_equals_planned": host == accounting["planned_offloaded_bytes"],
                "export_dropout_mask_planned_bytes": sum(sizes[n].size_bytes for n in masks),
                "export_dropout_noise_eager_bytes": sum(self.graph.tensors[n].size_bytes for n in masks),
                "export_saved_equals_planned": device + held == planned,
                "compiled_layer_groups": len(set(export.group_of.values())),
                "export_differences": len(differences),
                "export_differences_by_reason": differences_by_reason(differences),
                **accounting}
