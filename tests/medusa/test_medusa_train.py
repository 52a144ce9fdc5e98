"""Medusa training: every head's validation loss falls, trained heads are accepted more often
than untrained ones, a resumed run equals an uninterrupted one, validation-matched weights give
the validation set's mix, and the pipeline's processes hold what they say they need in memory
(refused on a smaller host, measured on the real-width model)."""
import copy
import subprocess
import sys

import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import Engine
from sala.eval.calibration import Row, default_source_rows, guess_task
from sala.medusa import train
from sala.medusa.heads import load_heads
from sala.tiny import heldout_texts
from tests.conftest import ROOT, untrained_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def setup(tiny_sala_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    base = load_model(tiny_sala_dir)
    val_rows = [Row(t, guess_task(t)) for t in heldout_texts(tiny_sala_dir)]
    val, prompts = train.windows(val_rows, tok, 32, 96, 1)
    return tok, base, val_rows, train.encode(base, val[:48], 0), prompts[:16]


def untrained(base):
    torch.manual_seed(0)
    return untrained_heads(base, shared_lm_head=False)


def test_training_lowers_every_head_loss_and_raises_accept_length(setup, medusa_checkpoint):
    tok, base, _, val, prompts = setup
    before, after = untrained(base), load_heads(medusa_checkpoint, base.config)
    ev_before, ev_after = train.evaluate(before, base, val), train.evaluate(after, base, val)
    print("val loss per head:", [f"{a:.2f} -> {b:.2f}" for a, b in zip(ev_before["loss"], ev_after["loss"])])
    assert all(b < a - 0.5 for a, b in zip(ev_before["loss"], ev_after["loss"]))  # measured: ~8.0 -> ~7.1 on raw text
    lengths = [train.accept_length(Engine(copy.deepcopy(base), tok, compile=False, medusa=h,
                                          medusa_nodes=h.tree.num_nodes - 1), prompts, 24)
               for h in (before, after)]
    print(f"accept length: untrained {lengths[0]:.2f}, trained {lengths[1]:.2f}")
    assert lengths[1] > lengths[0] + 0.3  # measured: ~1.1 -> ~2.0


def test_path_acceptance_counts_the_ranks_every_head_got_right(setup, medusa_checkpoint):
    """evaluate's path acceptance against a count written here position by position: at each
    position every head has a target at, the path is the ranks of the heads' targets in their
    top-k, head by head until one misses; a path's share is how many positions it is a prefix of.
    The trees chosen from it are the paths most often right, so they are prefix-closed."""
    from sala.medusa.tree import build_tree, expected_accept_length, top_paths

    _, base, _, val, _ = setup
    heads = load_heads(medusa_checkpoint, base.config)
    data = train.Encoded(val.ids[:8], val.mask[:8], val.hidden[:8])
    got = {tuple(p): a for p, a in train.evaluate(heads, base, data)["path_acceptance"]}
    k, topk = heads.config.num_heads, heads.config.topk
    counts, positions = {}, 0
    with torch.no_grad():
        logits = heads(data.hidden, base.lm_head)  # [K, B, S, V]
    for b in range(data.ids.shape[0]):
        for t in range(data.ids.shape[1] - k - 1):
            if not all(data.mask[b, t + j] for j in range(k + 2)):
                continue
            positions += 1
            path = ()
            for h in range(k):
                top = logits[h, b, t].topk(topk).indices.tolist()
                target = int(data.ids[b, t + h + 2])
                if target not in top:
                    break
                path += (top.index(target),)
                counts[path] = counts.get(path, 0) + 1
    assert positions > 100 and got.keys() == counts.keys()
    assert all(got[p] == pytest.approx(n / positions) for p, n in counts.items())
    tree = top_paths(got, 20)
    build_tree(tree, topk=topk, num_heads=k)  # prefix-closed
    assert expected_accept_length(got, tree) == pytest.approx(1 + sum(sorted(got.values(), reverse=True)[:20]))


def test_resumed_training_equals_uninterrupted(setup, tmp_path):
    tok, base, _, val, _ = setup
    cfg = train.TrainConfig(steps=12, batch_size=4, lr=3e-3, warmup=3, checkpoint_every=6)
    whole = untrained(base)
    train.train_heads(whole, base, val, train.RowSampler(len(val), None, 4, 0), cfg)
    class Stop(Exception):
        pass

    def crash(step, row):
        if step == 8:  # two steps past the state saved at step 6, which are lost and redone
            raise Stop

    with pytest.raises(Stop):
        train.train_heads(untrained(base), base, val, train.RowSampler(len(val), None, 4, 0), cfg, tmp_path, crash)
    resumed = untrained(base)  # a fresh process would start from the same init, then load the state
    history = train.train_heads(resumed, base, val, train.RowSampler(len(val), None, 4, 0), cfg, tmp_path)
    assert [h["step"] for h in history] == list(range(1, 13))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_matched_weights_give_the_validation_windows_mix():
    """Task a's validation windows fall in length bins well stocked with training windows, so
    each bin gets its validation share; task b's fall in a bin holding 2 training windows, so b
    is matched by task alone (else those 2 would carry b's whole share)."""
    def seqs(spec):
        return [train.Sequence([1], task, chars) for task, chars, n in spec for _ in range(n)]

    training = seqs([("a", 10, 20), ("a", 1000, 20), ("b", 10, 2), ("b", 1000, 30), ("c", 10, 40)])
    val = seqs([("a", 10, 3), ("a", 1000, 1), ("b", 10, 1)])
    weights = train.matched_weights(training, val)
    expected = [3 / 5 / 20] * 20 + [1 / 5 / 20] * 20 + [1 / 5 / 32] * 32 + [0.0] * 40
    assert weights == pytest.approx(expected, rel=1e-9)
    naive = train.matched_weights(training, val, min_rows=0)  # the rule off: b's 2 short windows take b's share
    assert naive[40:42] == pytest.approx([1 / 5 / 2] * 2) and not any(naive[42:72])
    with pytest.raises(ValueError, match="task type"):
        train.matched_weights(seqs([("c", 10, 5)]), val)


def test_matched_weights_on_tiny_sala_data_keep_an_effective_sample(setup):
    """On the real sets (held-out prose against mixed training text) matching per length bin
    alone puts the validation share on a handful of windows; the task fallback keeps hundreds."""
    tok, _, val_rows, _, _ = setup
    training, _ = train.windows(default_source_rows(), tok, 32, 128, 8)
    val, _ = train.windows(val_rows, tok, 32, 128, 2)
    ess = train.effective_rows(train.matched_weights(training, val), len(training))
    naive = train.effective_rows(train.matched_weights(training, val, min_rows=0), len(training))
    print(f"effective training windows: {ess:.0f} matched, {naive:.0f} per length bin alone, of {len(training)}")
    assert ess > 100 and naive < 20  # measured: 506 and 9 of 854


def test_cli_refuses_bad_arguments_in_one_line():
    run = subprocess.run([sys.executable, str(ROOT / "pipelines/train_medusa.py"), "--seq-len", "8"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--seq-len must exceed --prompt-len" in run.stderr


def test_memory_refusals_name_a_setting_that_fits(tiny_sala_dir, tmp_path, monkeypatch, capsys):
    """Before anything loads, the driver says what its training needs; a host that cannot hold it
    (SALA_HOST_MEMORY_GIB stands for a smaller one) is refused naming the largest --batch-size that
    fits, and through the command line with a one-line error and exit 2, nothing written."""
    import os

    from pipelines.train_medusa import driver_needs, parse_args, plan_memory
    from sala.footprint import GIB, CheckpointFootprint, MemoryShortfall

    model = CheckpointFootprint(tiny_sala_dir)
    args = parse_args(["--given-text", "--eval-prompts", "0", "--batch-size", "16"])
    fits, larger, asked = (max(need.total for need in driver_needs(args, model, 100, b)) for b in (4, 5, 16))
    assert fits < larger < asked
    monkeypatch.setenv("SALA_HOST_MEMORY_GIB", str(fits / GIB))
    with pytest.raises(MemoryShortfall, match=r"^the driver's training \(--batch-size 16\) needs .*; --batch-size 4 would fit$"):
        plan_memory(args, tiny_sala_dir, 100)
    assert "memory: the driver's training (--batch-size 16)" in capsys.readouterr().out
    env = {**os.environ, "SALA_HOST_MEMORY_GIB": "0.01", "SALA_HOME": str(tmp_path / "home"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    run = subprocess.run([sys.executable, str(ROOT / "pipelines/train_medusa.py"), "--model", str(tiny_sala_dir), "--given-text",
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    (error,) = [line for line in run.stderr.splitlines() if line.startswith("error:")]  # MLflow logs around it
    assert run.returncode == 2 and error.startswith("error: the driver's training") and "run on a host" in error, run.stderr
    assert not (tmp_path / "out").exists()


# A distillation actor's part, then the driver's, in one process, as a local run does them in turn.
STAGES = """
import sys
from pathlib import Path

from transformers import AutoTokenizer

from pipelines.train_medusa import DistillStage, parse_args, train_on_backbone
from sala.eval.calibration import Row
from sala.medusa import train

args = parse_args(sys.argv[2:])
tok = AutoTokenizer.from_pretrained(args.model)
rows = [Row(t, "prose") for t in Path(sys.argv[1]).read_text().split("\\n\\n") if len(t) > 400][:1]
seqs, prompts = train.windows(rows, tok, args.prompt_len, args.seq_len, args.windows_per_row)
stage = DistillStage(args.model, args.prompt_len, args.seq_len - args.prompt_len, 0.0, 0)
seqs = train.self_distilled(seqs, stage({"index": list(range(len(prompts))), "prompt": prompts})["continuation"], args.prompt_len)
del stage
train_on_backbone(args, Path(args.model), tok, seqs, seqs, prompts, None)
"""


def test_an_actor_and_the_driver_hold_what_they_say(tiny_sala_dir):
    """On the real-width model (1 layer, BF16, 1.6 GiB): a distillation actor's engine continues a
    prompt, then the driver's part for 2 heads (encode, a training step, evaluation, accept length
    with an engine on its model), in one process. memwatch counts a process's own (anonymous) memory, not
    the checkpoint's pages that loading maps: the peak stays within the larger stated own need
    plus 30% of the model (a model held in fp32, or a second engine's copies, go past it) and is
    not far below it."""
    from bench.memwatch import run_measured
    from pipelines.train_medusa import actor_need, driver_needs, parse_args
    from sala.footprint import CheckpointFootprint
    from sala.realwidth import ensure_realwidth

    path = ensure_realwidth(1)
    # 128-token windows: a head's logits are over 32 MiB, tensors glibc maps and gives back once freed, as
    # at the 9B's batch sizes (smaller ones stay in its heap, and the peak would count every phase's).
    flags = ["--model", str(path), "--prompt-len", "16", "--seq-len", "128", "--windows-per-row", "1", "--steps", "1",
             "--batch-size", "1", "--num-heads", "2", "--tree-nodes", "4", "--weighting", "uniform"]
    model, args = CheckpointFootprint(path), parse_args(flags)
    own = max(need.own_bytes for need in [actor_need(args, model), *driver_needs(args, model, 2, args.batch_size)])
    result, peak = run_measured([sys.executable, "-c", STAGES, str(tiny_sala_dir / "heldout.txt"), *flags], cwd=ROOT,
                                timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"peak {peak.peak_tree_bytes / 2**30:.2f} GiB own, stated {own / 2**30:.2f} GiB + the model's "
          f"{model.mapped / 2**30:.2f} GiB mapped")
    assert 0.5 * own < peak.peak_tree_bytes <= own + 0.3 * model.mapped
