"""`python -m sala.quant` on tiny-sala with small settings: the checkpoint it writes, what it
prints, and the one-line errors (exit 2, nothing written) for bad input."""
import json
import subprocess
import sys

import pytest
import torch

from sala.checkpoint import load_model
from sala.quant.__main__ import main
from sala.quant.linear import NVFP4Linear
from tests.conftest import ROOT

SMALL = ["--num-samples", "4", "--seq-len", "64", "--eval-sequences", "4"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "sala.quant", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.fixture(scope="module")
def gptq_run(tiny_sala_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "gptq"
    r = cli("--model", str(tiny_sala_dir), "--output", str(out), *SMALL)
    assert r.returncode == 0, r.stderr
    return out, r


def test_default_run_writes_a_gptq_fourofsix_checkpoint(gptq_run, tiny_sala_dir):
    out, r = gptq_run
    print(r.stdout)
    assert "quantizing layers" in r.stderr  # tqdm progress
    lines = r.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if "M=4 share" in ln)
    assert lines[header].split() == ["layer", "module", "M=4", "share", "weight", "err", "output", "err", "seconds"]
    model = load_model(out, dtype=torch.float32)
    quantized = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    table = lines[header + 1 : header + 1 + len(quantized)]
    assert sorted(f"model.layers.{ln.split()[0]}.{ln.split()[1]}" for ln in table) == sorted(quantized)
    shares = [float(ln.split()[2].rstrip("%")) / 100 for ln in table]
    assert all(0.2 < s < 0.7 for s in shares)  # FourOverSix on: a real share of blocks scaled to 4

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["producer"]["name"] == "sala.quant"
    assert (manifest["producer"]["method"], manifest["producer"]["scale_rule"]) == ("gptq", "4over6")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert (out / "tokenizer.json").exists()

    ppl = next(ln for ln in lines if ln.startswith("perplexity")).split()
    assert 1 < float(ppl[1]) < 1000 and float(ppl[2]) < 1.2 * float(ppl[1])
    kl = float(next(ln for ln in lines if ln.startswith("mean KL")).split()[4])
    assert 0 < kl < 0.1


def test_gptq_beats_rtn_on_the_same_calibration_inputs(gptq_run, tiny_sala_dir):
    """Replay the CLI's calibration through the model as GPTQ saw it (layer i's inputs went through
    the GPTQ layers before it) and measure, from the captured inputs X of every Linear,
    ||X dW^T||^2 / ||X W^T||^2 for the checkpoint's GPTQ weights and for round-to-nearest in the
    same frame (same scale rule and fused-group amax): GPTQ's output error is lower for every
    module, and the CLI's printed output errors are these numbers."""
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model
    from sala.eval import calibration as cal
    from sala.quant.layerwise import layer_groups
    from sala.quant.nvfp4 import quantize_rtn

    out, r = gptq_run
    lines = r.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if "M=4 share" in ln)
    printed = {f"{ln.split()[0]}.{ln.split()[1]}": float(ln.split()[4]) for ln in lines[header + 1:]
               if ln.split()[:1] and ln.split()[0].isdigit()}
    model = load_model(tiny_sala_dir, dtype=torch.float32)
    gptq = dict(load_model(out, dtype=torch.float32, packed=False).named_parameters())
    seqs = cal.calibration_sequences(AutoTokenizer.from_pretrained(tiny_sala_dir), 4, 64)  # SMALL's
    m = model.model
    h = m.embed_tokens(seqs) * model.config.scale_emb
    rope = m.rope(torch.arange(seqs.shape[1]).expand(seqs.shape[0], -1))
    ratios = []
    for i, layer in enumerate(m.layers):
        named = dict(layer.named_modules())
        inputs = {}
        hooks = [named[mod].register_forward_pre_hook(lambda _m, a, mod=mod: inputs.__setitem__(mod, a[0].detach()))
                 for gs in layer_groups(layer).values() for g in gs for mod in g]
        with torch.no_grad():
            layer(h, rope, None, None, seqs.shape[1])
        for hk in hooks:
            hk.remove()
        for group in (g for gs in layer_groups(layer).values() for g in gs):
            amax = max(named[mod].weight.abs().max() for mod in group)
            for mod in group:
                w, x = named[mod].weight.detach(), inputs[mod].reshape(-1, named[mod].in_features)

                def out_err(q):
                    return ((x @ (q - w).T).square().sum() / (x @ w.T).square().sum()).item()

                e_gptq = out_err(gptq[f"model.layers.{i}.{mod}.weight"])
                e_rtn = out_err(quantize_rtn(w, "4over6", global_amax=amax).dequantize())
                assert e_gptq < e_rtn, (i, mod, e_gptq, e_rtn)
                assert printed[f"{i}.{mod}"] == pytest.approx(e_gptq, rel=0.02, abs=2e-5), (i, mod)
                ratios.append(e_gptq / e_rtn)
        for mod in (mod for gs in layer_groups(layer).values() for g in gs for mod in g):
            named[mod].weight.data = gptq[f"model.layers.{i}.{mod}.weight"]
        with torch.no_grad():
            h = layer(h, rope, None, None, seqs.shape[1])
    print(f"GPTQ / RTN output error over {len(ratios)} modules: mean {sum(ratios) / len(ratios):.3f}, max {max(ratios):.3f}")
    assert sum(ratios) / len(ratios) < 0.8


def test_rtn_with_plain_nvfp4_and_a_jsonl_calibration_set(tiny_sala_dir, tmp_path):
    data = tmp_path / "calib.jsonl"
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "rtn"
    r = cli("--model", str(tiny_sala_dir), "--output", str(out), "--method", "rtn", "--scale-rule", "6",
            "--calibration", str(data), *SMALL)
    assert r.returncode == 0, r.stderr
    table = [ln for ln in r.stdout.splitlines() if ln.split()[:1] and ln.split()[0].isdigit()]
    assert table and all(ln.split()[2] == "0.0%" for ln in table)  # plain NVFP4: no block scaled to 4
    producer = json.loads((out / "manifest.json").read_text())["producer"]
    assert (producer["method"], producer["scale_rule"]) == ("rtn", "6")
    load_model(out)


# ---- bad input: one line on stderr, exit 2, nothing written ---------------------------------


def run_main(capsys, *args) -> str:
    """main() in-process, sparing an interpreter start-up per case (the subprocess runs above
    cover the entry point); returns the error line after checking the exit code and that
    nothing went to stdout."""
    assert main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_already_quantized_checkpoint_is_refused(capsys, gptq_run, tmp_path):
    quantized, _ = gptq_run
    err = run_main(capsys, "--model", str(quantized), "--output", str(tmp_path / "again"))
    assert err == (f"error: {quantized}: already quantized (config.json has a quantization_config); "
                   "quantize the unquantized checkpoint")
    assert not (tmp_path / "again").exists()


def test_missing_model_directory(capsys, tmp_path):
    err = run_main(capsys, "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
    assert err == f"error: {tmp_path / 'nope'}: no such model directory"
    assert list(tmp_path.iterdir()) == []


def test_in_features_not_a_multiple_of_16(capsys, tiny_sala_dir, tmp_path):
    model = tmp_path / "odd"
    model.mkdir()
    config = json.loads((tiny_sala_dir / "config.json").read_text())
    config["intermediate_size"] = 200  # down_proj in-features 200 = 12.5 groups
    (model / "config.json").write_text(json.dumps(config))
    err = run_main(capsys, "--model", str(model), "--output", str(tmp_path / "out"))
    assert err == (f"error: {model}: model.layers.0.mlp.down_proj has in-features 200, "
                   "not a multiple of the NVFP4 group size 16")
    assert not (tmp_path / "out").exists()


def test_empty_calibration_set(capsys, tiny_sala_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = run_main(capsys, "--model", str(tiny_sala_dir), "--output", str(tmp_path / "out"), "--calibration", str(empty))
    assert err == f"error: {empty}: dataset is empty"
    assert not (tmp_path / "out").exists()


def test_calibration_shorter_than_one_sequence(capsys, tiny_sala_dir, tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "x = 1"}) + "\n")
    err = run_main(capsys, "--model", str(tiny_sala_dir), "--output", str(tmp_path / "out"), "--calibration", str(tiny))
    assert "fewer than one sequence of 256" in err
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(capsys, tiny_sala_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = run_main(capsys, "--model", str(tiny_sala_dir), "--output", str(out))
    assert err == f"error: {out} exists; pass --overwrite to replace it"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_argument_errors_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--output", str(tmp_path / "out"), "--num-samples", "0"])
    assert e.value.code == 2
    assert "--num-samples must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path / "out"), "--scale-rule", "8"])
    assert not (tmp_path / "out").exists()

