"""Compiled steps kept on disk (sala/engine/graph_store.py): an engine loads the graph another
compiled instead of compiling it, and decodes what the eager engine decodes; a saved graph
whose guards fail on the step at hand (one compiled for another pool) is ignored with a log
line and the step compiled again, never run."""
import logging
import shutil

import pytest

from sala.engine import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The for statement", "def f(x):", "import"]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 40, 90)]


def tokens(engine: Engine) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]


def test_an_engine_loads_the_step_another_compiled_and_refuses_a_foreign_one(tiny_sala_dir, caplog):
    caplog.set_level(logging.INFO, logger="sala.engine")
    eager = tokens(Engine.from_pretrained(tiny_sala_dir, compile=False))
    first = Engine.from_pretrained(tiny_sala_dir)
    assert tokens(first) == eager  # compiled, or loaded from an earlier run: saved either way
    caplog.clear()

    # Steps keep their graphs to themselves: a second engine finds the first one's on disk.
    second = Engine.from_pretrained(tiny_sala_dir)
    assert tokens(second) == eager
    assert "loaded the saved graph of the decode step" in caplog.text and "compiled the" not in caplog.text
    caplog.clear()

    # The graph for this pool, put where an engine with a smaller pool looks for its own.
    step = second.decoding.fast_decode
    symbols = next(iter(step.graphs))
    other = Engine.from_pretrained(tiny_sala_dir, memory_bytes=second.config.memory_bytes // 2)
    target = other.decoding.fast_decode.store.path(symbols, step.spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(step.store.path(symbols, step.spec), target)
    assert tokens(other) == eager
    refused = [r.getMessage() for r in caplog.records if "ignoring the compiled graph" in r.getMessage()]
    assert len(refused) == 1 and "guards fail" in refused[0], caplog.text
    assert "compiled the decode step" in caplog.text and not other.decoding.fast_decode.failed
    print(refused[0])
