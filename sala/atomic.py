"""One file written so that a reader sees the old file or the whole new one, never a part:
a temporary name beside it, fsync, rename. No torch here: the numpy-only evaluation client uses it."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def write_atomically(path: Path, write: Callable[[IO], None], mode: str = "wb") -> Path:
    """Call write(f) on a temporary file beside `path`, make it durable, then rename it to `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
