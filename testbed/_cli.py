"""What every command line of the testbed does the same way (stdlib only: the audit uses it).

- Ctrl-C anywhere outside a command's own handling is one line on stderr and exit 130;
- a closed stdout (``python -m testbed.audit evidence | head -1``) ends the command silently,
  as ``cat`` or ``grep`` do, instead of a BrokenPipeError traceback.
"""

from __future__ import annotations

import os
import sys

__all__ = ["entry", "interrupted"]


def interrupted(what: str = "") -> int:
    print(f"interrupted{': ' + what if what else ''}", file=sys.stderr, flush=True)
    return 130


def _stdout_gone() -> int:
    # Python flushes stdout once more at exit; point it at /dev/null so that flush cannot fail too.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 1


def entry(main, argv=None) -> int:
    """Run ``main(argv)`` with the two conventions above; returns the exit code."""
    try:
        code = main(argv)
        sys.stdout.flush()  # a broken pipe shows up here when the output was buffered
        return code
    except KeyboardInterrupt:
        return interrupted()
    except BrokenPipeError:
        return _stdout_gone()
