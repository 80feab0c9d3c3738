"""The two kinds of failure the command line reports in one line (coordinator/cli/__init__.py):

    UserError     bad input: flags, config files, traces, checkpoints, paths. Exit 2. Raised before anything
                  is written wherever the input can be checked up front (coordinator/runsetup.py).
    RunFailure    the run itself failed in a way the user can act on (diverged, broker gone for too long).
                  Exit 1.

Anything else is a bug: one line, exit 1, and the traceback in `crash.log` of the run directory (or a
temporary file before the run directory exists); `--debug` shows the traceback instead.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """Bad input from the user: printed as one line (naming the option) and exit code 2, no traceback."""


class RunFailure(Exception):
    """A run failed for a reason the user can act on: one line, exit code 1."""


# The run directory of the command in progress, once it exists: where a crash log goes.
current_run_dir: Path | None = None
