"""`python -m sala.quant` on tiny-sala with small settings: the checkpoint it writes, what it
prints, and the one-line errors (exit 2, nothing written) for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sala.checkpoint import load_model
from sala.quant.__main__ import main
from sala.quant.linear import NVFP4Linear

ROOT = Path(__file__).resolve().parents[1]
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
    assert all(float(ln.split()[4]) < float(ln.split()[3]) for ln in table)  # GPTQ: output err below weight err

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["producer"]["name"] == "sala.quant"
    assert (manifest["producer"]["method"], manifest["producer"]["scale_rule"]) == ("gptq", "4over6")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert (out / "tokenizer.json").exists()

    ppl = next(ln for ln in lines if ln.startswith("perplexity")).split()
    assert 1 < float(ppl[1]) < 1000 and float(ppl[2]) < 1.2 * float(ppl[1])
    kl = float(next(ln for ln in lines if ln.startswith("mean KL")).split()[4])
    assert 0 < kl < 0.1


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

