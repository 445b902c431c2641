"""Test-session set-up that must happen before anything imports triton.

Without CUDA, the Triton kernels run under Triton's interpreter. `TRITON_INTERPRET` is read when `@triton.jit`
functions are first created, so it must be set before any test module imports `hf_paged.kernels`' Triton files.
Everything loads local weights only (no hub access).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
