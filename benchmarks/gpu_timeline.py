"""GPU busy and idle time of an engine's steps, from CUDA events: whether a run waits on the GPU or on the host.

`bench_generate.py`'s step timer measures host time; a pipelined step's wait hides the GPU's own time in it. This
adds two CUDA events a step: one where the step's GPU work begins (`runner.execute` is entered; the step's uploads
come first) and one where it ends (its tokens were picked: the engine's `picker.pick` returned). The GPU waits for the
host before step N+1 for start(N+1) - end(N) when the host launched step N+1 after the GPU had finished step N (zero
when it launched it sooner), and is busy with step N for end(N) - start(N).

On the H100 the issue's workloads left the GPU idle 0.03-0.05 s of 1.7-8 s runs (`benchmarks/results/h100_2026-11-27h`,
calls 1-2): the runs were bound by their kernels, not by the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["BATCH_RANGES", "GpuTimeline", "describe_gpu"]

#: running-row ranges a decode step's GPU time (and `bench_generate.StepTimer`'s host time) is averaged over
BATCH_RANGES = ((1, 8), (9, 32), (33, 96), (97, 192), (193, 100000))


class GpuTimeline:
    """Wraps `engine.runner.execute` and `engine.picker.pick` to record the events (see the module docstring);
    `summary()` reads them. A no-op where the engine's device is not CUDA. `event` makes an event (a timing
    `torch.cuda.Event`; a fake one in tests)."""

    def __init__(self, engine, event: Callable | None = None, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = engine.runner.device.type == "cuda"
        self.enabled = enabled
        self.marks: list[list] = []  # [start event, end event or None, rows, decode-only]
        if not enabled:
            return
        if event is None:
            import torch

            def event():
                return torch.cuda.Event(enable_timing=True)

        execute, pick = engine.runner.execute, engine.picker.pick

        def timed_execute(sched, *args, **kwargs):
            start = event()
            start.record()
            self.marks.append([start, None, len(sched.scheduled), sched.one_token_each])
            return execute(sched, *args, **kwargs)

        def timed_pick(*args, **kwargs):
            out = pick(*args, **kwargs)
            if self.marks and self.marks[-1][1] is None:
                end = event()
                end.record()
                self.marks[-1][1] = end
            return out

        engine.runner.execute, engine.picker.pick = timed_execute, timed_pick

    def summary(self) -> dict | None:
        """Seconds the GPU was busy with steps and idle between them (and how much of the idle time came before
        prefill-carrying steps: their planning), a decode step's mean GPU time in ms, overall and by running rows
        (`BATCH_RANGES`). None when not enabled. Call after the device is synchronised."""
        if not self.enabled:
            return None
        busy = idle = idle_before_prefill = 0.0
        decode: dict[tuple[int, int], list[float]] = {r: [] for r in BATCH_RANGES}
        previous_end = None
        for start, end, rows, decode_only in self.marks:
            if previous_end is not None:
                gap = max(0.0, previous_end.elapsed_time(start) / 1000)
                idle += gap
                if not decode_only:
                    idle_before_prefill += gap
            if end is not None:
                step = start.elapsed_time(end) / 1000
                busy += step
                if decode_only:
                    for lo, hi in BATCH_RANGES:
                        if lo <= rows <= hi:
                            decode[(lo, hi)].append(step)
            previous_end = end  # a step that picked nothing (beams, scoring only) leaves the next gap uncounted
        steps = [t for times in decode.values() for t in times]
        return {
            "gpu_busy_s": busy, "gpu_idle_s": idle, "gpu_idle_before_prefill_s": idle_before_prefill,
            "decode_gpu_ms": 1000 * float(np.mean(steps)) if steps else float("nan"),
            "decode_gpu_ms_by_rows": {f"{lo}-{hi}": {"steps": len(times), "gpu_ms": 1000 * float(np.mean(times))}
                                      for (lo, hi), times in decode.items() if times},
        }


def describe_gpu(system: str, summary: dict) -> str:
    """One line of `GpuTimeline.summary()` for a benchmark's printout."""
    by_rows = ", ".join(f"{k} rows {v['gpu_ms']:.2f}" for k, v in summary["decode_gpu_ms_by_rows"].items())
    return (f"{system}: GPU busy {summary['gpu_busy_s']:.2f} s, idle {summary['gpu_idle_s']:.3f} s between steps "
            f"({summary['gpu_idle_before_prefill_s']:.3f} s of it before prefill steps); a decode step's GPU time "
            f"{summary['decode_gpu_ms']:.2f} ms ({by_rows})")
