"""Test-session set-up that must happen before anything imports torch's thread pools or triton.

* Without CUDA, the Triton kernels run under Triton's interpreter. `TRITON_INTERPRET` is read when `@triton.jit`
  functions are first created, so it must be set before any test module imports `hf_paged.kernels`' Triton files.
* Under pytest-xdist (`make test` runs `-n auto`), each worker gets an equal share of the cores for torch's
  intra-op pool: one thread each on the 2-core CI machine. Two workers with two OpenMP threads each oversubscribe the
  cores, and then every parallel region waits for a descheduled thread: a SmolLM2 decode step went from 0.1 s to
  2.5 s that way on a busy machine. Set `HF_PAGED_TEST_THREADS` to override the share.
* Triton's interpreter skips re-patching `triton.language` on every helper call (tests/interpreter_speedup.py; set
  `HF_PAGED_TEST_INTERPRETER_SPEEDUP=0` to run it unchanged).
* Without CUDA the compiled step compiles through AOT autograd alone (`HF_PAGED_COMPILE_BACKEND=aot_eager`,
  `hf_paged.runner.sibling_linears.COMPILE_BACKEND`): the same capture and graph passes without Inductor's C++ code
  generation, which took minutes of a cold CI run; tests marked `inductor` compile with Inductor.
* `--module-coverage` (used by `make test-fast`) fails the run when an hf_paged module was not exercised
  (tests/module_coverage.py says how that is measured).

Everything loads local weights only (no hub access).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _threads_per_worker() -> int | None:
    """Intra-op threads for this process: None (torch's default) outside xdist."""
    if os.environ.get("HF_PAGED_TEST_THREADS"):
        return max(1, int(os.environ["HF_PAGED_TEST_THREADS"]))
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(workers))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    # before torch starts its OpenMP pool; subprocesses the tests start (servers, examples) inherit the share too
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    os.environ["MKL_NUM_THREADS"] = str(_THREADS)

try:
    import torch

    _has_cuda = torch.cuda.is_available()
    if _THREADS is not None:
        torch.set_num_threads(_THREADS)
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the compiled step through Dynamo and AOT autograd without Inductor's code generation (a C++ compile of every
    # tiny graph: minutes of a cold CI run); the tests marked `inductor` run it (`_compile_backend`)
    os.environ.setdefault("HF_PAGED_COMPILE_BACKEND", "aot_eager")

try:
    from tests import interpreter_speedup, module_coverage
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir insertion)
    import interpreter_speedup
    import module_coverage

if not _has_cuda and os.environ.get("HF_PAGED_TEST_INTERPRETER_SPEEDUP", "1") != "0":
    interpreter_speedup.install()


@pytest.fixture(autouse=True)
def _compile_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `inductor` compiles with Inductor, whatever `HF_PAGED_COMPILE_BACKEND` says."""
    if request.node.get_closest_marker("inductor") is not None:
        from hf_paged.runner import sibling_linears

        monkeypatch.setattr(sibling_linears, "COMPILE_BACKEND", "inductor")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-coverage",
        action="store_true",
        help="fail the run if an hf_paged module was not exercised (imported, and a function of it run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--module-coverage"):
        config.pluginmanager.register(module_coverage.ModuleCoverage(config), "hf_paged_module_coverage")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist: the slow tests first, and `xdist_group` honoured.

    The workers take tests in collection order, so a long test collected last (the scheduler's long state machine,
    the soak run, the tensor-parallel launches sit late in the alphabet) would run alone at the end while the other
    worker idles; started first, the short tests fill in around them. The order within the slow tests and within the
    others stays the collection order (a stable sort).

    `--dist loadgroup` (pytest-xdist 3.8) tags the node id of a test marked `xdist_group` with `@<group>`, and the
    scheduler keeps one tag's tests on one worker; it writes the tag to `item._nodeid`, which pytest 9 no longer reads
    (node ids live in `item._id`), so the groups were silently ignored. Tag them where pytest 9 reads the id."""
    if not hasattr(config, "workerinput"):
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not config.getvalue("loadgroup"):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9: xdist's own tag works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)
