"""Session-wide test setup.

Triton kernels run on CPU through the interpreter; the variable must be set before anything
imports triton, which is why it lives here and not in a fixture.
"""
import contextlib
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.cluster.faults import free_port  # noqa: E402,F401 (the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end pipeline tests (still run in CI)")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


# The suite runs on two pytest-xdist workers (pyproject's addopts), a file at a time on one of
# them, so that a module's server or engine starts once. The files whose tests share a session
# checkpoint built here go to one worker as one unit: each worker would build its own. Work is
# handed out longest first (the units, the fault file's cluster, then the files of 20 s or more),
# so that the last files to run are short ones and the two workers end together (a long file
# handed out last keeps one worker busy long after the other has finished).
SHARED_CHECKPOINTS = {  # a session fixture -> the files that use it
    "quantize_run": {"tests/pipelines/test_quantize_pipeline.py", "tests/cluster/test_lost_node_quantize.py",
                     "tests/interop/test_sglang.py"},
    "medusa_checkpoint": {"tests/medusa/test_medusa_engine.py", "tests/medusa/test_medusa_train.py"},
}
UNITS = {path: f"the files sharing {fixture}" for fixture, paths in SHARED_CHECKPOINTS.items() for path in paths}
CLUSTER_FILE = "tests/cluster/test_node_faults.py"  # its own three-node Ray cluster
LONG_FILES = (  # 20 s or more each with every cache warm on 2 cores, the longest first
    "tests/serve/test_tools.py", "tests/serve/test_serve.py", "tests/serve/test_serve_handles.py",
    "tests/kv/test_kv_sensitivity.py", "tests/engine/test_engine.py", "tests/serve/test_serve_fuzz.py",
    "tests/pipelines/test_real_width.py", "tests/eval/test_evaluate.py", "tests/pipelines/test_generate.py",
    "tests/engine/test_packed_nvfp4.py", "tests/quant/test_quantize_memory.py", "tests/kernels/test_gpu_targets.py",
    "tests/model/test_realwidth.py", "tests/serve/test_prefix_routing.py", "tests/engine/test_graph_store.py",
    "tests/pipelines/test_layer_pool.py", "tests/test_memwatch.py",
)
FIRST = (*dict.fromkeys(UNITS.values()), CLUSTER_FILE, *LONG_FILES)


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        path = item.nodeid.split("::")[0]
        for fixture in SHARED_CHECKPOINTS.keys() & set(getattr(item, "fixturenames", ())):
            if path not in SHARED_CHECKPOINTS[fixture]:
                raise pytest.UsageError(f"{item.nodeid} uses the session's {fixture}: add {path} to its files in "
                                        "SHARED_CHECKPOINTS in tests/conftest.py")
        if skip and "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """xdist's by-scope scheduling with a file as the scope, the files sharing a checkpoint one
    scope, the longest handed out first. (Not xdist's loadgroup: under pytest 9 its group suffix
    on node ids has no effect, and every test became a scope of its own, a module's server
    starting in both workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    named = [*UNITS, CLUSTER_FILE, *LONG_FILES]
    if missing := [path for path in named if not (ROOT / path).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py names test files that do not exist: {missing}")

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return UNITS.get(path, path)

        def _assign_work_unit(self, node) -> None:
            for first in reversed(FIRST):
                if first in self.workqueue:
                    self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ByFile(config, log)


@pytest.fixture(scope="session")
def tiny_sala_dir():
    """tiny-sala, reused from $SALA_HOME when its recipe hash matches, else built once here."""
    from sala.tiny import ensure_tiny_sala

    return ensure_tiny_sala(progress=False)


@pytest.fixture(autouse=True)
def own_step_costs(tmp_path, monkeypatch):
    """Each test's Medusa engines keep their step costs (sala/engine/step_costs.py) in a directory
    of its own: what another test measured must not make this one's choice."""
    monkeypatch.setattr("sala.engine.step_costs.sala_home", lambda: tmp_path)
    return tmp_path / "step_costs"


@pytest.fixture(scope="module")
def local_engine(tiny_sala_dir):
    """tiny-sala in an Engine in this process, one torch thread, eager (its compiled steps are
    tests/engine's): the expected outputs that servers and batch jobs built on the same weights
    must reproduce."""
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model
    from sala.engine import Engine

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine(load_model(tiny_sala_dir), AutoTokenizer.from_pretrained(tiny_sala_dir), compile=False)
    torch.set_num_threads(n)


def cache_hf_dataset(cache_dir, name: str, splits: dict[str, list[dict]]) -> None:
    """Put `splits` into a `datasets` cache under `name`, laid out as a download from the Hub leaves
    it (<name>/<config>/<version>/<hash>/), by the json builder such a download runs."""
    import json
    import tempfile
    from pathlib import Path

    from datasets.packaged_modules.json.json import Json

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            files[split] = str(Path(tmp, f"{split}.jsonl"))
            Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        Json(cache_dir=str(cache_dir), dataset_name=name, config_id="default", hash="0" * 40,
             data_files=files).download_and_prepare()


def assert_gpu_bench_refuses_cpu(script: str) -> None:
    """A GPU benchmark run on a machine without CUDA exits with one line saying so (sys.exit with a
    message: status 1), no traceback. Run in this process as `python bench/X` runs it: an
    interpreter start per bench would cost seconds of imports and check nothing more."""
    import contextlib
    import io
    import runpy
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run for real")
    bench = ROOT / "bench" / script
    stderr, argv, path, threads = io.StringIO(), sys.argv, list(sys.path), torch.get_num_threads()
    sys.argv, sys.path[:0] = [str(bench)], [str(bench.parent)]  # as the interpreter sets them for a script
    try:
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
            runpy.run_path(str(bench), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
        torch.set_num_threads(threads)
    message = exited.value.code
    assert isinstance(message, str) and "needs a CUDA GPU" in message and "\n" not in message, message
    assert stderr.getvalue() == ""


def untrained_heads(base, **config):
    """Medusa heads as initialised over the model `base` (`config`: MedusaConfig's fields besides
    the model's widths)."""
    from sala.medusa.heads import MedusaConfig, MedusaHeads

    return MedusaHeads(MedusaConfig(base.config.hidden_size, base.config.vocab_size, **config), base.lm_head)


def write_untrained_medusa(tiny_sala_dir, dest, **config):
    """tiny-sala with `untrained_heads(**config)` written to `dest`: for what reads medusa/ or
    verifies trees without needing drafts accepted, which the session's trained
    medusa_checkpoint is for (and another worker owns)."""
    from sala.checkpoint import load_model
    from sala.medusa.train import write_medusa_checkpoint

    return write_medusa_checkpoint(tiny_sala_dir, untrained_heads(load_model(tiny_sala_dir), **config), dest)


def train_test_heads(tiny_sala_dir, output: Path) -> Path:
    """tiny-sala plus Medusa heads trained for a minute on its own greedy continuations of
    training text (a short recipe: good enough that drafts are often accepted), on one thread
    from seed 0, so the same inputs train the same heads."""
    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.eval.calibration import default_source_rows
    from sala.medusa import train

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = Engine.from_pretrained(tiny_sala_dir, compile=False)
    data = train.DataConfig(windows_per_row=2)
    seqs = train.prepare(engine, default_source_rows(), data)
    base = load_model(tiny_sala_dir)
    encoded = train.encode(base, seqs, pad_id=0)
    heads = untrained_heads(base, shared_lm_head=False)
    cfg = train.TrainConfig(steps=120, batch_size=8, lr=3e-3)
    train.train_heads(heads, base, encoded, train.RowSampler(len(seqs), None, cfg.batch_size, 0), cfg)
    heads.config.path_acceptance = train.evaluate(heads, base, encoded)["path_acceptance"]  # what trees are chosen by
    torch.set_num_threads(n)
    return train.write_medusa_checkpoint(tiny_sala_dir, heads, output)


@pytest.fixture(scope="session")
def medusa_checkpoint(tiny_sala_dir):
    """`train_test_heads`' checkpoint, kept under $SALA_HOME like tiny-sala: training takes a minute
    and its result depends only on what its key digests (the recipe above, tiny-sala, the versions
    of torch and transformers, the sources of sala and kernels), so a run with all of them
    unchanged reuses it and any change trains again. A kept one must match its manifest."""
    import hashlib
    import inspect
    import shutil
    import time

    import transformers

    from sala.checkpoint import CheckpointError, verify_manifest
    from sala.engine.graph_store import sources_digest
    from sala.home import sala_home

    key = hashlib.sha256("\0".join([inspect.getsource(train_test_heads), tiny_sala_dir.name, torch.__version__,
                                     transformers.__version__, sources_digest()]).encode()).hexdigest()[:16]
    kept = sala_home() / "test-heads"
    out = kept / f"{tiny_sala_dir.name}-medusa-{key}"
    if out.is_dir():
        with contextlib.suppress(CheckpointError):
            if verify_manifest(out):
                return out
        shutil.rmtree(out)
    for old in kept.glob(f"{tiny_sala_dir.name}-medusa-*"):  # other keys: another checkout may use one, so only day-old ones go
        if time.time() - old.stat().st_mtime > 86400:
            shutil.rmtree(old, ignore_errors=True)
    return train_test_heads(tiny_sala_dir, out)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Engine tests run tiny-sala on one torch thread: its matmuls are too small to gain from a
    second, and on a shared 2-core machine OpenMP threads waiting on a busy core make every op
    many times slower. Modules use it with `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer(tiny_sala_dir):
    """tiny-sala's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_sala_dir)


@contextlib.contextmanager
def ray_on_two_cpus():
    """Local Ray sized for this 2-core machine, started here unless already up (then left to
    whoever started it)."""
    import ray

    from serve.app import local_ray_env

    started = not ray.is_initialized()
    if started:
        local_ray_env()  # the Serve tests' proxies start on a loaded machine
        ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False,
                 log_to_driver=False)  # "local": never a cluster another test started on this machine
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@pytest.fixture(scope="module")
def local_ray():
    with ray_on_two_cpus():
        yield


def serve_tiny_sala(model_dir, name: str, **app_kwargs):
    """Generator for a module fixture: the Serve app of `model_dir` on 127.0.0.1 at a free port
    (local Ray started here unless already up), yielding its URL; stopped by its own handles."""
    from ray import serve

    from serve.build import build_app

    with ray_on_two_cpus():
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(str(model_dir), num_cpus=0.5, num_threads=1, **app_kwargs), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()


# ------------------------------------------------------------------ the quantize pipeline's run
# 8 rows of the built-in calibration set pack into 57 sequences of 128 tokens: the gate, at its
# defaults, scores them as it scores 24 rows (218 sequences), which take twice as long to quantize.
SMALL = ["--num-samples", "8", "--seq-len", "128", "--shards", "4", "--eval-sequences", "6"]
# Runs that check bytes, not the gate's figures, score 8 prompts instead of the gate's 64.
FEW_GATE_PROMPTS = [*SMALL, "--gate-prompts", "8"]


def home_env(home) -> dict[str, str]:
    """The environment of a SALA_HOME at `home`, with its MLflow sqlite store inside it."""
    return {"SALA_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{Path(home) / 'mlflow.db'}"}


@pytest.fixture(scope="session")
def pipeline_env(tmp_path_factory):
    """Environment of pipelines/quantize.py runs: their own SALA_HOME and MLflow sqlite store."""
    import sys

    home = tmp_path_factory.mktemp("sala_home")
    e = dict(os.environ)
    e.update({**home_env(home), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"})
    e.pop("RAY_ADDRESS", None)
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    return e


def run_pipeline(env, *args, check=True, extra_env=None):
    import subprocess
    import sys

    script = ROOT / "pipelines" / "quantize.py"
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                       env={**env, **(extra_env or {})}, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"pipeline failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def weights_sha(ckpt) -> str:
    import hashlib

    return hashlib.sha256((Path(ckpt) / "model.safetensors").read_bytes()).hexdigest()


def mixed_plan(config):
    """The published recipe's shape: first and last sparse layer FP8, the rest NVFP4, one bf16 state."""
    from sala.kv import KVPlan

    first, *_, last = config.sparse_layers
    return KVPlan.uniform(config, "nvfp4", "fp32").with_units({first: "fp8", last: "fp8"}, {config.lightning_layers[0]: "bf16"})


@pytest.fixture(scope="session")
def plan_file(tiny_sala_dir, tmp_path_factory):
    """A plan without K/V amax: the pipeline calibrates them."""
    from sala.checkpoint import read_config

    return mixed_plan(read_config(tiny_sala_dir)).save(tmp_path_factory.mktemp("plan") / "kv_plan.json")


@pytest.fixture(scope="session")
def quantize_run(pipeline_env, tiny_sala_dir, tmp_path_factory, plan_file):
    """(checkpoint, completed process) of the quantize pipeline on tiny-sala with a cache plan, as
    its README command runs it (GPTQ + FourOverSix, registered), once a session."""
    out = tmp_path_factory.mktemp("q") / "seq"
    r = run_pipeline(pipeline_env, "--model", str(tiny_sala_dir), "--output", str(out), "--register-name", "tiny-q",
                     "--kv-plan", str(plan_file), *SMALL)
    return out, r
