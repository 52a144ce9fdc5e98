"""The cache plan: each sparse layer's K/V format and each lightning layer's state dtype.

`kv_plan.json` (the contract other tools write and read):

    {"layers": [{"layer": 0, "kind": "sparse", "kv": "fp8", "k_amax": [...], "v_amax": [...]},
                {"layer": 1, "kind": "lightning", "state": "bf16"}, ...],
     "model": {...identity...}, "table": [...ablation rows...], "budget": {...}, "metrics": {...}}

One entry per model layer; "kv" in bf16 | fp8 | nvfp4 | nvfp4_4over6, "state" in fp32 | bf16.
The optional per-head "k_amax" / "v_amax" (max |K|, |V| over calibration data) fix FP8 scales
(amax / 448) and the NVFP4 global scale; without them FP8 scales are computed on write and the
NVFP4 global scale is 1. `load_plan` checks a plan against the model before anything is
allocated: a layer of the wrong kind or out of range, an unknown format, or a plan made for
another model (layer count, head sizes) is a `KVPlanError` naming the problem.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sala.atomic import write_atomically
from sala.config import LIGHTNING
from sala.kv.formats import DENSE_DTYPES, KVCodec, make_codec

PLAN_FILE = "kv_plan.json"
KV_FORMATS = ("bf16", "fp8", "nvfp4", "nvfp4_4over6")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DENSE_DTYPES.items()}
# What a plan records about its model and checks on load.
IDENTITY_KEYS = ("model_type", "num_hidden_layers", "num_key_value_heads", "head_dim", "lightning_nh",
                 "lightning_head_dim")


class KVPlanError(ValueError):
    """A kv_plan.json that does not fit the model, or is malformed."""


def model_identity(config) -> dict:
    return {k: getattr(config, k) for k in IDENTITY_KEYS} | {"layer_kinds": list(config.layer_kinds)}


@dataclass
class KVPlan:
    kv: dict[int, str]  # sparse layer -> format
    state: dict[int, str]  # lightning layer -> "fp32" | "bf16"
    amax: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # layer -> {"k": [H], "v": [H]}
    model: dict = field(default_factory=dict)
    table: list = field(default_factory=list)
    budget: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    @classmethod
    def uniform(cls, config, kv: str = "bf16", state: str = "fp32", amax: dict | None = None) -> KVPlan:
        return cls({i: kv for i in config.sparse_layers}, {i: state for i in config.lightning_layers},
                   dict(amax or {}), model_identity(config))

    def with_units(self, kv: dict[int, str] | None = None, state: dict[int, str] | None = None) -> KVPlan:
        """A copy with some layers changed (the ablation's candidates)."""
        return KVPlan({**self.kv, **(kv or {})}, {**self.state, **(state or {})}, self.amax, self.model)

    def codec(self, layer: int, side: str) -> KVCodec:
        return make_codec(self.kv[layer], self.amax.get(layer, {}).get(side))

    def state_dtype(self, layer: int) -> torch.dtype:
        return STATE_DTYPES[self.state[layer]]

    def kv_bytes_per_token(self, config) -> dict[int, int]:
        """Per sparse layer: K and V of one token."""
        n, d = config.num_key_value_heads, config.head_dim
        return {i: self.codec(i, "k").bytes_per_token(n, d) + self.codec(i, "v").bytes_per_token(n, d) for i in self.kv}

    def state_bytes_per_seq(self, config) -> dict[int, int]:
        """Per lightning layer: one sequence's recurrent state."""
        per = config.lightning_nh * config.lightning_head_dim**2
        return {i: per * STATE_DTYPES[s].itemsize for i, s in self.state.items()}

    def to_json(self) -> dict:
        layers = []
        for i in sorted([*self.kv, *self.state]):
            if i in self.kv:
                entry = {"layer": i, "kind": "sparse", "kv": self.kv[i]}
                if i in self.amax:
                    entry |= {"k_amax": list(self.amax[i]["k"]), "v_amax": list(self.amax[i]["v"])}
            else:
                entry = {"layer": i, "kind": "lightning", "state": self.state[i]}
            layers.append(entry)
        return {"layers": layers, "model": self.model, "table": self.table, "budget": self.budget, "metrics": self.metrics}

    def save(self, path: str | os.PathLike) -> Path:
        """Atomically (temp file, fsync, rename); a directory gets kv_plan.json inside."""
        path = Path(path)
        if path.is_dir():
            path = path / PLAN_FILE
        return write_atomically(path, lambda f: json.dump(self.to_json(), f, indent=1), "w")

    def describe(self) -> str:
        kv = ",".join(f"{i}:{f}" for i, f in sorted(self.kv.items()))
        st = ",".join(f"{i}:{s}" for i, s in sorted(self.state.items()) if s != "fp32") or "all fp32"
        return f"K/V {kv}; states {st}"


def default_plan(config, dtype: torch.dtype) -> KVPlan:
    """No plan: K/V in the model's dtype, fp32 states (what the engine always did)."""
    return KVPlan.uniform(config, DTYPE_NAMES[dtype])


def load_plan(source, config) -> KVPlan:
    """A KVPlan from a KVPlan, a dict, a kv_plan.json path or a directory holding one, checked
    against `config`."""
    where, formats = "kv plan", KV_FORMATS
    if isinstance(source, KVPlan):  # built in code: may also keep K/V dense in fp32 / fp16
        obj, formats = source.to_json(), (*KV_FORMATS, *DENSE_DTYPES)
    elif isinstance(source, dict):
        obj = source
    else:
        path = Path(source)
        if path.is_dir():
            path = path / PLAN_FILE
        where = str(path)
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            raise KVPlanError(f"{where}: no such file") from None
        except json.JSONDecodeError as e:
            raise KVPlanError(f"{where}: not valid JSON ({e})") from None
    return parse_plan(obj, config, where, formats)


def parse_plan(obj, config, where: str = "kv plan", formats: tuple[str, ...] = KV_FORMATS) -> KVPlan:
    def fail(msg: str):
        raise KVPlanError(f"{where}: {msg}")

    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), list):
        fail('expected a JSON object with a "layers" list')
    model = obj.get("model") or {}
    if not isinstance(model, dict):
        fail('"model" must be an object')
    mine = model_identity(config)
    for key in (*IDENTITY_KEYS, "layer_kinds"):
        if key in model and model[key] != mine[key]:
            fail(f"made for another model: {key} is {model[key]} in the plan but {mine[key]} in this model")
    n = config.num_hidden_layers
    kinds = config.layer_kinds
    kv, state, amax = {}, {}, {}
    for entry in obj["layers"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("layer"), int) or isinstance(entry.get("layer"), bool):
            fail(f"every entry needs an integer \"layer\", got {entry!r}")
        i, kind = entry["layer"], entry.get("kind")
        if not 0 <= i < n:
            fail(f"layer {i} is out of range: the model has {n} layers (0..{n - 1})")
        if i in kv or i in state:
            fail(f"layer {i} appears twice")
        actual = "lightning" if kinds[i] == LIGHTNING else "sparse"
        if kind not in ("sparse", "lightning"):
            fail(f"layer {i}: kind must be \"sparse\" or \"lightning\", got {kind!r}")
        if kind != actual:
            fail(f"layer {i} is a {actual} layer in this model, but the plan says {kind}")
        if kind == "sparse":
            fmt = entry.get("kv")
            if fmt not in formats:
                fail(f"layer {i}: unknown kv format {fmt!r}; expected one of {', '.join(formats)}")
            kv[i] = fmt
            if "k_amax" in entry or "v_amax" in entry:
                amax[i] = {s: _amax(entry.get(f"{s}_amax"), config.num_key_value_heads, f"layer {i} {s}_amax", fail)
                           for s in ("k", "v")}
        else:
            dt = entry.get("state")
            if dt not in STATE_DTYPES:
                fail(f"layer {i}: unknown state dtype {dt!r}; expected one of {', '.join(STATE_DTYPES)}")
            state[i] = dt
    missing = sorted(set(range(n)) - set(kv) - set(state))
    if missing:
        fail(f"no entry for layer(s) {missing}: a plan lists every one of the model's {n} layers")
    if any(config.head_dim % 16 for f in kv.values() if f.startswith("nvfp4")):
        fail(f"nvfp4 K/V needs head_dim divisible by 16; the model's is {config.head_dim}")
    return KVPlan(kv, state, amax, model or mine, list(obj.get("table") or []), dict(obj.get("budget") or {}),
                  dict(obj.get("metrics") or {}))


def _amax(values, heads: int, what: str, fail) -> list[float]:
    if not isinstance(values, list) or len(values) != heads or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 and x == x and x != float("inf")
            for x in values):
        fail(f"{what} must list {heads} finite non-negative numbers (one per kv head), got {values!r}")
    return [float(x) for x in values]


def apply_to_model(model, plan: KVPlan | None) -> None:
    """Make the model's own forward (transformers' path, SALACache) see the cache as the plan
    stores it: sparse layers fake-quantize K/V, lightning layers round their state. The
    reference the engine is tested against, and what the sensitivity ablation measures. None
    undoes it."""
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if layer.is_lightning:
            attn.state_dtype = torch.float32 if plan is None else plan.state_dtype(i)
        else:
            attn.kv_quant = None if plan is None else _FakeQuant(plan.codec(i, "k"), plan.codec(i, "v"))


class _FakeQuant:
    """k, v [B, H, T, D] -> the values the cache would return (rows quantized per token and head)."""

    def __init__(self, k: KVCodec, v: KVCodec):
        self.k, self.v = k, v

    def __call__(self, k: torch.Tensor, v: torch.Tensor):
        return (self.k.fake(k.transpose(1, 2)).transpose(1, 2), self.v.fake(v.transpose(1, 2)).transpose(1, 2))
