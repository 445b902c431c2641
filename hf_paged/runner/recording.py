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

The streams recordings run on are lent here too (`lend_stream`), one per live runner, and taken back when the runner
closes or is dropped. Why: cuBLAS keeps a workspace for every stream it has run a GEMM on (33 MiB on an H100 with
torch's defaults), for the life of the process. torch frees them only all together
(`torch._C._cuda_clearCublasWorkspaces`), which would take the memory from under the live graphs recorded with them.
A runner that took a fresh stream from torch's pool (`torch.cuda.Stream()`, 32 streams round robin) left its 33 MiB
behind when its model was dropped, so a notebook that switched models grew by that much each time, up to ~1 GiB.
A stream taken back is lent to the next runner; two live runners never share one, so one's warm-up forwards never run
on a stream another is recording on.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["CAPTURE_ERROR_MODE", "RECORDING", "device_synchronize", "empty_cache", "lend_stream"]

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


_FREE_STREAMS: dict[int, list[torch.cuda.Stream]] = {}  # device index -> streams no live runner holds
_STREAMS_LOCK = threading.Lock()


def lend_stream(owner: object, device: torch.device) -> tuple[torch.cuda.Stream, weakref.finalize]:
    """A stream for `owner`'s recordings on `device`: one a closed or dropped runner gave back, else a new one.

    Returned with the finalizer that gives it back: it runs when `owner` is garbage, or when called (a closing
    runner calls it; a later recording of the same runner borrows again). Work queued on the stream before it is
    given back stays ordered before the next borrower's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        free = _FREE_STREAMS.get(index)
        stream = free.pop() if free else None
    if stream is None:
        stream = torch.cuda.Stream(index)
    give_back = weakref.finalize(owner, _give_back, index, stream)
    give_back.atexit = False
    return stream, give_back


def _give_back(index: int, stream: torch.cuda.Stream) -> None:
    with _STREAMS_LOCK:
        _FREE_STREAMS.setdefault(index, []).append(stream)
