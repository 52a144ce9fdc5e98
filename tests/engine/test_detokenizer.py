"""IncrementalDetokenizer against full decodes.

The reference decodes the whole sequence at once, as a client would after the fact: the output
text is decode(prompt + output) less the characters of decode(prompt). Stop strings: after each
token, that full decode is searched for the stop strings (the first occurrence, the longest at
the same place), as the engine checks them token by token. Token streams: tiny-sala's byte-level
BPE on real text with multi-byte characters (CJK, emoji, accents) cut at every token, random
token ids including special tokens, and a SentencePiece-style tokenizer (metaspace, byte
fallback) built here, whose decode drops a leading space that mid-sentence must stay.
"""
import json
import random

import pytest

from sala.engine.detokenizer import IncrementalDetokenizer
from sala.tiny import heldout_texts

MULTIBYTE = "naïve café — ünïcode ✓ 東京 and plain ascii; emoji 🙂 end. 日本語のテキスト, 中文文本 🎉🚀 Ωμέγα."


def naive(tok, prompt, out, skip=True):
    return tok.decode(prompt + out, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)) :]


def reference(tok, prompt, out, stop=(), skip=True, no_stop_trim=False):
    """(text, matched stop): the full decode after each token, searched for the stop strings. One
    that ends in U+FFFD ends in a character still to come: its text waits for the next token's."""
    text = ""
    for k in range(1, len(out) + 1):
        if (full := naive(tok, prompt, out[:k], skip)).endswith("\ufffd"):
            continue
        text = full
        hits = [(i, s) for s in stop if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            return text[: i + len(s) if no_stop_trim else i], s
    return text, None


def run(tok, prompt, out, stop=(), skip=True, no_stop_trim=False):
    """Feed `out` token by token; (text, matched, the deltas streamed)."""
    d = IncrementalDetokenizer(tok, prompt, list(stop), skip, no_stop_trim)
    deltas, matched = [], None
    for t in out:
        matched = d.append(t)
        if matched is not None:
            break
        deltas.append(d.delta(finished=False))
        assert len(d.text) - d.emitted >= min(d.holdback, len(d.text))  # a possible stop's start stays back
    deltas.append(d.delta(finished=True))
    assert "".join(deltas) == d.text
    return d.text, matched, deltas


@pytest.fixture(scope="module")
def streams(tokenizer, tiny_sala_dir):
    """Token streams of real text: held-out prose and multi-byte text."""
    held = heldout_texts(tiny_sala_dir)
    texts = ["\n\n".join(held[:12]), "\n\n".join(held[40:60]), MULTIBYTE, MULTIBYTE.replace(" ", "")]
    return [tokenizer(t)["input_ids"][:160] for t in texts]


def test_text_equals_full_decode_at_every_cut(tokenizer, streams):
    """Every cut of each stream into prompt and output, the multi-byte ones mid-character too."""
    split_chars = 0
    for ids in streams:
        for cut in range(1, len(ids)):
            prompt, out = ids[:cut], ids[cut:]
            text, matched, deltas = run(tokenizer, prompt, out)
            assert text == naive(tokenizer, prompt, out), (cut, tokenizer.convert_ids_to_tokens(ids[cut - 2 : cut + 2]))
            assert matched is None
            if tokenizer.decode(prompt).endswith("\ufffd"):
                split_chars += 1
            else:  # a character is whole in the output or not at all: no half of one is streamed
                assert all("\ufffd" not in p for p in deltas)
    assert split_chars > 10  # the prompt cut through a character: its end is the prompt's


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids(tokenizer, skip):
    """Random ids from the whole vocabulary, special tokens included (dense in the first 16)."""
    rng = random.Random(7 + skip)
    special = tokenizer.all_special_ids
    assert set(special) >= {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    for _ in range(60):
        draw = [rng.choice(special) if rng.random() < 0.15 else rng.randrange(len(tokenizer)) for _ in range(48)]
        cut = rng.randrange(0, 12)
        prompt, out = draw[:cut], draw[cut:]
        text, _, _ = run(tokenizer, prompt, out, skip=skip)
        assert (text, None) == reference(tokenizer, prompt, out, (), skip)
        for s in tokenizer.all_special_tokens:
            assert (s in text) == (not skip and tokenizer.convert_tokens_to_ids(s) in out)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_strings_split_across_tokens(tokenizer, streams, no_stop_trim):
    """Stop strings taken from the output text across token boundaries (multi-byte ones too), alone,
    with decoys that never occur, and two at once; text and matched stop as the full decode has them."""
    rng = random.Random(3)
    checked = multi_token = 0
    for ids in streams:
        prompt, out = ids[:6], ids[6:120]
        full = naive(tokenizer, prompt, out)
        for _ in range(25):
            start = rng.randrange(0, len(full) - 8)
            stop = full[start : start + rng.randint(2, 7)]
            if "\ufffd" in stop:
                continue
            for stops in ([stop], [stop, "never §§ occurs"], [stop, full[start + 1 : start + 3], "zzqq"]):
                want = reference(tokenizer, prompt, out, stops, no_stop_trim=no_stop_trim)
                text, matched, _ = run(tokenizer, prompt, out, stops, no_stop_trim=no_stop_trim)
                assert (text, matched) == want, stops
                checked += 1
            # the stop string spans tokens: its text is not any one token's
            multi_token += not any(stop in tokenizer.decode([t]) for t in out)
    assert checked > 150 and multi_token > 40


def test_stop_on_a_special_token_text_and_check_stop(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = tokenizer("hello there 東京")["input_ids"][1:]
    prompt, out = tokenizer("say:")["input_ids"], body + [im_end] + body
    # kept: <|im_end|> is text that a stop string matches; skipped: it is not there to match
    assert run(tokenizer, prompt, out, ["<|im_end|>"], skip=False)[:2] == (tokenizer.decode(body), "<|im_end|>")
    assert run(tokenizer, prompt, out, ["<|im_end|>"], skip=True)[:2] == (naive(tokenizer, prompt, out), None)
    # check_stop False (before min_tokens): a stop completed then is not looked for again
    d = IncrementalDetokenizer(tokenizer, prompt, ["東京"])
    assert [d.append(t, check_stop=False) for t in body] == [None] * len(body)
    assert d.append(body[0]) is None and d.text == naive(tokenizer, prompt, body + body[:1])


def metaspace_tokenizer(texts):
    """A Llama-style tokenizer (SentencePiece BPE as tokenizer.json has it): metaspace, byte
    fallback for characters outside its small alphabet, a decoder that strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = norm
    base.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                        limit_alphabet=60, show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_style_tokenizer(tiny_sala_dir):
    texts = heldout_texts(tiny_sala_dir)[:20]
    tok = metaspace_tokenizer(texts)
    ids = tok(texts[0][:300] + " " + MULTIBYTE)["input_ids"]
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))  # byte fallback in use
    word = next(i for i in range(2, len(ids)) if tok.convert_ids_to_tokens(ids[i]).startswith("▁"))
    assert not tok.decode(ids[word:]).startswith(" ")  # decoded alone, a word loses its space
    whole = 0
    for cut in range(1, len(ids)):
        # Cut through a character, the prompt's run of byte tokens decodes as U+FFFDs, one a byte,
        # and a decode less the prompt's is no output text: such cuts only must not fail.
        text, _, deltas = run(tok, ids[:cut], ids[cut:])
        if not tok.decode(ids[:cut]).endswith("\ufffd"):
            assert text == naive(tok, ids[:cut], ids[cut:]), cut
            assert all("\ufffd" not in p for p in deltas)
            whole += 1
    assert whole > 60
    assert run(tok, ids[:word], ids[word:])[0].startswith(" ")  # mid-sentence, it keeps it


def test_a_decoder_that_rewrites_its_text_does_not_stop_the_engine(tokenizer):
    """DecodeStream raises when a decode no longer starts with the text it gave; the detokenizer
    goes on from the token (none of SALA's tokenizers does that: simulated)."""
    ids = tokenizer("one two three four")["input_ids"]
    d = IncrementalDetokenizer(tokenizer, ids[:2], [])

    class Rewrites:
        def step(self, backend, token):
            raise Exception("Invalid prefix encountered")

    d.append(ids[2])
    d.stream = Rewrites()
    d.append(ids[3])
    for t in ids[4:]:
        d.append(t)
    assert d.text == tokenizer.decode(ids[2:])  # byte-level BPE: a token's text needs no context


def test_a_tokenizer_without_a_fast_backend_is_refused():
    class Slow:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    with pytest.raises(TypeError, match="fast"):
        IncrementalDetokenizer(Slow(), [1, 2], [])
