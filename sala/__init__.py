"""sala: MiniCPM-SALA in plain PyTorch, with quantization, KV compression and serving around it.

`sala.register()` puts SALA's config, model and tokenizer classes in transformers' Auto classes
(sala/config.py and sala/model.py register theirs as they load: this imports them), so that
`AutoModelForCausalLM.from_pretrained(dir)` works without `trust_remote_code`. `import sala`
calls it when transformers is already loaded; otherwise it imports nothing, so a scoring client
(sala.eval.logprob) runs on numpy alone, with or without torch installed.
"""
import sys


def register() -> None:
    """Register SALA with transformers' Auto classes; idempotent."""
    import sala.model  # noqa: F401  (its import registers the model, sala.config's the config and tokenizer)


if "transformers" in sys.modules:
    register()
