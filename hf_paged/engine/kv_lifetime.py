"""Cached K/V never outlives the weights that computed it (`WeightGuard`, a part of `Engine`).

Before the scheduler admits requests added since the last check (admission is the only moment a prefix-cache hit can
hand a request K/V that it did not compute), the engine asks its `WeightWatch` whether what the model computes has changed since the last admission:
an optimizer step, `load_state_dict`, replaced parameters, a PEFT adapter enabled / disabled / switched / merged. If
so, the prefix cache is dropped (`reset_prefix_cache`), so every new request computes its K/V with the weights in use.

Requests in flight at that moment keep the K/V they computed so far (they finish as they started: a mix of old and new
weights, as with any engine that changes weights mid-request), and what they compute is never shared with later
requests. `engine.reset_prefix_cache(recompute_running=True)` (`hf_paged.engine.requests`) recomputes them instead.
Storage moves (`param.data =`) also drop the captured CUDA graphs, which read the old addresses; a dtype or device
move needs a new engine (`generate(cache_implementation="paged")` builds one by itself; a directly built `Engine`
refuses to step).
"""

from __future__ import annotations

import logging

from ..runner import WeightChange, WeightWatch

__all__ = ["WeightGuard"]

logger = logging.getLogger("hf_paged")


class WeightGuard:
    """Weight-change checks and what they drop; a part of `Engine` that touches the block manager's prefix cache, the
    runner's graphs and weight stacks, and the engine's `stats` only."""

    def __init__(self, watch: WeightWatch, block_manager, runner, stats: dict, dtype, device) -> None:
        self.watch = watch
        self.block_manager = block_manager
        self.runner = runner
        self.stats = stats
        self.dtype = dtype
        self.device = device
        self.due = False  # requests were added since the last check (`Engine.add_request` sets it)

    def check(self) -> None:
        """Called by `Engine.step()` when requests were added since the last check (`due`) and no step is in flight:
        once per `generate()` call, at most once per step of a server (a step that admits requests also prefills
        them)."""
        self.due = False
        change = self.watch.check()
        if change is not None:
            self._changed(change)

    def rebase(self) -> None:
        """Take the weights as they are now as the reference (after an explicit `Engine.reset_prefix_cache`)."""
        self.watch.check()

    def _changed(self, change: WeightChange) -> None:
        if change.dtype != self.dtype or change.device != self.device:
            raise ValueError(
                f"the model moved to {change.dtype} on {change.device} after this engine was built for {self.dtype} "
                f"on {self.device}; build a new Engine for it (its KV pool has the old dtype and device)"
            )
        if change.storage:
            self.runner.invalidate_graphs()
            if self.runner.compile_decode and self.runner.repack():
                self.watch.check()  # the engine moved the weights itself (stacked again): not a change to report
        dropped = self.block_manager.reset_prefix_cache()
        self.stats["weight_changes"] = self.stats.get("weight_changes", 0) + 1
        logger.info("hf_paged: the model's weights changed; dropped %d cached prefix blocks", dropped)
