"""One process-wide lock between CUDA graph recordings and device-wide syncs, for engines that share a process.

Why: graphs are recorded while serving, not only at warm-up: a ragged step's token bucket at its second run
(`hf_paged.runner.ragged_graphs`), a decode bucket after a weight change dropped the graphs. A recording is a stream
capture, and while any stream of the device is being captured:

* under `capture_error_mode="global"`, any thread's potentially unsafe call (an allocation, a synchronous copy)
  fails. So recordings use "thread_local" (`CAPTURE_ERROR_MODE`): only the recording thread's own calls are checked,
  and another engine's allocations, uploads and stream or event syncs go on;
* a device-wide sync (`torch.cuda.synchronize()`, `torch.cuda.empty_cache()`) from any thread still fails, and it
  invalidates the recording with it. Every recording holds `RECORDING`, and every device-wide sync hf-paged makes goes
  through `device_synchronize` / `empty_cache`, which take it too: an engine warming up (its syncs, its own
  recordings) waits for another engine's recording to end instead of failing it.

A device-wide sync in the user's own code, in another thread, during a recording is not covered: a server that also
trains in another thread should sync streams or events, not the device.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["CAPTURE_ERROR_MODE", "RECORDING", "device_synchronize", "empty_cache"]

#: how a recording guards against unsafe CUDA calls: only the recording thread's own calls are checked (see above)
CAPTURE_ERROR_MODE = "thread_local"

#: held by every graph recording and every device-wide sync of hf-paged, in any thread (re-entrant: a failed
#: recording's clean-up syncs the device)
RECORDING = threading.RLock()


def device_synchronize(device: torch.device | str | None = None) -> None:
    """`torch.cuda.synchronize(device)`, never during another thread's recording."""
    with RECORDING:
        torch.cuda.synchronize(device)


def empty_cache() -> None:
    """`torch.cuda.empty_cache()`, never during another thread's recording."""
    with RECORDING:
        torch.cuda.empty_cache()
