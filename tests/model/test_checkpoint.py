"""Checkpoint directories: bit-exact round trips, corruption detection, clear errors on bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sala.checkpoint import CheckpointError, load_model, save_checkpoint
from tests.model.test_model import random_model


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact(tmp_path, dtype):
    m = random_model().to(dtype)
    out = save_checkpoint(m, tmp_path / "ckpt")
    assert (out / "manifest.json").exists() and (out / "model.safetensors").exists()
    back = load_model(out)
    assert next(back.parameters()).dtype == dtype
    assert same_weights(m, back)
    ids = torch.randint(0, 101, (1, 10))
    with torch.no_grad():
        assert torch.equal(m(ids, use_cache=False).logits, back(ids, use_cache=False).logits)


def test_sharded_round_trip(tmp_path):
    m = random_model()
    out = save_checkpoint(m, tmp_path / "ckpt", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert same_weights(m, load_model(out))


def test_existing_target_is_refused_and_left_intact(tmp_path):
    m = random_model()
    out = save_checkpoint(m, tmp_path / "ckpt")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        save_checkpoint(random_model(seed=1), out)
    assert (out / "model.safetensors").read_bytes() == before
    save_checkpoint(random_model(seed=1), out, overwrite=True)
    assert same_weights(random_model(seed=1), load_model(out))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directories left behind


def test_failed_write_leaves_nothing(tmp_path):
    class Broken(torch.nn.Module):
        config = random_model().config

        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(Broken(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_flipped_byte_is_detected(tmp_path):
    out = save_checkpoint(random_model(), tmp_path / "ckpt")
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: sha256"):
        load_model(out)


def test_truncated_file_is_detected_without_manifest(tmp_path):
    out = save_checkpoint(random_model(), tmp_path / "ckpt")
    (out / "manifest.json").unlink()  # a checkpoint from elsewhere: no manifest to compare against
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        load_model(out)


def test_truncated_file_is_detected_with_manifest(tmp_path):
    out = save_checkpoint(random_model(), tmp_path / "ckpt")
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(out)


def _resave(out, state):
    from safetensors.torch import save_file

    (out / "manifest.json").unlink(missing_ok=True)
    save_file(state, str(out / "model.safetensors"))


def test_missing_tensor_and_shape_mismatch_name_the_key(tmp_path):
    m = random_model()
    out = save_checkpoint(m, tmp_path / "ckpt")
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state.pop("model.layers.1.self_attn.z_proj.weight")
    _resave(out, state)
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.self_attn.z_proj.weight"):
        load_model(out)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(3, 3)
    _resave(out, state)
    with pytest.raises(CheckpointError, match=r"lm_head.weight has shape \(3, 3\)"):
        load_model(out)


def test_pickle_weights_are_refused(tmp_path):
    m = random_model()
    out = save_checkpoint(m, tmp_path / "ckpt")
    (out / "model.safetensors").unlink()
    (out / "manifest.json").unlink()
    torch.save(m.state_dict(), out / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle weights"):
        load_model(out)


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointError, match="no such model directory"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        load_model(tmp_path / "llama")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`python -m sala ...`'s main() in this process (an interpreter start costs ~6 s of imports a
    case): exit code, stdout, stderr."""
    from sala.__main__ import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("setup,needle", [("missing", "no such model directory"), ("noconfig", "no config.json"), ("pickle", "pickle weights")])
def test_cli_one_line_error_and_nonzero_exit(tmp_path, setup, needle, capsys):
    target = tmp_path / "m"
    if setup != "missing":
        target.mkdir()
    if setup == "pickle":
        m = random_model()
        m.config.save_pretrained(target)
        torch.save(m.state_dict(), target / "pytorch_model.bin")
    code, _, err = run_cli(capsys, "generate", "--model", str(target), "hi")
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1


# ---- a checkpoint cannot lie: unlisted files, missing manifests, killed writers ---------------


@pytest.mark.parametrize("sharded", [False, True])
def test_a_shard_outside_the_manifest_is_refused(tmp_path, sharded, capsys):
    """A weight file the manifest does not list is an error for load and for `sala verify`, even
    one the index does not name (loading without an index would read it)."""
    out = save_checkpoint(random_model(), tmp_path / "ckpt", max_shard_bytes=200_000 if sharded else 4 << 30)
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(out / "model-extra.safetensors"))
    expected = f"{out / 'model-extra.safetensors'}: not listed in manifest.json (a file added after the checkpoint was written)"
    with pytest.raises(CheckpointError) as e:
        load_model(out)
    assert str(e.value) == expected
    code, out_text, err = run_cli(capsys, "verify", str(out))
    assert (code, out_text, err.strip()) == (2, "", f"error: {expected}")


def test_a_checkpoint_without_manifest_loads_and_says_once_that_nothing_was_verified(tmp_path, caplog, capsys):
    m = random_model()
    out = save_checkpoint(m, tmp_path / "ckpt")
    (out / "manifest.json").unlink()  # as a Hub checkpoint: no manifest
    with caplog.at_level("WARNING", logger="sala.checkpoint_files"):
        assert same_weights(m, load_model(out))
        assert same_weights(m, load_model(out))
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"{out}: no manifest.json, so nothing in it was verified (loading the files as they are)"]
    code, out_text, err = run_cli(capsys, "verify", str(out))
    assert code == 2 and out_text == ""
    assert err.strip().splitlines()[-1] == (f"error: {out}: no manifest.json, so its files cannot be verified "
                                                 f"(config and {len(m.state_dict())} tensors read fine)")


def test_exchange_paths_swaps_two_directories_in_one_step(tmp_path):
    from sala.checkpoint import atomic_directory
    from sala.checkpoint_files import exchange_paths

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "f").write_text("A")
    (b / "f").write_text("B")
    exchange_paths(a, b)
    assert ((a / "f").read_text(), (b / "f").read_text()) == ("B", "A")
    ino = os.stat(b).st_ino
    with atomic_directory(b, overwrite=True) as tmp:
        (tmp / "f").write_text("C")
        new_ino = os.stat(tmp).st_ino
    # The new directory itself took the target's name (no copy), and the old one is gone.
    assert os.stat(b).st_ino == new_ino != ino and (b / "f").read_text() == "C"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


WRITER = """
import os, sys, torch
torch.set_num_threads(1)
from sala.checkpoint_files import write_checkpoint
from sala.config import SALAConfig

target, config = sys.argv[1], SALAConfig()
states = {v: {f"w{i}": torch.full((256, 1024), float(v)) for i in range(8)} for v in (1, 2)}

def write(v):
    write_checkpoint(target, config, states[v], overwrite=True, max_shard_bytes=2 << 20, producer={"version": v})

write(1)
for _ in sys.stdin:  # one writer per line: it overwrites the target, alternating versions, until killed
    pid = os.fork()
    if pid == 0:
        v = 1
        while True:
            v = 3 - v
            write(v)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_a_writer_killed_at_any_point_leaves_a_complete_verifiable_checkpoint(tmp_path):
    """A process overwriting a sharded checkpoint in a loop is SIGKILLed at random moments; after
    each kill the target verifies against its manifest and holds one whole version, never a mix
    or nothing. The temporaries of killed writers are cleaned by the next write."""
    import random
    import signal
    import time

    from sala.checkpoint import load_state_dict, verify_manifest, write_checkpoint
    from sala.config import SALAConfig

    target = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rng = random.Random(0)
    versions, interrupted = [], 0
    try:
        for _ in range(12):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid = int(proc.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(pid, signal.SIGKILL)
            assert proc.stdout.readline().strip() == "reaped"
            interrupted += any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())
            assert verify_manifest(target)
            state = load_state_dict(target)
            values = {t.unique().item() for t in state.values()}
            assert sorted(state) == [f"w{i}" for i in range(8)] and len(values) == 1, values
            version = json.loads((target / "manifest.json").read_text())["producer"]["version"]
            assert values == {float(version)}
            versions.append(version)
    finally:
        proc.kill()
        proc.wait()
    print(f"versions after each kill {versions}; {interrupted} of 12 kills interrupted a write")
    assert interrupted >= 4  # the kills did land mid-write, not only between writes
    assert set(versions) == {1, 2}
    write_checkpoint(target, SALAConfig(), {"w0": torch.zeros(2)}, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
