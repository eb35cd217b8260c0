"""The command line (and a free port) that starts forklm's CLI in a child process (DP replicas, `sgl.Runtime`'s
server, benchmark servers).

The child runs this interpreter with `-P` (Python 3.11+): its sys.path does not start with its
working directory, so it imports the forklm (and the dependencies) that this process imports,
whatever folder it was started in; a checkout's root or a user's project folder holding a
`forklm/`, `runtime/` or `kernels/` never stands in for an installed package there.
"""

from __future__ import annotations

import socket
import sys


def forklm_command(*args: str) -> list[str]:
    """argv of `python -m forklm *args` with this interpreter, its working directory off sys.path."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "forklm", *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a child server to listen on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
