"""Checkpoint directories: bit-exact round trips, corruption detection, clear errors on bad input."""
import json
import subprocess
import sys

import pytest
import torch

from sala.checkpoint import CheckpointError, load_model, save_checkpoint
from tests.test_model import random_model


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


@pytest.mark.parametrize("setup,needle", [("missing", "no such model directory"), ("noconfig", "no config.json"), ("pickle", "pickle weights")])
def test_cli_one_line_error_and_nonzero_exit(tmp_path, setup, needle):
    target = tmp_path / "m"
    if setup != "missing":
        target.mkdir()
    if setup == "pickle":
        m = random_model()
        m.config.save_pretrained(target)
        torch.save(m.state_dict(), target / "pytorch_model.bin")
    r = subprocess.run([sys.executable, "-m", "sala", "generate", "--model", str(target), "hi"], capture_output=True, text=True)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
