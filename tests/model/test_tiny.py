"""tiny-sala: a real trained model with the 9B's architecture features, loadable by transformers."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sala
from sala.checkpoint import load_model
from sala.config import LIGHTNING, SPARSE


def test_architecture_features(tiny_sala_dir):
    cfg = load_model(tiny_sala_dir).config
    kinds = cfg.layer_kinds
    assert kinds[0] == SPARSE and kinds.count(SPARSE) >= 3 and LIGHTNING in kinds
    assert cfg.num_attention_heads // cfg.num_key_value_heads > 1
    assert not cfg.attn_use_rope and cfg.attn_use_output_gate
    assert cfg.lightning_use_rope and cfg.qk_norm and cfg.use_output_gate and cfg.use_output_norm
    assert cfg.scale_emb != 1 and cfg.scale_depth != 1 and cfg.dim_model_base != cfg.hidden_size


def test_heldout_perplexity_recomputed_from_the_checkpoint(tiny_sala_dir):
    """Perplexity on the held-out documents (the ones heldout.txt holds, joined by blank lines),
    computed here from the saved weights and tokenizer one window at a time, agrees with
    sala.tiny.perplexity and with what the builder wrote into the manifest, and is far below an
    add-one unigram model of the training text."""
    from sala.tiny import RECIPE, perplexity, split_corpus

    model = load_model(tiny_sala_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    train, heldout = split_corpus(RECIPE["heldout_every"])
    assert (tiny_sala_dir / "heldout.txt").read_text() == "\n\n".join(heldout)

    def stream(texts):  # <s> text </s> per document, as the model was trained
        return torch.tensor([i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]])

    ids, seq_len = stream(heldout), RECIPE["seq_len"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - seq_len, seq_len):  # every window whose next token exists
            x, y = ids[start:start + seq_len], ids[start + 1:start + seq_len + 1]
            logp = torch.log_softmax(model(x[None], use_cache=False).logits[0].double(), -1)
            nll -= logp.gather(1, y[:, None]).sum().item()
            count += seq_len
    ppl = math.exp(nll / count)
    counts = torch.bincount(stream(train), minlength=len(tok)).double() + 1
    unigram = math.exp(-(counts / counts.sum()).log()[ids[1:]].mean().item())
    claimed = json.loads((tiny_sala_dir / "manifest.json").read_text())["metrics"]
    print(f"tiny-sala held-out ppl {ppl:.3f} (manifest {claimed['heldout_ppl']:.3f}) vs unigram {unigram:.2f}")
    assert perplexity(model, ids, seq_len) == pytest.approx(ppl, rel=1e-4)
    assert claimed["heldout_ppl"] == pytest.approx(ppl, rel=1e-3)
    assert claimed["unigram_ppl"] == pytest.approx(unigram, rel=1e-6)
    assert ppl < unigram / 4


def test_transformers_auto_classes_load_and_generate(tiny_sala_dir):
    sala.register()
    ours = load_model(tiny_sala_dir)
    auto = AutoModelForCausalLM.from_pretrained(tiny_sala_dir)
    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    assert type(auto).__name__ == "MiniCPMSALAForCausalLM"  # the architecture config.json names
    enc = tok(["The for statement", "A list is"], return_tensors="pt", padding=True, padding_side="left")
    assert enc["input_ids"][0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        a = auto(**enc, use_cache=False).logits
        b = ours(**enc, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    out = auto.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 8)
    assert all(len(t) > 0 for t in tok.batch_decode(out[:, -8:], skip_special_tokens=True))


def test_chat_template_is_chatml(tiny_sala_dir):
    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg = load_model(tiny_sala_dir).config
    assert tok.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_id


def test_tool_call_token_takes_an_unused_id(tiny_sala_dir):
    """<|tool_call|> is one special token, at the id of a token that no held-out text encodes to
    (as no training text did: the build checks it), in a vocabulary of the model's size."""
    from sala.tiny import TOOL_CALL_TOKEN, heldout_texts

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    (token_id,) = tok.encode(TOOL_CALL_TOKEN, add_special_tokens=False)
    assert TOOL_CALL_TOKEN in tok.all_special_tokens and tok.decode([token_id]) == TOOL_CALL_TOKEN
    assert len(tok) == load_model(tiny_sala_dir).config.vocab_size
    assert token_id not in tok("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
