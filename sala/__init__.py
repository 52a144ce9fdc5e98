"""sala: MiniCPM-SALA in plain PyTorch, with quantization, KV compression and serving around it.

`sala.register()` puts SALA's config, model and tokenizer classes in transformers' Auto classes
(sala/hf.py registers them as it loads: this imports it), so that
`AutoModelForCausalLM.from_pretrained(dir)` works without `trust_remote_code`. `import sala`
calls it when transformers' Auto model classes are already loaded (registering then imports
nothing more); otherwise it imports nothing, so a scoring client (sala.eval.logprob) runs on
numpy alone, with or without torch installed, and an engine never loads transformers' model code.
"""
import sys


def register() -> None:
    """Register SALA with transformers' Auto classes; idempotent."""
    import sala.hf  # noqa: F401  (its import registers them)


if "transformers.models.auto.modeling_auto" in sys.modules:
    register()
