"""sala.realwidth: random-weight checkpoints at the 9B model's widths, written a shard at a time.

One 1-layer checkpoint (1.7 GB) is written in a subprocess with 256 MiB shards, which measures
its own peak memory; a second, cached by ensure_realwidth with the default 2 GiB shards (one
file), must hold the same bytes.
"""
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from sala.checkpoint import INDEX, load_model, verify_manifest
from sala.config import MINICPM_SALA_9B
from sala.realwidth import INIT_STD, ensure_realwidth, main, make_tensor, realwidth_config
from tests.conftest import ROOT

SHARD = 256 << 20
H, FFN, VOCAB, KV = 4096, 16384, 73448, 256  # 2 KV heads x 128 in sparse layers
# Parameters by hand from the released architecture: q, o, output gate (H x H) and k, v (KV x H)
# in a sparse layer; q, k, v, o, z (H x H), q/k norms (128) and the output norm (H) in a lightning
# layer; the MLP and two RMSNorms in both.
MLP_AND_NORMS = 3 * H * FFN + 2 * H
SPARSE_LAYER = 3 * H * H + 2 * KV * H + MLP_AND_NORMS
LIGHTNING_LAYER = 5 * H * H + 2 * 128 + H + MLP_AND_NORMS
ONE_LAYER_BYTES = 2 * (2 * VOCAB * H + SPARSE_LAYER + H)

# Writes in a fresh process, reporting the growth of its peak RSS over its RSS after imports
# (the kernel's high-water mark, reset first: exact, not sampled).
WRITER = """
import json, sys
from bench.memwatch import restart_high_water_mark, status_bytes
from sala.realwidth import write_realwidth

before = restart_high_water_mark()
write_realwidth(sys.argv[1], 1, seed=0, max_shard_bytes=int(sys.argv[2]))
print(json.dumps({"growth": status_bytes("VmHWM") - before}))
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    target = tmp_path_factory.mktemp("realwidth") / "n1"
    out = subprocess.run([sys.executable, "-c", WRITER, str(target), str(SHARD)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return target, json.loads(out.stdout.splitlines()[-1])["growth"]


def headers(path):
    """name -> (shape, dtype) of every tensor, in the index's order, read from the shards' headers."""
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    out = {}
    for name, fname in weight_map.items():
        with safe_open(str(path / fname), framework="pt") as f:
            s = f.get_slice(name)
            out[name] = (tuple(s.get_shape()), s.get_dtype())
    return out


def test_writing_holds_a_shard_or_a_tensor_not_the_model(written):
    path, growth = written
    assert sum(p.stat().st_size for p in path.glob("*.safetensors")) == pytest.approx(ONE_LAYER_BYTES, abs=4096)
    embedding = 2 * VOCAB * H  # the largest tensor, a shard of its own: held whole once
    assert 0.9 * embedding < growth < 0.6 * ONE_LAYER_BYTES, f"peak RSS grew {growth / 2**20:.0f} MiB"


def test_shards_are_filled_in_order_up_to_max_shard_bytes(written):
    path, _ = written
    index = json.loads((path / INDEX).read_text())
    files = list(dict.fromkeys(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in path.glob("*.safetensors")) == files and len(files) >= 4
    sizes = {name: math.prod(shape) * 2 for name, (shape, _) in headers(path).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values()) == ONE_LAYER_BYTES
    shards = [[n for n, f in index["weight_map"].items() if f == fname] for fname in files]
    for i, names in enumerate(shards):
        total = sum(sizes[n] for n in names)
        assert total <= SHARD or len(names) == 1
        if i + 1 < len(shards):  # the next shard starts only because its first tensor did not fit
            assert total + sizes[shards[i + 1][0]] > SHARD
        with safe_open(str(path / files[i]), framework="pt") as f:
            assert set(f.keys()) == set(names)


def test_names_shapes_and_order_are_the_models(written):
    from sala.model import SALAForCausalLM

    path, _ = written
    config = realwidth_config(1)
    with torch.device("meta"):
        expected = {k: (tuple(v.shape), "BF16") for k, v in SALAForCausalLM(config).state_dict().items()}
    assert list(headers(path).items()) == list(expected.items())


def test_config_is_the_released_one_cut_to_n_layers(written):
    path, _ = written
    on_disk = json.loads((path / "config.json").read_text())
    for key, value in MINICPM_SALA_9B.items():
        # No remote code is shipped, so no auto_map; transformers writes rope_scaling into rope_parameters.
        if key not in ("num_hidden_layers", "mixer_types", "auto_map", "transformers_version", "rope_scaling"):
            assert on_disk[key] == value, key
    assert on_disk["rope_parameters"] == {"rope_theta": MINICPM_SALA_9B["rope_theta"], "rope_type": "default"}
    assert on_disk["num_hidden_layers"] == 1 and on_disk["mixer_types"] == ["minicpm4"]
    for n in (2, 4, 32):
        assert realwidth_config(n).mixer_types == MINICPM_SALA_9B["mixer_types"][:n]
    kinds = realwidth_config(32).layer_kinds
    assert kinds.count("minicpm4") == 8 and kinds[:2] == ["minicpm4", "lightning-attn"]
    with pytest.raises(ValueError, match="1..32"):
        realwidth_config(33)


def test_full_model_has_the_9b_parameter_count():
    from sala.realwidth import parameter_specs

    specs = parameter_specs(realwidth_config(32))
    assert sum(math.prod(shape) for shape, _ in specs.values()) == 2 * VOCAB * H + 8 * SPARSE_LAYER + 24 * LIGHTNING_LAYER + H


def test_values_depend_on_seed_and_name_only(written, tmp_path, monkeypatch, capsys):
    """The cached copy (one 2 GiB shard) holds the same bytes as the 256 MiB shards; each tensor
    is what make_tensor draws for it alone; another seed draws other values."""
    path, _ = written
    monkeypatch.setenv("SALA_HOME", str(tmp_path))
    cached = ensure_realwidth(1, seed=0, progress=False)
    assert [p.name for p in cached.glob("*.safetensors")] == ["model.safetensors"] and not (cached / INDEX).exists()
    assert ensure_realwidth(1, seed=0, progress=False) == cached  # reused: written once
    specs = {n: s for n, (s, _) in headers(path).items()}
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    with safe_open(str(cached / "model.safetensors"), framework="pt") as one:
        for name, fname in weight_map.items():
            with safe_open(str(path / fname), framework="pt") as sharded:
                a, b = sharded.get_tensor(name), one.get_tensor(name)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
        k = "model.layers.0.self_attn.k_proj.weight"
        alone = make_tensor(k, specs[k], "normal", seed=0)
        assert torch.equal(alone.view(torch.int16), one.get_tensor(k).view(torch.int16))
        other = make_tensor(k, specs[k], "normal", seed=1)
        assert (other != alone).float().mean() > 0.99
        q, o = (one.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qo")  # same shape, own values
        assert (q != o).float().mean() > 0.99
        embed = one.get_tensor("model.embed_tokens.weight").float()
        assert embed.std().item() == pytest.approx(INIT_STD, rel=0.01) and abs(embed.mean().item()) < 1e-4
        assert torch.equal(one.get_tensor("model.norm.weight"), torch.ones(H, dtype=torch.bfloat16))

    assert main(["--layers", "1"]) == 0  # the command line finds the cached copy
    printed = capsys.readouterr().out.splitlines()
    summary = json.loads(printed[-1])
    assert printed[0] == str(cached) == summary["path"]
    assert summary["bytes"] == ONE_LAYER_BYTES == 2 * summary["parameters"] and summary["shards"] == 1


def test_manifest_lists_every_file(written):
    path, _ = written
    assert verify_manifest(path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["producer"]["name"] == "sala.realwidth"
    assert manifest["producer"]["num_layers"] == 1 and manifest["producer"]["seed"] == 0
    assert {"config.json", "generation_config.json", "tokenizer.json", INDEX} <= set(manifest["files"])


def test_tokenizer_has_every_model_id(written):
    path, _ = written
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB and sorted(tok.get_vocab().values()) == list(range(VOCAB))
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<|im_end|>", "<|im_start|>", "<|tool_call|>")}
    assert list(ids.values()) == [0, 1, 2, 73440, 73441, 73442]
    config = json.loads((path / "config.json").read_text())
    assert (tok.bos_token_id, tok.pad_token_id, [tok.eos_token_id, ids["<|im_end|>"]]) == (
        config["bos_token_id"], config["pad_token_id"], config["eos_token_id"])
    text = "Hello, wörld! 数字 🙂\n\tindented  <b>tags</b> \x00\x7f"
    enc = tok(text)["input_ids"]
    assert enc[0] == 1 and tok.decode(enc, skip_special_tokens=True) == text
    decoded = tok.batch_decode([[i] for i in range(VOCAB)])
    assert all(isinstance(d, str) and d for d in decoded)
    assert decoded[73440:] == ["<|im_end|>", "<|im_start|>", "<|tool_call|>"] + [f"<|reserved_{i}|>" for i in range(73443, VOCAB)]
    assert decoded[3 + ord("A")] == "A"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == 73441 and chat_ids.count(73440) == 1


def test_loaded_model_gives_finite_logits(written):
    path, _ = written
    model = load_model(path)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.layer_kinds == ["minicpm4"]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()
    # RMS 0.08 at INIT_STD (sala/realwidth.py): spread, neither saturated nor collapsed
    assert 0.04 < logits.pow(2).mean().sqrt().item() < 0.16
    assert logits.argmax(-1).unique().numel() > 12


def test_command_line_refuses_bad_layers_in_one_line(capsys):
    for bad in ("0", "33"):
        assert main(["--layers", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--layers must be 1..32" in err
