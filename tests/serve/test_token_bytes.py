"""TokenBytes (serve/token_bytes.py): the bytes OpenAI's logprob `bytes` report for each token."""
from serve.token_bytes import TokenBytes


def test_token_bytes_are_the_tokens_own_bytes(tokenizer):
    """Byte-level BPE: the bytes of a multi-byte character's pieces join to its UTF-8, though each
    piece alone decodes to U+FFFD."""
    to_bytes = TokenBytes(tokenizer)
    for text in ("naïve café 東京 🙂", "tabs\tand\nnewlines  x", "<|im_end|> plain"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(to_bytes(i) for i in ids) == text.encode()
    partial = [i for i in tokenizer("東京", add_special_tokens=False)["input_ids"] if tokenizer.decode([i]) == "\ufffd"]
    assert partial and all(to_bytes(i) != "\ufffd".encode() for i in partial)
