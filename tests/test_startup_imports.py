"""What a process that serves or quantizes imports: never transformers' model, generation or Auto
code, which cost seconds of every Serve replica's start (a recovery's most) and of every quantize
worker's (sala/hf.py holds what needs them). Checked in a fresh interpreter doing what a replica
and a quantize worker do: serve.server imported, an engine loaded from tiny-sala, a decoder layer
read from its shards. Dynamo (1.1-1.4 s of CPU a process) is imported only where a step is
compiled or a compiled one loaded: never by an engine with compile=False, nor by a quantize
worker."""
import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("transformers.modeling_utils", "transformers.generation.utils", "transformers.models.auto.modeling_auto",
         "transformers.models.auto.tokenization_auto", "sklearn", "torch._dynamo")


def test_serving_and_quantizing_import_no_transformers_model_code(tiny_sala_dir):
    code = f"""
import json, sys
import serve.server
from sala.checkpoint import CheckpointReader
from sala.engine import Engine, SamplingParams
engine = Engine.from_pretrained({str(tiny_sala_dir)!r}, compile=False)
assert engine.generate(["The for statement"], SamplingParams(max_tokens=2))[0].token_ids
CheckpointReader({str(tiny_sala_dir)!r}).layer(0)
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_a_quantize_worker_imports_no_dynamo(tiny_sala_dir):
    """A LayerWorker's own call (pipelines/layer_pool.py) for a Linear of layer 1: the checkpoint
    opened, layer 0 read and run to bring the hidden states to layer 1, then layer 1's Hessian and
    GPTQ."""
    code = f"""
import sys, torch
from pipelines.layer_pool import Job, LayerWorker
from sala.checkpoint import CheckpointReader
worker = LayerWorker.__new__(LayerWorker)  # the actor's class without Ray: its __init__ asks Ray for its CPUs
worker.device, worker.reader = torch.device("cpu"), CheckpointReader({str(tiny_sala_dir)!r}, verify=False)
worker.h, worker.layer, worker.hessians = [worker.reader.embeddings(torch.arange(64).reshape(2, 32), torch.float32)], 0, {{}}
job = Job(layer=1, group=("mlp.gate_proj", "mlp.up_proj"), module="mlp.up_proj", site="mlp_in", cost=0)
blob, stats = worker.quantize(job, {{"method": "gptq"}}, None)
assert blob and stats["mlp.up_proj"], stats
print("torch._dynamo" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "False"
