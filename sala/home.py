"""$SALA_HOME, where sala keeps what it builds and caches (tiny-sala, quantized checkpoints, the
default MLflow store). Standard library only: a scoring client that never loads torch needs it."""
from __future__ import annotations

import os
from pathlib import Path


def sala_home() -> Path:
    return Path(os.environ.get("SALA_HOME", Path.home() / ".cache" / "sala")).expanduser().absolute()
