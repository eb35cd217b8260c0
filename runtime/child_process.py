"""The command line that starts forklm's CLI in a child process (DP replicas, `sgl.Runtime`'s
server, benchmark servers).

The child runs this interpreter with `-P` (Python 3.11+): its sys.path does not start with its
working directory, so it imports the forklm (and the dependencies) that this process imports,
whatever folder it was started in; a checkout's root or a user's project folder holding a
`forklm/`, `runtime/` or `kernels/` never stands in for an installed package there.
"""

from __future__ import annotations

import sys


def forklm_command(*args: str) -> list[str]:
    """argv of `python -m forklm *args` with this interpreter, its working directory off sys.path."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "forklm", *args]
