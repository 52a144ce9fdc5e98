"""sala: MiniCPM-SALA in plain PyTorch, with quantization, KV compression and serving around it.

The model is registered with transformers' Auto classes as soon as transformers is loaded
(now, if it already is; else right after whoever imports it), so after `import sala`
`AutoModelForCausalLM.from_pretrained(dir)` works without `trust_remote_code`. Until then
nothing imports torch: a scoring client (sala.eval.logprob) runs on numpy alone, with or
without torch installed.
"""
import importlib.abc
import importlib.util
import sys


def _initializing(name: str) -> bool:
    """Whether module `name` is part-way through its own import."""
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def register_with_transformers() -> None:
    """SALA's config, model and tokenizer classes in transformers' Auto classes (sala/config.py
    and sala/model.py register theirs as they load)."""
    if not _initializing("sala.model"):
        import sala.model  # noqa: F401


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Registers SALA once transformers has loaded, whoever imported it: right after transformers
    itself, or, when sala/config.py imported it (part-way through: SALAConfig does not exist
    yet), right after sala/config.py. When sala/model.py is part-way through, it registers as it
    ends."""

    def __init__(self):
        self.watched = {"transformers", "sala.config"}

    def find_spec(self, name, path=None, target=None):
        if name not in self.watched:
            return None
        self.watched.discard(name)
        sys.meta_path.remove(self)  # the real spec, without coming back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.watched:
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                if name == "sala.config" or not _initializing("sala.config"):
                    register_with_transformers()

            spec.loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    register_with_transformers()
elif importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None:
    sys.meta_path.insert(0, _AfterTransformers())
