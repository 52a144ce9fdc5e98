"""tiny-sala: a real trained model with the 9B's architecture features, loadable by transformers."""
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sala  # noqa: F401
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


def test_heldout_perplexity_far_below_unigram(tiny_sala_dir):
    m = json.loads((tiny_sala_dir / "manifest.json").read_text())["metrics"]
    print(f"tiny-sala held-out ppl {m['heldout_ppl']:.2f} vs unigram {m['unigram_ppl']:.2f}")
    assert m["heldout_ppl"] < m["unigram_ppl"] / 4


def test_transformers_auto_classes_load_and_generate(tiny_sala_dir):
    ours = load_model(tiny_sala_dir)
    auto = AutoModelForCausalLM.from_pretrained(tiny_sala_dir)
    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    assert type(auto).__name__ == "SALAForCausalLM"
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
