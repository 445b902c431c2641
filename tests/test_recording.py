"""The recording lock (`hf_paged.runner.recording`): graphs are recorded while other engines of the process serve,
and a device-wide sync from any thread during a recording fails it (the CUDA test of two engines is in
`test_ragged_graphs.py`). What must hold on any machine: hf-paged syncs the device only through the lock, and a sync
waits for a recording in another thread to end."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import torch

from hf_paged.runner import recording

ROOT = Path(__file__).resolve().parents[1] / "hf_paged"
DEVICE_WIDE = {"synchronize", "empty_cache"}


def _device_wide_calls(path: Path) -> list[str]:
    """`torch.cuda.synchronize(...)` / `torch.cuda.empty_cache()` calls in a module, as `file:line`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DEVICE_WIDE:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "cuda" and getattr(owner.value, "id", "") == "torch":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_package_syncs_the_device_only_through_the_recording_lock():
    calls = [call for path in sorted(ROOT.rglob("*.py")) if path.name != "recording.py"
             for call in _device_wide_calls(path)]
    assert calls == [], f"device-wide syncs outside hf_paged/runner/recording.py (use recording.device_synchronize): {calls}"
    assert len(_device_wide_calls(ROOT / "runner" / "recording.py")) == 2


def test_a_device_sync_waits_for_a_recording_in_another_thread(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    recording_started = threading.Event()

    def record() -> None:
        with recording.RECORDING:
            recording_started.set()
            time.sleep(0.2)
            events.append("recording ended")

    recorder = threading.Thread(target=record)
    recorder.start()
    recording_started.wait(5)
    syncer = threading.Thread(target=lambda: (recording.device_synchronize("cuda"), recording.empty_cache()))
    syncer.start()
    recorder.join(5)
    syncer.join(5)
    assert events == ["recording ended", "sync", "empty_cache"]
    with recording.RECORDING:  # re-entrant: a failed recording's clean-up syncs the device while it holds the lock
        recording.device_synchronize("cuda")
    assert events[-1] == "sync"
