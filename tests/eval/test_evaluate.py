"""Logprob evaluation end to end on tiny-sala: the engine in evaluation mode against its own
baseline (exactly zero at batch sizes 1, 8 and 32) and against a perturbed copy, a real server
over HTTP through both APIs (with torch unimportable on the client), the CLI with MLflow, and
the failures that must never become a score: a server down, slow, or short of top-k."""
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from pipelines.evaluate import builtin_rows, tokenize_prompts
from pipelines.logprob_client import HTTPSource
from sala.eval import logprob as lp
from sala.eval.engine_source import EngineSource
from tests.conftest import ROOT, free_port, home_env, serve_tiny_sala

TOP_K = 32  # the whole pipeline at a smaller k keeps the test fast; the divergence at 256 is test_logprob's


def engine_source(tiny_sala_dir, perturb: float = 0.0) -> EngineSource:
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model
    from sala.engine import Engine

    model = load_model(tiny_sala_dir)
    if perturb:  # a deliberately broken model: noise on one lightning layer's MLP
        w = model.model.layers[2].mlp.down_proj.weight
        w.data += perturb * w.data.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    return EngineSource(Engine(model, AutoTokenizer.from_pretrained(tiny_sala_dir), batch_invariant=True, max_seqs=32),
                        "tiny-sala-perturbed" if perturb else "tiny-sala")


@pytest.fixture(scope="module")
def reference(tiny_sala_dir):
    torch.set_num_threads(1)
    return engine_source(tiny_sala_dir)


@pytest.fixture(scope="module")
def baselines(reference):
    tok = reference.engine.tokenizer
    prompts = tokenize_prompts(builtin_rows(32), lambda t: tok(t)["input_ids"], 48)
    return lp.collect_baseline(reference, prompts, max_new_tokens=24, top_k=TOP_K, positions=40)


def test_own_baseline_is_exactly_zero_at_every_batch_size_and_a_perturbed_model_is_not(baselines, reference, tiny_sala_dir):
    assert sorted(baselines) == [1, 8, 32]
    for b, base in baselines.items():
        assert (base.top_logprobs == baselines[1].top_logprobs).all(), f"evaluation mode: batch {b} is bitwise batch 1"
        s = lp.compare(base, reference, b).summary()
        assert s["kl_max"] == 0 and s["flip_rate"] == 0 and s["positions"] == len(base.top_ids), (b, s)
    mild, broken = engine_source(tiny_sala_dir, 0.05), engine_source(tiny_sala_dir, 0.5)
    s_mild, s_broken = (lp.compare(baselines[8], src, 8).summary() for src in (mild, broken))
    print(f"perturbed 0.05: {s_mild}\nperturbed 0.5: {s_broken}")
    assert 0 < s_mild["kl_mean"] < s_broken["kl_mean"] and s_broken["kl_mean"] > 20 * s_mild["kl_mean"]
    assert s_broken["flip_rate"] > 0.02 and s_broken["cosine_mean"] < s_mild["cosine_mean"]
    # Decode drift: the model itself never leaves its continuation; the broken one does, and early.
    same = lp.decode_drift(baselines[8], reference, reference).summary()
    drift = lp.decode_drift(baselines[8], broken, reference).summary()
    print(f"drift, same model: {same}\ndrift, broken: {drift}")
    assert same["drift_identical_share"] == 1 and same["drift_kl_mean"] < 1e-9
    assert drift["drift_identical_share"] < 0.8 and drift["drift_kl_mean"] > s_mild["kl_mean"]


@pytest.fixture(scope="module")
def server(tiny_sala_dir):
    yield from serve_tiny_sala(tiny_sala_dir, "sala", batch_invariant=True, max_seqs=32, max_waiting=64)


def test_server_over_http_both_apis_without_torch_on_the_client(server, baselines, tmp_path):
    """The server in evaluation mode is the engine in evaluation mode: KL exactly 0 and no flips
    through /generate and through /v1/completions echo, at batch sizes 1, 8 and 32."""
    for api in ("sglang", "openai"):
        src = HTTPSource(server, api, retries=1)
        for b in (1, 8, 32):
            s = lp.compare(baselines[b], src, b).summary()
            assert s["kl_max"] == 0 and s["flip_rate"] == 0, (api, b, s)
    # A baseline collected through the server equals the engine's.
    got = lp.collect_baseline(HTTPSource(server), [s[:n].tolist() for s, n in
                                                   zip(baselines[8].sequences[:8], baselines[8].prompt_lens[:8])],
                              max_new_tokens=24, batch_sizes=(8,), top_k=TOP_K, positions=40)[8]
    assert all((x == y).all() for x, y in zip(got.sequences, baselines[8].sequences[:8]))
    assert (got.top_logprobs == baselines[8].top_logprobs[: len(got.top_logprobs)]).all()
    path = baselines[32].save(tmp_path / "baseline_bs32.npz")
    code = ("import sys; sys.modules['torch'] = None\n"
            "from sala.eval import logprob as lp; from pipelines.logprob_client import HTTPSource\n"
            f"r = lp.compare(lp.Baseline.load({str(path)!r}), HTTPSource({server!r}, 'openai'), 32)\n"
            "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]\n"
            "print(r.summary()['kl_max'], r.summary()['positions'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)},
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0.0", str(len(baselines[32].top_ids))]
    # The CLI against a URL, MLflow logging included, with torch installed: it never imports it.
    cli = ("import runpy, sys\n"
           f"sys.argv = ['evaluate.py', 'compare', '--baseline', {str(tmp_path)!r}, '--url', {server!r}, '--max-kl', '0']\n"
           "code = runpy.run_path('pipelines/evaluate.py')['main']()\n"
           "print('exit', code, 'torch imported', 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", cli], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), **home_env(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.stdout.strip().splitlines()[-1] == "exit 0 torch imported False", (r.stdout[-1500:], r.stderr[-2000:])


def test_context_and_tokenizer_mismatches_are_errors(server, baselines):
    src = HTTPSource(server)
    other = lp.Baseline(baselines[1].sequences, baselines[1].prompt_lens, baselines[1].starts, baselines[1].top_ids,
                        baselines[1].top_logprobs, {**baselines[1].meta, "tokenizer_hash": "0" * 16, "model": "llama"})
    with pytest.raises(lp.BaselineError, match="collected from llama.*another tokenizer"):
        lp.compare(other, src)
    long = lp.Baseline([np.arange(5000, dtype=np.int32) % 100], np.array([10]), np.array([4990]),
                       baselines[1].top_ids[:10], baselines[1].top_logprobs[:10], baselines[1].meta)
    with pytest.raises(lp.SourceError, match="5000 tokens.*context is 4096"):
        lp.compare(long, src)


class FakeServer(BaseHTTPRequestHandler):
    """A foreign SGLang-style server that answers too few top logprobs, or too slowly."""

    delay = 0.0

    def do_POST(self):
        import time

        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        time.sleep(self.delay)
        if self.path == "/tokenize":
            out = {"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}
        else:
            out = [{"text": "", "output_ids": [0], "meta_info": {
                "input_token_logprobs": [[None, seq[0], None]] + [[-1.0, t, None] for t in seq[1:]],
                "input_top_logprobs": [None] + [[[-1.0, t, None], [-2.0, 7, None]] for t in seq[1:]]}}
                for seq in body["input_ids"]]
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_down_slow_and_short_servers_give_clear_errors(baselines):
    down = HTTPSource(f"http://127.0.0.1:{free_port()}", retries=1, backoff=0.01, vocab_size=2048)
    with pytest.raises(lp.SourceError, match="did not answer after 2 tries.*Connection refused"):
        lp.compare(baselines[1], down)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        short = HTTPSource(url, vocab_size=2048)
        short._identity = lp.Identity("fake", baselines[1].meta["tokenizer_hash"], 2048, 4096)
        with pytest.raises(lp.SourceError, match=f"returned 2 top logprobs per position where {TOP_K} were asked"):
            lp.compare(baselines[1], short)
        FakeServer.delay = 2.0
        slow = HTTPSource(url, vocab_size=2048, timeout=0.3, retries=1, backoff=0.01)
        with pytest.raises(lp.SourceError, match=r"did not answer after 2 tries \(timeout 0.3 s each\)"):
            slow.identity()
    finally:
        FakeServer.delay = 0.0
        httpd.shutdown()


def test_cli_baseline_and_compare_with_mlflow(tiny_sala_dir, tmp_path):
    env = {"PYTHONPATH": str(ROOT), **home_env(tmp_path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "pipelines" / "evaluate.py"), *a], capture_output=True,  # noqa: E731
                                    text=True, env=env, timeout=300)
    out = tmp_path / "base"
    r = run("baseline", "--model", str(tiny_sala_dir), "--output", str(out), "--num-prompts", "12", "--prompt-tokens", "40",
            "--max-new-tokens", "16", "--batch-sizes", "1,8", "--top-k", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prose" in r.stdout and "low-semantic rows" in r.stdout  # the prompt set's composition
    assert sorted(p.name for p in out.iterdir()) == ["baseline_bs1.npz", "baseline_bs8.npz"]
    r = run("compare", "--baseline", str(out), "--model", str(tiny_sala_dir), "--max-kl", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["kl_max/bs1"] == last["kl_max/bs8"] == 0 and last["gate_passed"] is True
    assert "gate (mean KL <= 0 at every batch size) passed" in r.stdout

    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    client = MlflowClient()
    run_info = client.search_runs([client.get_experiment_by_name("sala-evaluate").experiment_id])[0]
    assert run_info.data.metrics["kl_mean/bs8"] == 0 and run_info.data.metrics["gate_passed"] == 1
    assert {"kl_per_position.png", "worst_prompts.json"} <= {a.path for a in client.list_artifacts(run_info.info.run_id)}
    (out / "baseline_bs8.npz").write_bytes(b"not an npz")
    r = run("compare", "--baseline", str(out), "--model", str(tiny_sala_dir), "--no-mlflow")
    assert r.returncode == 2 and "baseline_bs8.npz: not a readable logprob baseline" in r.stderr
    assert "Traceback" not in r.stderr
