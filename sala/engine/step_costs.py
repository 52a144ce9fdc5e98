"""The step times a Medusa engine's tree choice measured, kept on disk across starts.

What a step costs depends on the model's shapes and weight format (its config), the heads'
shapes and tree (their config), the device and its kind, the dtype, torch's thread count and
the engine settings that change a step (compiled or not, the cache plan, the page size, the
state pool's size). Those make the key: `$SALA_HOME/step_costs/<hash of the key>.json` holds
the key, the times and the heads' acceptance scales (one a kind of batch), each with the steps
it came from (sala/engine/tree_choice.py), so a second start, a restarted replica and every
batch actor after the first begin with the choice made, and a changed key measures again. A file
that cannot be read, or holds another key, is ignored with a log line: the times are measured
again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from sala.home import sala_home

log = logging.getLogger(__name__)


def device_kind(device: torch.device) -> str:
    """The device as its speed depends on it: the GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    name = platform.processor()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu {name} x{os.cpu_count()}"


# The file's layout, in its key: a file of another layout has another name, so code that reads one
# layout never reads the other's rows (as numbers of another meaning).
LAYOUT = 2  # acceptance rows [kind, scale, steps]


def cost_key(config, heads_config, dtype: torch.dtype) -> dict:
    """What a Medusa engine's step costs depend on (config: the resolved EngineConfig; dtype: the model's)."""
    return {"layout": LAYOUT, "model": config.model.to_dict(), "heads": dataclasses.asdict(heads_config),
            "device": device_kind(config.device), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "compiled": config.compiled, "kv_plan": config.kv_plan.describe(),
            "page_size": config.page_size, "max_seqs": config.max_seqs}


class StepCosts:
    """The file of one key: `load` what it holds, `save` new times."""

    def __init__(self, key: dict, home: Path | None = None):
        self.key = json.loads(json.dumps(key, sort_keys=True, default=str))  # as it reads back
        # Encoded once: the heads' tree makes it tens of KB, and a save comes in the middle of a step.
        self.key_json = json.dumps(self.key, sort_keys=True)
        digest = hashlib.sha256(self.key_json.encode()).hexdigest()[:20]
        self.path = (home or sala_home()) / "step_costs" / f"{digest}.json"

    def load(self) -> tuple[list[list], list[list]]:
        """The step times ([kind, size class, nodes, ms] rows: TreeChoice.step_ms) and acceptance
        scales (TreeChoice.kept) kept; none when there is no file, or it cannot be used."""
        if not self.path.is_file():
            return [], []
        try:
            data = json.loads(self.path.read_text())
            if data["key"] != self.key:
                raise ValueError("it holds another key")
            times = [[str(kind), int(cls), int(nodes), float(ms)] for kind, cls, nodes, ms in data["step_ms"]]
            kept = [[str(kind), float(scale), int(steps)] for kind, scale, steps in data["acceptance"]]
            if not all(ms > 0 for *_, ms in times) or not all(scale >= 0 and steps > 0 for *_, scale, steps in kept):
                raise ValueError("a step time or acceptance is out of range")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the Medusa step costs in %s (%s: %s); measuring them again", self.path,
                        type(e).__name__, e)
            return [], []
        log.info("Medusa step costs read from %s", self.path)
        return times, kept

    def save(self, times: list[list], kept: list[list]) -> None:
        """Write them (atomically: a reader sees the old file or the new one); a failure is logged."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                f.write(f'{{"key": {self.key_json}, "step_ms": {json.dumps(times)}, "acceptance": {json.dumps(kept)}}}')
            os.replace(f.name, self.path)
        except OSError as e:
            log.warning("could not save the Medusa step costs to %s: %s", self.path, e)
