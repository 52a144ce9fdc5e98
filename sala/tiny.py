"""tiny-sala: a small real MiniCPM-SALA model built locally, the default model of every command.

Built from text every CPython ships (pydoc_data.topics plus stdlib docstrings), so nothing is
downloaded: a byte-level BPE tokenizer with ChatML special tokens, then a SALA model with the
same architecture features as the 9B config (first layer sparse, three sparse layers with GQA,
NoPE and output gate, lightning layers with QK-norm, RoPE, output norm and gate, muP scalings),
trained on 2 CPU cores in a few minutes. Deterministic from the seed; cached under $SALA_HOME by
a hash of the recipe, so a changed recipe builds a new model instead of reusing a stale one.

    python -m sala.tiny            # build (or reuse) and print perplexities and a sample
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import functools
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from sala.config import LIGHTNING, SPARSE, SALAConfig
from sala.home import sala_home
from sala.process_exit import exit_now

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# The trigger of tiny-sala's tool calls, a special token as in MiniCPM's tokenizers: after it the
# model writes the call in Python syntax (the minicpm tool-call format, sala/tools/minicpm.py).
# Given after training (with_tool_call_token), in place of the learned token TOOL_CALL_REPLACES:
# the tail of the ChatML markers, which BPE learned from their text, which no text of the corpus
# encodes to (the markers are special tokens) and which no later merge builds on. The vocabulary's
# size and the weights stay as trained.
TOOL_CALL_TOKEN = "<|tool_call|>"
TOOL_CALL_REPLACES = "|>"
# ChatML, plus tools: listed in a system turn, an assistant turn's calls written after its text in
# the minicpm format (arguments as a dict, the transformers convention), results in `tool` turns.
# `enable_thinking` (given as a chat_template_kwarg) opens a <think> block, or closes an empty one.
# A conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    # A value of a call's arguments as Python writes it.
    "{%- macro py(v) -%}"
    "{%- if v is none -%}None"
    "{%- elif v is boolean -%}{{ 'True' if v else 'False' }}"
    "{%- elif v is string or v is number -%}{{ v | tojson }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v.items() -%}{{ k | tojson }}: {{ py(x) }}{{ ', ' if not loop.last }}"
    "{%- endfor -%}{{ '}' }}"
    "{%- else -%}[{%- for x in v -%}{{ py(x) }}{{ ', ' if not loop.last }}{%- endfor -%}]"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\nTo call a function, write <|tool_call|>name(argument=value, ...); its result comes back in a tool "
    "turn. The functions:\\n' }}"
    "{%- for tool in tools -%}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\\n' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{ '<|tool_call|>' + f['name'] + '(' }}"
    "{%- for k, v in f['arguments'].items() -%}{{ k + '=' }}{{ py(v) }}{{ ', ' if not loop.last }}{%- endfor -%}"
    "{{ ')' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined -%}{{ '<think>\\n' if enable_thinking else '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)
# Modules whose docstrings extend the corpus: fixed and sorted, so the corpus is reproducible.
DOC_MODULES = sorted([
    "argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "io", "glob",
    "json", "logging", "calendar", "os", "pathlib", "pickle", "random", "re", "shutil", "socket",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
])

RECIPE = {
    "seed": 1234,
    "vocab_size": 2048,
    "seq_len": 256,
    "batch_size": 16,
    "steps": 360,
    "lr": 3e-3,
    "warmup": 30,
    "heldout_every": 10,
    "config": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        mixer_types=[SPARSE, LIGHTNING, LIGHTNING, LIGHTNING, SPARSE, LIGHTNING, LIGHTNING, SPARSE],
        scale_emb=12.0,
        scale_depth=1.4,
        dim_model_base=32,
        initializer_range=0.05,
        sparse_config={"dense_len": 8192},
    ),
}


@functools.lru_cache(maxsize=None)
def stdlib_definitions(name: str) -> tuple[str, list[tuple[str, str, str]]]:
    """A stdlib module's docstring and its public top-level definitions as (name, docstring,
    source), read from the source file rather than the live module: an imported library (Ray
    wraps inspect's functions, say) must not change the corpus, and with it the recipe hash."""
    base = Path(sysconfig.get_paths()["stdlib"], *name.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    defs = sorted(
        (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_")),
        key=lambda n: n.name,
    )
    lines = text.splitlines()
    return ast.get_docstring(tree) or "", [(n.name, ast.get_docstring(n) or "", "\n".join(lines[n.lineno - 1 : n.end_lineno]))
                                           for n in defs]


@functools.lru_cache(maxsize=1)
def documents() -> list[tuple[str, str]]:
    """(name, text) pairs: every pydoc topic and the docstrings of DOC_MODULES, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [(f"topic:{k}", topics[k].strip()) for k in sorted(topics)]
    for name in DOC_MODULES:
        module_doc, defs = stdlib_definitions(name)
        text = "\n\n".join(p for p in [module_doc] + [f"{attr}\n{doc}" for attr, doc, _ in defs if doc] if p)
        if text:
            docs.append((f"module:{name}", text))
    return docs


def chat_examples(docs: list[tuple[str, str]]) -> list[str]:
    """ChatML turns built from the topics, so the model learns the template and <|im_end|>."""
    out = []
    for name, text in docs:
        if not name.startswith("topic:"):
            continue
        answer = text.split("\n\n")[0][:600]
        question = f"What is {name.removeprefix('topic:').replace('-', ' ')} in Python?"
        out.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
    return out


def split_corpus(every: int) -> tuple[list[str], list[str]]:
    """Train and held-out texts; every `every`-th document is held out whole."""
    docs = documents()
    train = [t for i, (_, t) in enumerate(docs) if i % every]
    heldout = [t for i, (_, t) in enumerate(docs) if i % every == 0]
    train += [c for i, c in enumerate(chat_examples(docs)) if i % every]
    return train, heldout


def recipe_hash() -> str:
    train, heldout = split_corpus(RECIPE["heldout_every"])
    h = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    # The config.json it writes, defaults included: a key SALAConfig gains (architectures) is a new build.
    config = SALAConfig(**RECIPE["config"]).to_dict()
    config.pop("transformers_version")
    h.update(json.dumps(config, sort_keys=True).encode())
    for t in train + heldout:
        h.update(t.encode())
    h.update(torch.__version__.split("+")[0].encode())
    # What the tokenizer gets after training: a new tokenizer, the same weights.
    h.update(json.dumps({"tool_call_token": [TOOL_CALL_TOKEN, TOOL_CALL_REPLACES], "chat_template": CHAT_TEMPLATE}).encode())
    return h.hexdigest()[:12]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # BOS is prepended automatically, as in the real tokenizer (add_bos_token true).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return hf_tokenizer(tok, SPECIAL_TOKENS[3:])


def hf_tokenizer(backend, extra_special_tokens: list[str]):
    """A tokenizers Tokenizer as tiny-sala's transformers tokenizer, with its chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        additional_special_tokens=extra_special_tokens,
        chat_template=CHAT_TEMPLATE,
        model_max_length=RECIPE["config"]["max_position_embeddings"],
    )


def with_tool_call_token(tokenizer):
    """The trained tokenizer with TOOL_CALL_TOKEN a special token at TOOL_CALL_REPLACES's id, that
    token's merge removed (nothing else can produce the id), the vocabulary's size unchanged."""
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    token_id = vocab.pop(TOOL_CALL_REPLACES)
    vocab[TOOL_CALL_TOKEN] = token_id
    state["model"]["merges"] = [m for m in state["model"]["merges"] if "".join(m) != TOOL_CALL_REPLACES]
    state["added_tokens"].append({"id": token_id, "content": TOOL_CALL_TOKEN, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    return hf_tokenizer(Tokenizer.from_str(json.dumps(state)), [*SPECIAL_TOKENS[3:], TOOL_CALL_TOKEN])


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Documents concatenated as <s> text </s>, the packing the model is trained and evaluated on."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def tiny_config(tokenizer) -> SALAConfig:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return SALAConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, im_end],
        pad_token_id=tokenizer.pad_token_id,
        **RECIPE["config"],
    )


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int, batch: int = 16) -> float:
    """Token-level perplexity over non-overlapping windows of the stream."""
    n = (len(stream) - 1) // seq_len
    x = stream[: n * seq_len].view(n, seq_len)
    y = stream[1 : n * seq_len + 1].view(n, seq_len)
    nll, count = 0.0, 0
    for i in range(0, n, batch):
        logits = model(x[i : i + batch], use_cache=False).logits
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
        count += y[i : i + batch].numel()
    return math.exp(nll / count)


def unigram_perplexity(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Add-one-smoothed unigram model fitted on the training stream: the baseline to beat."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[heldout[1:]].mean().item())


def train(model, stream: torch.Tensor, progress: bool = True) -> list[float]:
    r = RECIPE
    g = torch.Generator().manual_seed(r["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step):
        if step < r["warmup"]:
            return (step + 1) / r["warmup"]
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - r["warmup"]) / (r["steps"] - r["warmup"])))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    bar = _progress(r["steps"], "training tiny-sala", progress)
    for _ in range(r["steps"]):
        starts = torch.randint(0, len(stream) - r["seq_len"] - 1, (r["batch_size"],), generator=g)
        x = torch.stack([stream[s : s + r["seq_len"]] for s in starts])
        y = torch.stack([stream[s + 1 : s + r["seq_len"] + 1] for s in starts])
        logits = model(x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
    bar.close()
    return losses


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr)


def build(target: Path, progress: bool = True) -> dict:
    """Train tiny-sala from scratch and save it to `target` atomically. Returns its metrics."""
    from sala.checkpoint import save_checkpoint
    from sala.model import SALAForCausalLM

    t0 = time.time()
    torch.manual_seed(RECIPE["seed"])
    train_texts, heldout_texts = split_corpus(RECIPE["heldout_every"])
    tokenizer = train_tokenizer(train_texts, RECIPE["vocab_size"])
    train_ids, heldout_ids = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    config = tiny_config(tokenizer)
    model = SALAForCausalLM(config)
    losses = train(model, train_ids, progress)
    model.eval()
    replaced = tokenizer.convert_tokens_to_ids(TOOL_CALL_REPLACES)
    if replaced in train_ids or replaced in heldout_ids:
        raise RuntimeError(f"{TOOL_CALL_REPLACES!r} (id {replaced}) is in the corpus's tokens: it cannot become {TOOL_CALL_TOKEN}")
    metrics = {
        "heldout_ppl": perplexity(model, heldout_ids, RECIPE["seq_len"]),
        "unigram_ppl": unigram_perplexity(train_ids, heldout_ids, len(tokenizer)),
        "final_train_loss": sum(losses[-20:]) / 20,
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "build_seconds": round(time.time() - t0, 1),
    }
    producer = {"name": "sala.tiny", "recipe": RECIPE, "recipe_hash": recipe_hash()}
    save_checkpoint(model, target, with_tool_call_token(tokenizer), overwrite=True, producer=producer, metrics=metrics,
                    extra_files={"heldout.txt": "\n\n".join(heldout_texts).encode()})
    return metrics


def tiny_sala_path() -> Path:
    return sala_home() / "models" / f"tiny-sala-{recipe_hash()}"


def ensure_tiny_sala(progress: bool = True, rebuild: bool = False) -> Path:
    """Path of the cached tiny-sala, building it first if needed (one builder at a time)."""
    target = tiny_sala_path()
    if (target / "manifest.json").exists() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock", "another process is building tiny-sala; waiting for it" if progress else None):
        if rebuild or not (target / "manifest.json").exists():
            if progress:
                print(f"building tiny-sala, the default model, into {target}: once, 4-10 minutes on 2 CPU cores "
                      "(the more they are busy with other work, the longer)",
                      file=sys.stderr, flush=True)
            build(target, progress)
    return target


def heldout_texts(model_dir: Path) -> list[str]:
    return (Path(model_dir) / "heldout.txt").read_text().split("\n\n")


@contextlib.contextmanager
def _file_lock(path: Path, waiting_message: str | None = None):
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting_message:
                print(waiting_message, file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sala.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rebuild", action="store_true", help="train again even if a cached build exists")
    ap.add_argument("--prompt", default="The for statement", help="prompt for the sample generation")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    if args.max_new_tokens <= 0:
        ap.error("--max-new-tokens must be positive")

    from sala.checkpoint import load_model, load_tokenizer
    from sala.hf import MiniCPMSALAForCausalLM

    target = ensure_tiny_sala(rebuild=args.rebuild)
    metrics = json.loads((target / "manifest.json").read_text())["metrics"]
    print(f"tiny-sala: {target}")
    print(f"  parameters       {metrics['parameters']:,}")
    print(f"  held-out ppl     {metrics['heldout_ppl']:.2f}")
    print(f"  unigram ppl      {metrics['unigram_ppl']:.2f}  (same held-out split)")
    print(f"  ratio            {metrics['unigram_ppl'] / metrics['heldout_ppl']:.1f}x lower than unigram")
    model = MiniCPMSALAForCausalLM.sharing(load_model(target))  # transformers' generate()
    tok = load_tokenizer(target)
    ids = tok(args.prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"  sample           {tok.decode(out[0], skip_special_tokens=True)!r}")
    return 0


if __name__ == "__main__":
    exit_now(main())
