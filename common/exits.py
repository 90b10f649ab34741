"""Exit codes of every elasticfed command, and the one way a command reports an error.

Why one place: scripts and supervisors (systemd, Kubernetes, torchrun) act on the code, so a
code must mean one thing whichever command returns it.  The README lists them (Exit codes).
"""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_FAILED = 1  # the run ended without doing what it should: an audit mismatch, an edge or rank failed
EXIT_USAGE = 2  # refused before anything started: a setting, a file, a key, a port, a contradiction
EXIT_SYNC_FAILED = 3  # cloud training: a collective failed or timed out (a rank died, a link broke)
EXIT_REFUSED = 4  # an edge the gateway refuses for good: wrong model, revoked key, another identity
EXIT_DIVERGED = 5  # the gateway's model went non-finite or its loss exploded: not served, not saved
EXIT_NOT_BUILT = 69  # a subcommand that exists only as a plan (sysexits EX_UNAVAILABLE)


def fail(command: str, message: str, code: int = EXIT_USAGE) -> int:
    """Say what was wrong, naming the command, on stderr; the code to exit with."""
    print(f"elasticfed {command}: error: {message}", file=sys.stderr)
    return code
