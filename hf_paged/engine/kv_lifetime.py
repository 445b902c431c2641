"""Cached K/V never outlives the weights that computed it (the `KVLifetime` mixin of `Engine`).

Before the scheduler admits requests added since the last check (admission is the only moment a prefix-cache hit can
hand a request K/V that it did not compute), the engine asks its `WeightWatch` whether what the model computes has changed since the last admission:
an optimizer step, `load_state_dict`, replaced parameters, a PEFT adapter enabled / disabled / switched / merged. If
so, the prefix cache is dropped (`reset_prefix_cache`), so every new request computes its K/V with the weights in use.

Requests in flight at that moment keep the K/V they computed so far (they finish as they started: a mix of old and new
weights, as with any engine that changes weights mid-request), and what they compute is never shared with later
requests. `engine.reset_prefix_cache(recompute_running=True)` recomputes them instead. Storage moves (`param.data =`)
also drop the captured CUDA graphs, which read the old addresses; a dtype or device move needs a new engine
(`generate(cache_implementation="paged")` builds one by itself; a directly built `Engine` refuses to step).
"""

from __future__ import annotations

import logging

from ..runner import WeightChange

__all__ = ["KVLifetime"]

logger = logging.getLogger("hf_paged")


class KVLifetime:
    """Weight-change checks and prefix-cache resets; mixed into `Engine` (uses its scheduler, runner, stats)."""

    def _check_weights(self) -> None:
        """Called by `step()` when requests were added since the last check and no step is in flight: once per
        `generate()` call, at most once per step of a server (a step that admits requests also prefills them)."""
        self._new_requests = False
        change = self._weights.check()
        if change is not None:
            self._weights_changed(change)

    def _weights_changed(self, change: WeightChange) -> None:
        if change.dtype != self.dtype or change.device != self.device:
            raise ValueError(
                f"the model moved to {change.dtype} on {change.device} after this engine was built for {self.dtype} "
                f"on {self.device}; build a new Engine for it (its KV pool has the old dtype and device)"
            )
        if change.storage:
            self.runner.invalidate_graphs()
            if self.runner.compile_decode and self.runner.repack():
                self._weights.check()  # the engine moved the weights itself (stacked again): not a change to report
        dropped = self.block_manager.reset_prefix_cache()
        self.stats["weight_changes"] = self.stats.get("weight_changes", 0) + 1
        logger.info("hf_paged: the model's weights changed; dropped %d cached prefix blocks", dropped)

    def reset_prefix_cache(self, recompute_running: bool = False) -> int:
        """Forget every cached prefix block (returns how many); new requests compute their K/V afresh.

        `recompute_running`: also send the running and swapped requests back to be recomputed from their tokens
        (their blocks are freed), e.g. after changing the weights in the middle of their generation. Without it they
        go on with the K/V they hold, which is never shared with other requests.
        """
        if not isinstance(recompute_running, bool):
            raise TypeError(f"recompute_running must be a bool, got {recompute_running!r}")
        with self._control():
            self._drain()
            dropped = self.block_manager.reset_prefix_cache()
            if recompute_running:
                for group in list(self.scheduler.running) + list(self.scheduler.swapped):
                    self.recovery.requeue(group)
                self.runner.invalidate_tables()
            self._weights.check()  # the reset is the new reference point
        return dropped
