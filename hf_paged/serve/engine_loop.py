"""The loop that steps a served engine: the thread of one server process (`bridge.EngineBridge`) and the main thread
of each data-parallel replica process (`replica.Replica`) run this one loop.

Why one function: both must keep serving when a step fails outside its requests (the requests in flight fail, the
loop goes on), report requests aborted or finished outside steps while the engine is idle, and report what is left
when they stop; two copies of that drifted apart once already.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..engine import Engine, RequestOutput

__all__ = ["collect_outputs", "run_engine_loop"]

log = logging.getLogger("hf_paged.serve")


def collect_outputs(engine: Engine) -> list[RequestOutput]:
    """What an idle engine has to report (requests aborted or closed outside a step); [] if it cannot step."""
    try:
        return engine.step()
    except Exception:  # noqa: BLE001 - nothing in flight to fail: the caller only reports
        return []


def run_engine_loop(engine: Engine, wake: threading.Event, stopping: Callable[[], bool],
                    deliver: Callable[[list[RequestOutput]], None],
                    fail_all: Callable[[BaseException], None]) -> None:
    """Step `engine` while it has work, waiting on `wake` (at most 50 ms) while it has none, and hand every step's
    outputs to `deliver`; a step that raises outside its requests goes to `fail_all`. Returns once `stopping()` and
    the engine has nothing left, after delivering what it still reports."""
    while True:
        if stopping() and not engine.has_unfinished():
            break
        if not engine.has_unfinished():
            wake.wait(0.05)
            wake.clear()
            deliver(collect_outputs(engine))  # aborted requests are reported outside steps
            continue
        try:
            outs = engine.step()
        except Exception as error:  # noqa: BLE001 - the server must keep serving
            log.exception("engine step failed outside its requests")
            fail_all(error)
            continue
        deliver(outs)
    deliver(collect_outputs(engine))
