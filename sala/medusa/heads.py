"""Medusa heads: K extra next-next-... token predictors on the base model's last hidden state.

Head k (0-based) reads the tensor that feeds lm_head (after the final norm and the muP
division by hidden_size / dim_model_base) at position t and predicts token t + k + 2 (lm_head
itself predicts t + 1). Each head is `num_layers` residual blocks x + SiLU(W1 x + b), W1
zero-initialised so an untrained head starts as "lm_head on h_t", then a vocabulary
projection: its own (initialised from lm_head) or lm_head itself (`shared_lm_head`, Medusa-2's
choice: it saves (K - 1) V d parameters and speculates as well).

On disk, in a checkpoint's `medusa/`: config.json (this config with the tree), heads.safetensors
and a manifest, written atomically. Loading checks the heads against the model they will run
on (hidden size, vocabulary) and the tree against the heads (depth, top-k).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from sala.checkpoint import CheckpointError, atomic_directory, verify_manifest, write_manifest
from sala.medusa.tree import MC_SIM_7B_63, MedusaTree, build_tree, independent_acceptance

MEDUSA_DIR = "medusa"
WEIGHTS = "heads.safetensors"


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    topk: int = 10
    # None: the paths of MC_SIM_7B_63 these heads can draft (at most num_heads deep, every rank
    # below topk); the whole tree at the defaults.
    tree: list[list[int]] | None = None
    max_tree_nodes: int = 256
    # [[path, share], ...]: how often each path is right (a greedy verify would keep it), measured
    # on the validation windows when the heads were trained (train.evaluate), likeliest first;
    # what trees of every size are chosen by (tree.top_paths, tree.expected_accept_length). Empty
    # when not measured.
    path_acceptance: list[list] = field(default_factory=list)

    def __post_init__(self):
        if self.tree is None:
            self.tree = [list(p) for p in MC_SIM_7B_63 if len(p) <= self.num_heads and max(p) < self.topk]

    def build_tree(self) -> MedusaTree:
        return build_tree(self.tree, self.topk, self.num_heads, self.max_tree_nodes)

    @property
    def acceptance(self) -> dict[tuple[int, ...], float]:
        return {tuple(p): float(share) for p, share in self.path_acceptance}


class MedusaHeads(nn.Module):
    """The K heads as stacked parameters, so that drafting is one batched GEMM per block and one
    for the projections whatever K is, not K small GEMMs each. Projections of their own are K
    vocabulary matrices read every verify step (on tiny-sala 0.56 ms of a 4-node verify's 3.8,
    where a plain step took 2.0); shared, drafting reads lm_head once. On disk each head's
    tensors keep their own names (`disk_state` / `from_disk`)."""

    def __init__(self, config: MedusaConfig, lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        self.tree = config.build_tree()  # validated here, so a bad tree fails at load, not mid-decode
        k, d, v = config.num_heads, config.hidden_size, config.vocab_size
        # Block l of head k: x + SiLU(x W1[k, l]^T + b1[k, l]). W1 is zero at init (identity);
        # b1 takes nn.Linear's default init, U(-1/sqrt(d), 1/sqrt(d)).
        self.w1 = nn.Parameter(torch.zeros(k, config.num_layers, d, d))
        self.b1 = nn.Parameter(torch.empty(k, config.num_layers, d).uniform_(-d**-0.5, d**-0.5))
        self.proj = None
        if not config.shared_lm_head:
            self.proj = nn.Parameter(torch.zeros(k, v, d))
            if lm_head is not None:
                with torch.no_grad():
                    self.proj.copy_(lm_head.weight.float().expand(k, v, d))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> each head's input to its projection [K, ..., hidden]."""
        shape = x.shape
        h = x.reshape(1, -1, shape[-1]).to(self.w1.dtype).expand(self.config.num_heads, -1, -1)
        for layer in range(self.config.num_layers):
            h = h + F.silu(torch.baddbmm(self.b1[:, layer, None], h, self.w1[:, layer].transpose(1, 2)))
        return h.reshape(self.config.num_heads, *shape)

    def forward(self, x: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """x: [..., hidden] (already divided by the muP logit divisor) -> fp32 logits [K, ..., V]."""
        h = self.hidden(x)
        if self.proj is None:
            h = h.to(_weight_dtype(lm_head))
            if h.requires_grad and h.device.type == "cpu" and h.dtype in (torch.bfloat16, torch.float16):
                return _CpuLowPrecisionProjection.apply(h, lm_head.weight, lm_head.bias).float()
            return lm_head(h).float()
        k, shape = self.config.num_heads, h.shape
        logits = torch.bmm(h.reshape(k, -1, shape[-1]).to(self.proj.dtype), self.proj.transpose(1, 2))
        return logits.reshape(*shape[:-1], -1).float()

    def draft_tokens(self, x: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """x [N, hidden] -> each head's top-k tokens [N, K, topk], most likely first."""
        return self(x, lm_head).topk(self.config.topk, dim=-1).indices.transpose(0, 1)

    def disk_state(self) -> dict[str, torch.Tensor]:
        """The weights by head, as heads.safetensors names them: blocks.{k}.{l}.linear.weight /
        .bias and proj.{k}.weight (Medusa's module layout)."""
        out = {}
        for k in range(self.config.num_heads):
            for layer in range(self.config.num_layers):
                out[f"blocks.{k}.{layer}.linear.weight"] = self.w1[k, layer]
                out[f"blocks.{k}.{layer}.linear.bias"] = self.b1[k, layer]
            if self.proj is not None:
                out[f"proj.{k}.weight"] = self.proj[k]
        return out

    def from_disk(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Load weights named as `disk_state` names them; CheckpointError naming `source` when
        the names or shapes do not match this config (copy_ would broadcast a wrong shape)."""
        expected = self.disk_state()
        missing, extra = set(expected) - set(state), set(state) - set(expected)
        if missing or extra:
            raise CheckpointError(f"{source}: tensors do not match the config "
                                  f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
        if wrong := [n for n, param in expected.items() if state[n].shape != param.shape]:
            raise CheckpointError(f"{source}: {wrong[0]} has shape {list(state[wrong[0]].shape)} but the config "
                                  f"makes it {list(expected[wrong[0]].shape)}")
        with torch.no_grad():
            for name, param in expected.items():  # views of the stacked parameters
                param.copy_(state[name])

    # ------------------------------------------------------------------ disk
    def save(self, checkpoint_dir: str | Path, overwrite: bool = True) -> Path:
        """Write `checkpoint_dir/medusa/` atomically; returns that directory."""
        target = Path(checkpoint_dir) / MEDUSA_DIR
        with atomic_directory(target, overwrite=overwrite) as tmp:
            (tmp / "config.json").write_text(json.dumps(asdict(self.config), indent=2))
            save_file({k: v.detach().float().contiguous().cpu() for k, v in self.disk_state().items()},
                      str(tmp / WEIGHTS), metadata={"format": "pt"})
            write_manifest(tmp, producer={"name": "sala.medusa"})
        return target.absolute()


class _CpuLowPrecisionProjection(torch.autograd.Function):
    """h @ W^T + b through a frozen bf16 / fp16 lm_head on CPU, for heads being trained. Its backward
    takes the input gradient grad @ W a block of W's columns at a time, each block copied
    transposed: oneDNN on CPUs without native bf16 runs grad @ W with W row-major (what linear's
    own backward asks for) about 100x slower than with W's rows as the contraction's columns
    (measured on AVX2, [128, 73448] @ [73448, 4096]: 250 s against 1.8 s). A block copy is
    V x COLUMNS values."""

    COLUMNS = 256

    @staticmethod
    def forward(ctx, h, weight, bias):
        ctx.save_for_backward(weight)
        return F.linear(h, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        out = rows.new_empty(rows.shape[0], weight.shape[1])
        for c in range(0, weight.shape[1], _CpuLowPrecisionProjection.COLUMNS):
            block = weight[:, c : c + _CpuLowPrecisionProjection.COLUMNS].t().contiguous()
            torch.mm(rows, block.t(), out=out[:, c : c + block.shape[0]])
        return out.reshape(*grad.shape[:-1], weight.shape[1]), None, None


def _weight_dtype(module: nn.Module) -> torch.dtype:
    w = getattr(module, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.float32


def has_medusa(checkpoint_dir: str | Path) -> bool:
    return (Path(checkpoint_dir) / MEDUSA_DIR / "config.json").exists()


def load_heads(path: str | Path, model_config, device="cpu", dtype: torch.dtype = torch.float32,
               tree: list[list[int]] | None = None) -> MedusaHeads:
    """Heads from a checkpoint directory (or its `medusa/` itself) for a model with `model_config`;
    `tree` replaces the saved tree. Raises CheckpointError naming a mismatch."""
    path = Path(path)
    directory = path if (path / WEIGHTS).exists() else path / MEDUSA_DIR
    if not (directory / "config.json").exists():
        raise CheckpointError(f"{directory}: no Medusa heads here (expected config.json and {WEIGHTS})")
    verify_manifest(directory)
    try:
        raw = json.loads((directory / "config.json").read_text())
        if "rank_accuracy" in raw:  # heads trained before path acceptance was measured: estimate it
            rank_accuracy = raw.pop("rank_accuracy")
            if rank_accuracy and not raw.get("path_acceptance"):
                estimate = independent_acceptance(rank_accuracy, raw.get("tree", MC_SIM_7B_63))
                raw["path_acceptance"] = [[list(p), a] for p, a in estimate.items()]
        config = MedusaConfig(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{directory / 'config.json'}: not a Medusa config ({e})") from e
    if tree is not None:
        config.tree = [list(p) for p in tree]
    for name in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(config, name), getattr(model_config, name)
        if ours != theirs:
            raise CheckpointError(f"{directory}: Medusa heads were trained for {name}={ours}, but the model has "
                                  f"{name}={theirs} (heads from another model?)")
    heads = MedusaHeads(config)  # validates the tree against the heads' depth and top-k
    heads.from_disk(load_file(str(directory / WEIGHTS)), str(directory / WEIGHTS))
    return heads.to(device=device, dtype=dtype).eval()
