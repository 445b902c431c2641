"""Whether Triton runs its kernels in the interpreter (`TRITON_INTERPRET`), read the way Triton itself reads it.

Why one helper: the backend check, the parallel JIT and the sampler each used to parse the variable their own way
(one took "false" for on, another took "yes" for off), so they could disagree with Triton, and with one another,
about the same environment. Triton decides when a kernel is decorated (its module's import), so the variable must be
set before the first kernel call.
"""

from __future__ import annotations

import os

__all__ = ["triton_interpreting"]

#: the values Triton's boolean knobs take for true, case aside (where its `knobs` module cannot be read)
_TRUE = ("1", "true", "yes", "on", "y")


def triton_interpreting() -> bool:
    """True when `TRITON_INTERPRET` asks Triton for its interpreter, as Triton's own `knobs.runtime.interpret` reads
    it (Triton >= 3.4), else by the same rule; False without Triton."""
    try:
        from triton import knobs
    except Exception:  # no triton, or one without `knobs`
        return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE
    return bool(knobs.runtime.interpret)
