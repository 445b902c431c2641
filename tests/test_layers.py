"""The package's shape: imports point down the layers of docs/architecture.md, never up, and never in a circle.

Read from the source with `ast` (nothing is imported), so it is fast and also catches imports inside functions that
would only dodge a circle at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hf_paged"

# bottom to top; a module may import its own layer and the layers below it
LAYERS = ["core", "kernels", "cache", "attention", "runner", "engine", "integrations", "serve"]
# modules above every layer: the public package, test utilities, the architecture sweep and the lm-eval entry point
TOP = {"__init__", "testing", "model_zoo", "capabilities", "lm_eval"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(rel.parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    head = module.split(".")[0]
    if head in LAYERS:
        return LAYERS.index(head)
    assert head in TOP, f"hf_paged/{module.replace('.', '/')}.py belongs to no layer: add it to LAYERS or TOP"
    return len(LAYERS)


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The hf_paged modules (dotted, relative to hf_paged) an import statement loads."""
    targets: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "hf_paged" or alias.name.startswith("hf_paged."):
                targets.append(alias.name[len("hf_paged."):] if alias.name != "hf_paged" else "__init__")
        return targets
    if node.level == 0:
        if not (node.module or "").startswith("hf_paged"):
            return []
        base = node.module[len("hf_paged"):].lstrip(".").split(".") if node.module != "hf_paged" else []
    else:
        parts = module.split(".")[:-1]  # the package holding `module` ("a.b.c" and "a.b.__init__" are both in a.b)
        up = node.level - 1
        base = parts[: len(parts) - up] if up else parts
        if node.module:
            base = base + node.module.split(".")
    name = ".".join(base)
    names_from_module = False  # `from pkg import attr` (not a submodule) loads pkg itself
    for alias in node.names:
        sub = f"{name}.{alias.name}" if name else alias.name
        if sub in MODULES:
            targets.append(sub)
        elif f"{sub}.__init__" in MODULES:
            targets.append(f"{sub}.__init__")
        else:
            names_from_module = True
    if names_from_module:
        targets.append(name if name in MODULES else (f"{name}.__init__" if name else "__init__"))
    return sorted(set(targets))


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(target module, line, inside a function) for every hf_paged import of `module`."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, child):
                    found.append((target, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def test_every_module_has_a_layer_and_a_docstring() -> None:
    for module, path in MODULES.items():
        _layer(module)
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"hf_paged/{path.relative_to(ROOT)} has no module docstring saying its job"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    mine = _layer(module)
    for target, line, in_function in _imports(module):
        if target == module:
            continue
        theirs = _layer(target)
        assert not in_function, (
            f"hf_paged/{module.replace('.', '/')}.py:{line} imports hf_paged.{target} inside a function: "
            "import at module level (an import inside a function hides a circle)"
        )
        assert theirs <= mine, (
            f"hf_paged/{module.replace('.', '/')}.py:{line} imports hf_paged.{target}, a higher layer "
            f"({LAYERS[mine] if mine < len(LAYERS) else 'top'} -> {LAYERS[theirs] if theirs < len(LAYERS) else 'top'})"
        )


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _, _ in _imports(m) if t != m} for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            dfs(module)


def test_the_check_sees_an_upward_import(tmp_path) -> None:
    """The checker itself: a core module importing the engine is reported (so the tests above can fail)."""
    module = "core.__probe__"
    MODULES[module] = tmp_path / "probe.py"
    MODULES[module].write_text('"""probe"""\nfrom ..engine import Engine\n')
    try:
        with pytest.raises(AssertionError, match="higher layer"):
            test_imports_point_down(module)
    finally:
        del MODULES[module]


# core modules that may use numpy, imported inside a function (or for type checkers) only: the pipelined decode rows
# (their arrays cut the per-step host work at 256 requests by a third); the block manager, the scheduler and the
# sequences import nothing but the standard library
CORE_NUMPY_INSIDE_FUNCTIONS = {"core.decode_batch"}


def test_core_needs_no_torch() -> None:
    for module in MODULES:
        if module.startswith("core."):
            tree = ast.parse(MODULES[module].read_text())
            inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) or (  # or for type checkers
                isinstance(f, ast.If) and getattr(f.test, "id", None) == "TYPE_CHECKING") for n in ast.walk(f)}
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                banned = ("torch", "transformers") if module in CORE_NUMPY_INSIDE_FUNCTIONS and id(node) in inside \
                    else ("torch", "numpy", "transformers")
                assert not any(n.split(".")[0] in banned for n in names), (
                    f"hf_paged/{module.replace('.', '/')}.py imports {names}: core is pure Python")


MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300


def test_rooms_stay_small() -> None:
    """No module over ~500 lines; no class over ~300 unless its docstring says why it is one class."""
    for path in MODULES.values():
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= MAX_FILE_LINES * 1.1, f"hf_paged/{path.relative_to(ROOT)} has {lines} lines: split it by job"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > MAX_CLASS_LINES * 1.05:
                doc = ast.get_docstring(node) or ""
                assert "Why one class" in doc or "mixins" in doc, (
                    f"class {node.name} of hf_paged/{path.relative_to(ROOT)} has {node.end_lineno - node.lineno} "
                    "lines and no reason at its top ('Why one class ...')")


def test_the_architecture_page_stays_a_map():
    """docs/architecture.md is the module map and one step's data flow, at most 15 KB (issue 52): the detail belongs
    in the modules' docstrings, which its last table points to."""
    page = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
    assert len(page.read_bytes()) <= 15_000, f"{page} is {len(page.read_bytes())} bytes"
