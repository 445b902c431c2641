"""`pytest --module-coverage`: the run fails unless every hf_paged module was exercised.

`make test-fast` runs a selection of the suite (`-m "not slow"`); this check keeps that selection honest. A module
counts as exercised when the run imported it and executed at least one line inside one of its functions (a module
without functions, such as a package `__init__` that only re-exports, counts once imported). Lines are recorded by
coverage.py's C tracer, limited to the hf_paged package, in the process that runs the tests: each pytest-xdist worker
reports what it saw and the controller takes the union. Code that only runs in a subprocess a test starts (a server,
`torchrun` ranks) does not count.

Tracing every line of the engine made the quick suite 40% slower, and one line per module is all the check needs: every
few seconds (between tests) the modules already exercised stop being traced (their entries in coverage's
should-trace cache are turned off), so after the first minutes almost nothing is traced.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import time

import pytest

PACKAGE = "hf_paged"
_OUTPUT_KEY = "hf_paged_exercised_modules"
_PRUNE_EVERY_S = 5.0


def package_root() -> pathlib.Path:
    """The hf_paged directory that `import hf_paged` would load, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{PACKAGE} is not importable")
    return pathlib.Path(next(iter(spec.submodule_search_locations))).resolve()


def package_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every .py file of the package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


@functools.cache
def function_body_lines(path: pathlib.Path) -> frozenset[int]:
    """Line numbers of the statements inside the module's functions and methods (nested ones included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in node.body:
                for inner in ast.walk(statement):
                    if isinstance(inner, ast.stmt):
                        lines.add(inner.lineno)
    return frozenset(lines)


def exercised(path: pathlib.Path, executed: set[int]) -> bool:
    body = function_body_lines(path)
    return bool(executed & body) if body else bool(executed)


class ModuleCoverage:
    """The plugin: records in every process that runs tests, judges in the one that reports."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.root = package_root()
        self.modules = package_modules(self.root)
        self.is_worker = hasattr(config, "workerinput")
        self.seen: set[str] = set()
        self.coverage = None
        self.missing: list[str] | None = None
        self.by_path = {str(path.resolve()): name for name, path in self.modules.items()}
        self.last_prune = time.monotonic()

    # ------------------------------------------------------------------ recording (a worker, or a run without xdist)
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self._distributing():
            return  # the controller of an xdist run runs no test
        import coverage

        self.coverage = coverage.Coverage(data_file=None, source=[str(self.root)], branch=False, config_file=False)
        self.coverage.start()

    def _collect(self) -> set[str]:
        """Add the modules exercised so far to `seen`; returns the source files of the ones new to it."""
        data = self.coverage.get_data()
        new = set()
        for filename in data.measured_files():
            name = self.by_path.get(str(pathlib.Path(filename).resolve()))
            if name is None or name in self.seen:
                continue
            if exercised(self.modules[name], set(data.lines(filename) or ())):
                self.seen.add(name)
                new.add(str(self.modules[name]))
        return new

    def pytest_runtest_logfinish(self) -> None:
        if self.coverage is None or time.monotonic() - self.last_prune < _PRUNE_EVERY_S:
            return
        done = self._collect()
        # coverage.py's tracers look each new frame's file up in this cache (shared by every thread's tracer) and
        # trace it only while the entry's `trace` is true; without the cache (another coverage.py) nothing is pruned
        cache = getattr(getattr(self.coverage, "_collector", None), "should_trace_cache", None) or {}
        for disposition in list(cache.values()):
            if disposition is not None and getattr(disposition, "trace", False):
                source = disposition.source_filename or disposition.canonical_filename
                if str(pathlib.Path(source).resolve()) in done:
                    disposition.trace = False
        self.last_prune = time.monotonic()

    def _record(self) -> None:
        if self.coverage is None:
            return
        self.coverage.stop()
        self._collect()
        self.coverage = None

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus):
        self._record()
        if self.is_worker:
            self.config.workeroutput[_OUTPUT_KEY] = sorted(self.seen)
        else:
            self.missing = sorted(set(self.modules) - self.seen)
            if self.missing and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        yield

    # ------------------------------------------------------------------ the controller of an xdist run
    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.seen.update(getattr(node, "workeroutput", {}).get(_OUTPUT_KEY, ()))

    def _distributing(self) -> bool:
        return not self.is_worker and getattr(self.config.option, "dist", "no") != "no"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.missing is None:
            return
        total = len(self.modules)
        if self.missing:
            terminalreporter.write_sep("=", f"module coverage: {len(self.missing)} of {total} hf_paged modules "
                                            "not exercised", red=True)
            for name in self.missing:
                terminalreporter.write_line(f"  {name}")
        else:
            terminalreporter.write_line(f"module coverage: all {total} hf_paged modules exercised")
