"""The attribution hooks of `benchmarks/runtime_overhead.py`: hooks that make the slackswap plan's
copies without the runtime (the plain hooks), hooks that run the runtime's own program unchecked, and
the seconds a step spends inside the runtime's hooks against the plain ones. A mixin of `Variants`
(`benchmarks/runtime_overhead_variants.py`): it reads the variants' runs, workload and `_one`."""

from __future__ import annotations

import time

from benchmarks.runtime_overhead_measures import train_step, zero_grads


class AttributionHooks:
    """The floors the runtime's row is read against (module docstring)."""

    def _unchecked_hooks(self) -> tuple:
        from slackswap.runtime.eager.views import _read, _whole

        packs, unpacks, buffers = self._unchecked_packs, self._unchecked_unpacks, self._unchecked_host
        count, hosts, held = [0, 0], {}, {}

        def pack(t):
            k = count[0]
            count[0] = k + 1
            offloads, by_number, whole = packs[k][:3]
            if offloads:
                copy = t if whole else _whole(t)
                for j in offloads:
                    host = buffers.get(j)
                    if host is None:
                        host = buffers[j] = self.torch.empty_like(copy)
                    hosts[j] = host.copy_(copy)
            return k if by_number else t

        def unpack(packed):
            u = count[1]
            count[1] = u + 1
            prefetches, c, release = unpacks[u]
            for offload, last, made in prefetches:
                held[made] = (hosts.pop(offload) if last else hosts[offload]).clone()
            if type(packed) is not int:
                return packed
            copy = held.pop(c) if release else held[c]
            whole, geometry = packs[packed][2:]
            return copy if whole else _read(copy, *geometry)

        return pack, unpack

    def _prepare_attribution(self) -> str | None:
        """After the runtime's verified step: the tables the plain and the unchecked hooks read. Returns
        why the unchecked hooks cannot run the program (None: they can)."""
        self._swapped_packs = [r.name is not None and str(r.decision) == "swap"
                               for r in self.runs["slackswap"].recording.packs]
        self._plain_host: dict[int, object] = {}
        return self._unchecked_program_refusal()

    def _unchecked_program_refusal(self) -> str | None:
        """Why the unchecked hooks cannot run this program (they handle offloads at packs and
        prefetches at unpacks, nothing else), or None; on None their tables are set."""
        program = self.runs["slackswap"]._program
        if program.tail or any(p.ops or p.held or p.reads_rng for p in program.packs):
            return "the program has operations at a pack or after the last event"
        if any(u.ops for u in program.unpacks):  # prefetches alone are carried apart (`UnpackEvent.prefetches`)
            return "the program has operations other than prefetches at an unpack"
        self._unchecked_packs = [(p.offloads, p.by_number, p.whole, (p.dtype, p.shape, p.stride, p.offset))
                                 for p in program.packs]
        self._unchecked_unpacks = [(u.prefetches, u.copy, u.release) for u in program.unpacks]
        self._unchecked_host: dict[int, object] = {}
        return None

    def _plain_hooks(self) -> tuple:
        torch, swapped, buffers = self.torch, self._swapped_packs, self._plain_host
        count = [0]

        def pack(t):
            k = count[0]
            count[0] = k + 1
            if not swapped[k]:
                return t
            host = buffers.get(k)
            if host is None:
                host = buffers[k] = torch.empty_like(t)
            host.copy_(t)
            return (host,)

        def unpack(packed):
            return packed[0].clone() if type(packed) is tuple else packed

        return pack, unpack

    def _seconds_in_hooks(self, steps: int) -> tuple[float, float]:
        """Per step, the least over `steps` steps of the seconds spent inside the saved-tensor hooks
        (`time.perf_counter` around each call; one core, so wall time is CPU time): of the runtime
        under the slackswap plan, and of the plain hooks making the same copies. Where the gap
        between the two rows is: in the hooks' own code, or around them."""
        pc, spent = time.perf_counter, [0.0]

        def timed(hook):
            def wrapper(x):
                t0 = pc()
                out = hook(x)
                spent[0] += pc() - t0
                return out
            return wrapper

        run = self.runs["slackswap"]
        step_hooks = run._step_hooks

        def timed_step_hooks():
            pack, unpack, reached = step_hooks()
            return timed(pack), timed(unpack), reached

        run._step_hooks = timed_step_hooks
        plain = []
        try:
            for _ in range(steps):
                spent[0] = 0.0
                self._one("runtime_slackswap")
                runtime = spent[0]
                spent[0] = 0.0
                self.torch.manual_seed(1)
                zero_grads(self.w)
                with self.torch.autograd.graph.saved_tensors_hooks(*map(timed, self._plain_hooks())):
                    train_step(self.w)
                plain.append((runtime, spent[0]))
        finally:
            del run._step_hooks  # back to the method
        return min(r for r, _ in plain), min(p for _, p in plain)
