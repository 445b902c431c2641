"""Latency tracing for a server process (benchmarks only): put this directory on PYTHONPATH (bench_serving.py
`--trace` does) and the process logs, to stderr, every Triton JIT compilation and every engine step slower than
HF_PAGED_TRACE_SLOW_MS (default 50) with what the step held. Used to find where p99 TTFT outliers come from.
"""

import os
import sys
import time

os.environ.setdefault("TORCH_LOGS", "recompiles")
_T0 = time.perf_counter()
_COMPILES = [0]


def _log(msg: str) -> None:
    print(f"[trace {time.perf_counter() - _T0:9.3f}] {msg}", file=sys.stderr, flush=True)


def _install() -> None:
    try:
        from triton import knobs
    except ImportError:
        return

    def on_compile(*, repr, **_kw):  # noqa: A002 (triton's keyword)
        _COMPILES[0] += 1
        _log(f"triton compile: {repr[:400]}")
        return False

    knobs.runtime.jit_cache_hook = on_compile

    from hf_paged.engine.engine import Engine

    slow_ms = float(os.environ.get("HF_PAGED_TRACE_SLOW_MS", "50"))
    step = Engine.step
    last_end = [None]

    def traced_step(self, *args, **kwargs):
        before = _COMPILES[0]
        sched = self.scheduler
        waiting, running = len(sched.waiting), len(sched.running)
        start = time.perf_counter()
        gap = None if last_end[0] is None else (start - last_end[0]) * 1000
        outs = step(self, *args, **kwargs)
        end = time.perf_counter()
        last_end[0] = end
        ms = (end - start) * 1000
        compiles = _COMPILES[0] - before
        if ms > slow_ms or compiles:
            _log(f"slow step {ms:.1f} ms (gap before {gap if gap is None else round(gap, 1)} ms): "
                 f"waiting {waiting} running {running} static {self.runner.last_static} outputs {len(outs)} "
                 f"triton compiles {compiles}")
        for out in outs:  # requests whose first token came in this step, late
            first, arrival = out.metrics.get("first_token_time"), out.metrics.get("arrival_time")
            if first is not None and arrival is not None and first >= start and (first - arrival) * 1000 > slow_ms:
                _log(f"request {out.request_id}: {(first - arrival) * 1000:.1f} ms from add_request to first token "
                     f"({len(out.prompt_token_ids)} prompt tokens)")
        if gap is not None and gap > slow_ms and (waiting or running):
            _log(f"engine idle {gap:.1f} ms with waiting {waiting} running {running}")
        return outs

    Engine.step = traced_step
    _log("tracing installed")


try:
    _install()
except Exception as error:  # tracing must never stop the server
    _log(f"tracing not installed: {error!r}")
