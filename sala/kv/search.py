"""The greedy plan search: downgrade units from least to most sensitive under a budget.

A unit is one sparse layer's K/V (downgraded to an NVFP4 format) or one lightning layer's state
(downgraded to bf16). Single-unit sensitivities only roughly add, so each candidate is the
plan so far plus one more unit, re-measured as a whole, and kept only if it meets the budget:
`max_kl` (mean KL of the combined plan) and / or `fp8_layers` (at least that many sparse layers
stay FP8: the most sensitive ones; alone, it leaves every state fp32).
"""
from __future__ import annotations

from typing import Callable

from sala.kv.plan import KVPlan

Unit = tuple[str, int]  # ("kv", sparse layer) or ("state", lightning layer)


def units(config) -> list[Unit]:
    return [("kv", i) for i in config.sparse_layers] + [("state", i) for i in config.lightning_layers]


def downgraded(plan: KVPlan, unit: Unit, kv_format: str = "nvfp4") -> KVPlan:
    kind, i = unit
    return plan.with_units(kv={i: kv_format}) if kind == "kv" else plan.with_units(state={i: "bf16"})


def greedy_plan(baseline: KVPlan, baseline_metrics: dict, sensitivity: dict[Unit, float],
                measure: Callable[[KVPlan], dict], max_kl: float | None = None, fp8_layers: int | None = None,
                kv_format: str = "nvfp4") -> tuple[KVPlan, dict]:
    """The plan and its metrics. `sensitivity`: each unit's mean KL when downgraded alone from
    `baseline`; `measure(plan)` -> sala.kv.measure.measure_plan's metrics ("kl_mean", ...)."""
    if max_kl is None and fp8_layers is None:
        raise ValueError("greedy_plan needs a budget: max_kl and / or fp8_layers")
    if fp8_layers is not None and not 0 <= fp8_layers <= len(baseline.kv):
        raise ValueError(f"fp8_layers must lie in 0..{len(baseline.kv)}, got {fp8_layers}")
    order = sorted(sensitivity, key=lambda u: (sensitivity[u], u))
    # fp8_layers alone budgets K/V only: states are downgraded only under a KL budget.
    candidates = [u for u in order if max_kl is not None or u[0] == "kv"]
    kv_room = len(baseline.kv) if fp8_layers is None else len(baseline.kv) - fp8_layers  # may still go NVFP4
    plan, metrics = baseline, baseline_metrics
    for u in candidates:
        if u[0] == "kv" and kv_room == 0:
            continue
        cand = downgraded(plan, u, kv_format)
        q = measure(cand)
        if max_kl is not None and q["kl_mean"] > max_kl:
            continue
        plan, metrics = cand, q
        kv_room -= u[0] == "kv"
    plan.table = [{"unit": f"{k}{i}", "kind": k, "layer": i, "kl_mean": sensitivity[(k, i)]} for k, i in order]
    plan.budget = {"max_kl": max_kl, "fp8_layers": fp8_layers}
    plan.metrics = dict(metrics)
    return plan, metrics
