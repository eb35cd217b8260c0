"""How libgomp (torch's OpenMP runtime, which the C kernels share) will wait, read from the
environment it loads with. No torch here: runtime/cpu_threads.py uses it before torch loads."""

from __future__ import annotations

import os
from collections.abc import Mapping


def threads_spin(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether OpenMP threads started with `environ` spin while they wait, as libgomp reads it:
    GOMP_SPINCOUNT decides when set, else PASSIVE means sleep at once, else they spin."""
    count = environ.get("GOMP_SPINCOUNT", "").strip()
    if count:
        return count != "0"
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"
