"""What a process that serves or quantizes imports: never transformers' model, generation or Auto
code, which cost seconds of every Serve replica's start (a recovery's most) and of every quantize
worker's (sala/hf.py holds what needs them). Checked in a fresh interpreter doing what a replica
and a quantize worker do: serve.server imported, an engine loaded from tiny-sala, a decoder layer
read from its shards."""
import json
import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("transformers.modeling_utils", "transformers.generation.utils", "transformers.models.auto.modeling_auto",
         "transformers.models.auto.tokenization_auto", "sklearn")


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
