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


def test_a_model_quantized_or_cast_in_memory_has_graphs_of_its_own(tiny_sala_dir):
    """A model quantized or cast in memory keeps its config, and a graph's guards fail on the
    other's modules: the structure of the modules a step runs keys its graphs apart (else each
    engine replaces the other's graph on disk, and both compile again at every start)."""
    import copy

    import torch
    from torch.utils import _pytree as pytree

    from sala.engine.graph_store import GraphStore
    from sala.quant.layerwise import apply_quantized, layer_modules
    from sala.quant.nvfp4 import quantize_rtn

    engine = Engine.from_pretrained(tiny_sala_dir, compile=False)
    model = engine.model
    quantized = copy.deepcopy(model)
    layer = quantized.model.layers[0]
    apply_quantized(layer, {name: quantize_rtn(layer.get_submodule(name).weight.detach(), "4over6")
                            for name in layer_modules(layer)}, packed=True)
    spec = pytree.tree_flatten((torch.zeros(2),))[1]

    def path(*modules):
        return GraphStore("CompiledDecode", engine.config, modules).path((0,), spec)

    assert path(copy.deepcopy(model)) == path(model)  # the same structure finds the same file
    assert len({path(model), path(quantized), path(copy.deepcopy(model).to(torch.bfloat16))}) == 3
    assert path(model) != path(model, torch.nn.Linear(2, 2))  # a step that also runs other modules
