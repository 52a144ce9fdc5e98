"""How sala's command lines end: as `sys.exit` would, less the interpreter's teardown.

Every exit handler still runs: Ray's shutdown (which stops the Ray a command started), MLflow's
and logging's flushes. What is skipped is the interpreter's teardown after them, which
deallocates every type torch, transformers and Ray registered: pybind11 looks each one up in
its type registry as it goes. On one core of a 2-core Xeon that takes 1.5 s for a process
that only imported `sala.engine` and about 3 s for one that quantized tiny-sala, and it frees
nothing the operating system does not free at exit anyway.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """End the process with `code` (None: 0) once its threads and exit handlers are done."""
    # What the interpreter does first at exit: threading's own exit callbacks (a thread pool left
    # open is told to stop there), then a wait for every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed
            pass
    os._exit(code or 0)
