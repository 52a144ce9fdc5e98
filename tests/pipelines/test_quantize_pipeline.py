"""The quantize pipeline end to end on tiny-sala: real local Ray, real MLflow sqlite store, the
real CLI in a subprocess; a worker process killed mid-run and a driver interrupted, both from
outside (by pid); 1 worker against 2; `ray job submit`."""
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import FEW_GATE_PROMPTS, ROOT, free_port, mixed_plan, run_pipeline, weights_sha

GATE_PASSED = re.compile(r"gate \(KL <= [\d.]+, flips <= \d+%, cosine >= [\d.]+\) passed")
pytestmark = pytest.mark.slow


# One torch thread, as in the gate's one-CPU Ray worker: the engine here loads the decode step
# the gate compiled for the same checkpoint (inductor's C++ is compiled for a thread count).
@pytest.mark.usefixtures("one_torch_thread")
def test_end_to_end_checkpoint_mlflow_and_registry(pipeline_env, quantize_run, tiny_sala_dir):
    import mlflow
    from mlflow import MlflowClient

    from sala.checkpoint import load_model

    out, r = quantize_run
    print(r.stdout[-2500:])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    model = load_model(out)  # the written checkpoint loads through the W4A16 path
    assert model.config.num_hidden_layers == 8
    assert GATE_PASSED.search(r.stdout), r.stdout[-1500:]

    mlflow.set_tracking_uri(pipeline_env["MLFLOW_TRACKING_URI"])
    client = MlflowClient()
    exp = client.get_experiment_by_name("sala-quantize")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    m = runs[0].data.metrics
    assert m["ppl_nvfp4"] < 1.5 * m["ppl_bf16"]
    from pipelines.quantize import GATE

    # The gate scored the written checkpoint with the logprob evaluation, within the measured limits.
    assert 0 < m["kl_mean"] <= GATE["max_kl"] and m["flip_rate"] <= GATE["max_flip_rate"] and m["gate_passed"] == 1.0
    assert GATE["min_cosine"] <= m["cosine_mean"] < 1 and m["heldout_kl_mean"] > 0
    assert {f"m4_share/layer_{i:02d}" for i in range(8)} <= set(m)
    assert 0.05 < m["m4_share"] < 0.8
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"per_layer.json", "m4_share_per_layer.png", "output_error_per_layer.png", "calibration_mix.json"} <= artifacts
    version = client.get_model_version_by_alias("tiny-q", "champion")
    assert version.tags["method"] == "gptq"
    # The cache plan: calibrated into FP8 k/v scales under a compressed-tensors kv_cache_scheme,
    # beside the checkpoint, in the run and on the registered version.
    from sala.kv import load_plan

    plan = load_plan(out, model.config)
    want = mixed_plan(model.config)
    assert (plan.kv, plan.state) == (want.kv, want.state) and set(plan.amax) == set(model.config.sparse_layers)
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        scale = f.get_tensor("model.layers.0.self_attn.attn.k_scale")
    assert scale.shape == (1,)
    import torch

    torch.testing.assert_close(scale, torch.tensor(plan.amax[0]["k"]).max().reshape(1) / 448)
    assert "kv_plan.json" in artifacts and runs[0].data.params["kv_plan_layers"] == plan.describe()
    assert version.tags["kv_plan"] == plan.describe()
    assert int(version.tags["kv_bytes_per_token"]) == sum(plan.kv_bytes_per_token(model.config).values())

    from registry.models import resolve_model_path

    with pytest.MonkeyPatch.context() as mp:  # SALA_HOME is restored (or unset) afterwards
        mp.setenv("SALA_HOME", pipeline_env["SALA_HOME"])
        resolved = resolve_model_path("models:/tiny-q@champion")
    assert weights_sha(resolved) == weights_sha(out)

    # The registered NVFP4 checkpoint serves: the engine runs its packed W4A16 Linears.
    # The registered version is served with its plan: the engine's pools hold the plan's formats
    # and it decodes what the model's full forward over the same quantized K/V decodes.
    from sala.engine import Engine, SamplingParams
    from sala.kv import apply_to_model
    from sala.quant.linear import NVFP4Linear

    engine = Engine.from_pretrained(resolved)
    assert isinstance(engine.model.model.layers[3].mlp.down_proj, NVFP4Linear)
    assert (engine.config.kv_plan.kv, engine.config.kv_plan.state) == (plan.kv, plan.state)
    assert engine.cache.k[4].data.dtype == torch.uint8 and engine.cache.states[model.config.lightning_layers[0]].dtype == torch.bfloat16
    ids = engine.encode("The for statement")
    got = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    seq = list(ids)
    apply_to_model(engine.model, engine.config.kv_plan)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(engine.model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    apply_to_model(engine.model, None)
    assert got == seq[len(ids):]


def test_last_lines_name_a_serve_command_that_works(pipeline_env, quantize_run):
    """The job ends with what to do next: the printed serve command, pasted into a shell, serves
    the registered checkpoint under its registered name; the printed curl answers; the MLflow line
    names this run's store and run; the server stops on SIGTERM without a stack dump."""
    import signal

    import httpx
    from mlflow import MlflowClient

    from pipelines import generate

    _, r = quantize_run
    lines = r.stdout.rstrip().splitlines()
    tail = lines[lines.index("next steps"):]
    print("\n".join(tail))
    steps = {line[:15].strip(): line[15:].strip() for line in tail[1:] if line[:15].strip()}
    serve_cmd = steps["serve it"]
    assert "-m serve.app --model models:/tiny-q@champion" in serve_cmd
    assert f"MLFLOW_TRACKING_URI={pipeline_env['MLFLOW_TRACKING_URI']}" in serve_cmd
    assert "--model models:/tiny-q@champion --dataset" in steps["batch"]
    # What PROMPTS.jsonl holds: the example line has the field generate.py reads prompts from.
    (example,) = [line for line in tail if "PROMPTS.jsonl: " in line]
    assert generate.parse_args(["--dataset", "d", "--output", "o"]).prompt_column in json.loads(example.split("e.g. ")[1])
    # MLflow's own server of the registered version: it starts uvicorn from PATH, which the command
    # sets to find it there even from a shell whose PATH lacks this environment.
    words = shlex.split(steps["MLflow serve"])
    n = next(i for i, w in enumerate(words) if not re.fullmatch(r"[A-Z_]+=.*", w))
    assigned, argv = dict(w.split("=", 1) for w in words[:n]), words[n:]
    assert assigned["MLFLOW_TRACKING_URI"] == pipeline_env["MLFLOW_TRACKING_URI"] and os.access(argv[0], os.X_OK)
    assert argv[1:] == ["models", "serve", "-m", "models:/tiny-q@champion", "--env-manager", "local", "--port", "5001"]
    assert shutil.which("uvicorn", path=assigned["PATH"].replace("$PATH", "/usr/bin:/bin"))
    run_id = MlflowClient(pipeline_env["MLFLOW_TRACKING_URI"]).search_runs(
        [MlflowClient(pipeline_env["MLFLOW_TRACKING_URI"]).get_experiment_by_name("sala-quantize").experiment_id])[0].info.run_id
    assert pipeline_env["MLFLOW_TRACKING_URI"] in steps["MLflow UI"] and run_id in steps["MLflow UI"]

    port = free_port()
    words = shlex.split(serve_cmd)  # as a shell runs it: leading NAME=value words set the environment
    n = next(i for i, w in enumerate(words) if not re.fullmatch(r"[A-Z_]+=.*", w))
    assigned, argv = dict(w.split("=", 1) for w in words[:n]), words[n:] + ["--port", str(port)]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**pipeline_env, **assigned, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("serving on "):
                break
        assert proc.poll() is None, "".join(out[-40:])
        curl = tail[2].split("then: ", 1)[1].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        body = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120).stdout)
        assert body["model"] == "tiny-q" and body["choices"][0]["text"], body
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-q"]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(out) + rest
    print(log[-800:])
    assert proc.returncode == 0 and "stopped" in log
    assert "SIGTERM received" not in log and "Traceback" not in log


def start_pipeline(env, *args):
    """The pipeline in the background; its stdout lines collect in the returned list as they come."""
    # SIGINT back to its default first: a test run started in the background (nohup, `cmd &`) hands
    # its children SIGINT ignored, and then Python installs no KeyboardInterrupt handler.
    proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines" / "quantize.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, err = [], []
    for stream, sink in ((proc.stdout, lines), (proc.stderr, err)):
        threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()
    return proc, lines, err


def wait_until(condition, proc, err, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "pipeline ended early:\n" + "".join(err)[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_interrupted_run_resumes_with_identical_output(pipeline_env, quantize_run, tiny_sala_dir, tmp_path, plan_file):
    """Ctrl-C (SIGINT to the driver) once layer 3 is saved: exit 130, nothing at the output, the
    finished layers kept; the same command again reuses them and writes the same bytes. It resumes
    on one worker: the Hessians are summed per calibration shard in shard order, so the worker
    count (1 here against quantize_run's 2) changes the time, not a byte of the checkpoint."""
    out = tmp_path / "resumed"
    args = ["--model", str(tiny_sala_dir), "--output", str(out), "--no-register", "--kv-plan", str(plan_file),
            *FEW_GATE_PROMPTS]
    layers_dir = out.with_name(f".{out.name}.layers")
    proc, lines, err = start_pipeline(pipeline_env, *args)
    wait_until(lambda: (layers_dir / "layer_003.json").exists(), proc, err)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, "".join(err)[-3000:]
    assert not out.exists()
    kept = sorted(int(p.stem.split("_")[1]) for p in layers_dir.glob("layer_*.json"))
    assert kept[:4] == [0, 1, 2, 3] and len(kept) < 8, kept
    assert "workers    2 Ray actors" in "".join(lines) and "workers    2 Ray actors" in quantize_run[1].stdout
    second = run_pipeline(pipeline_env, *args, "--workers", "1")
    assert "workers    1 Ray actors" in second.stdout
    assert f"reusing {len(kept)} finished layer(s) {kept}" in second.stdout
    assert weights_sha(out) == weights_sha(quantize_run[0])
    assert not layers_dir.exists()


def test_a_worker_killed_mid_run_changes_nothing(pipeline_env, quantize_run, tiny_sala_dir, tmp_path, plan_file):
    """SIGKILL one worker actor's process while layers are being quantized: Ray restarts it, it
    replays the quantized layers before its pending call, and the checkpoint is the same bytes."""
    out = tmp_path / "faulty"
    proc, lines, err = start_pipeline(pipeline_env, "--model", str(tiny_sala_dir), "--output", str(out), "--no-register",
                                      "--kv-plan", str(plan_file), *FEW_GATE_PROMPTS)
    layers_dir = out.with_name(f".{out.name}.layers")
    wait_until(lambda: (layers_dir / "layer_002.json").exists(), proc, err)
    assert not (layers_dir / "layer_007.json").exists()  # the kill lands mid-quantization
    workers = next(line for line in lines if line.startswith("workers "))
    pids = [int(p) for p in re.search(r"pids ([\d ]+)\)", workers).group(1).split()]
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, "".join(err)[-3000:]
    assert weights_sha(out) == weights_sha(quantize_run[0])
    assert GATE_PASSED.search("".join(lines))


def run_main(env, monkeypatch, capsys, *args, extra_env=None) -> tuple[int, str]:
    """The CLI's main() in this process: the checks that refuse bad input run before anything is
    imported that this process has not imported already, so a subprocess would time only imports
    (about 6 s a case); `python pipelines/quantize.py` itself runs in the tests above."""
    from pipelines.quantize import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in {**env, **(extra_env or {})}.items():
        if k in ("SALA_HOME", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
            monkeypatch.setenv(k, v)
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/nonexistent/model"], "no such model directory"),
        (["--model", "models:/no-such-model@champion"], "not in the model registry"),
        (["--calibration", "{tmp}/missing.jsonl"], "no such dataset"),
        (["--calibration", "{tmp}/notext.jsonl"], "no text column"),
        (["--calibration", "{tmp}/empty.jsonl"], "dataset is empty"),
        (["--output", "{tmp}"], "exists; pass --overwrite"),
        (["--kv-plan", "{tmp}/missing.json"], "missing.json: no such file"),
        (["--kv-plan", "{tmp}/bad_plan.json"], "layer 0: unknown kv format 'int4'"),
    ],
)
def test_bad_input_fails_fast_with_one_line(pipeline_env, tiny_sala_dir, tmp_path, args, needle, monkeypatch, capsys):
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad_plan.json").write_text('{"layers": [{"layer": 0, "kind": "sparse", "kv": "int4"}]}')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--model" not in args:
        args = ["--model", str(tiny_sala_dir), *args]
    code, err = run_main(pipeline_env, monkeypatch, capsys, *args)
    assert code == 2, err[-2000:]
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert "quantizing layers" not in err  # refused before any expensive work


def test_unreachable_mlflow_and_ray(pipeline_env, tiny_sala_dir, monkeypatch, capsys):
    code, err = run_main(pipeline_env, monkeypatch, capsys, "--model", str(tiny_sala_dir),
                         extra_env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert code == 2 and "unreachable" in err
    code, err = run_main(pipeline_env, monkeypatch, capsys, "--model", str(tiny_sala_dir), "--output", "/tmp/sala-unused-out",
                         extra_env={"RAY_ADDRESS": "127.0.0.1:9"})
    assert code == 2 and "cannot reach Ray" in err


def test_ray_job_submit(pipeline_env, tiny_sala_dir, tmp_path):
    # Ray 2.60 clusters use token auth: the head and the job client share this token.
    e = {**pipeline_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    ray_bin = str(Path(sys.executable).parent / "ray")
    port, dash, agent, client = free_port(), free_port(), free_port(), free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # A head of its own in the foreground (--block), stopped through its process group: `ray stop`
    # stops every Ray on the machine, the other test worker's too. Its ports are its own: the job
    # agent's default (52365) is taken by any other Ray here, and then no job can be submitted.
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent}",
                             f"--ray-client-server-port={client}", "--num-cpus=2", "--disable-usage-stats",
                             f"--temp-dir={ray_tmp}"],
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = tmp_path / "job-out"
    try:
        started = []
        for line in head.stdout:
            started.append(line)
            if "Ray runtime started" in line:
                break
        assert head.poll() is None, "".join(started[-30:])
        threading.Thread(target=head.stdout.read, daemon=True).start()  # it keeps writing; never block it
        submit = [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", str(ROOT),
                  "--runtime-env-json", json.dumps({"env_vars": {k: e[k] for k in ("SALA_HOME", "MLFLOW_TRACKING_URI")},
                                                    "excludes": [".venv", ".git"]}),
                  "--", "python", "pipelines/quantize.py", "--model", str(tiny_sala_dir), "--output", str(out),
                  "--no-register", "--mode", "parallel", *FEW_GATE_PROMPTS]
        deadline = time.monotonic() + 120
        # The head's job agent comes up after "Ray runtime started"; until then Ray answers "try again later".
        while "No available agent to submit job" in (job := subprocess.run(submit, env=e, capture_output=True, text=True,
                                                                            timeout=600)).stderr:
            assert time.monotonic() < deadline, job.stderr[-2000:]
            time.sleep(1)
    finally:  # SIGKILL: nothing of this cluster is kept, and SIGTERM's orderly stop takes ~30 s
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in (job.stdout + job.stderr)
    assert (out / "model.safetensors").exists() and (out / "manifest.json").exists()


def test_gate_refuses_a_broken_checkpoint(tiny_sala_dir, tmp_path):
    """The gate's logprob evaluation on a checkpoint as a quantizer bug would leave it (every
    decoder Linear + noise of 0.25 x its RMS, bench/logprob_eval.py's "broken" before GPTQ: measured KL 0.11,
    flips 27%, cosine 0.93): every limit refuses it, while tiny-sala against itself scores 0."""
    import torch
    from transformers import AutoTokenizer

    from pipelines.evaluate import score_checkpoint
    from pipelines.quantize import GATE, gate_failures
    from sala.checkpoint import load_model
    from sala.hf import MiniCPMSALAForCausalLM

    model = load_model(tiny_sala_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.model.layers.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight += 0.25 * m.weight.pow(2).mean().sqrt() * torch.randn(m.weight.shape, generator=gen)
    broken = tmp_path / "broken"
    MiniCPMSALAForCausalLM.sharing(model).save_pretrained(broken)
    AutoTokenizer.from_pretrained(tiny_sala_dir).save_pretrained(broken)
    score = score_checkpoint(broken, tiny_sala_dir, num_prompts=32)
    failures = gate_failures(score, **GATE)
    print(score, failures)
    assert [f.split()[0] for f in failures] == ["mean", "flip", "mean"], failures
    same = score_checkpoint(tiny_sala_dir, tiny_sala_dir, num_prompts=8)
    assert same["kl_max"] == 0 and not gate_failures(same, **GATE)
