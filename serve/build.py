"""The Serve application: SalaServer (serve/server.py) alone, or with several replicas behind the
prefix-routing ingress (serve/router.py). What `serve run serve/config.yaml` and `python -m
serve.app` deploy; a bad setting fails here, before any replica starts.
"""
import os

from ray.serve.config import RequestRouterConfig

from registry.models import resolve_model_path
from sala.checkpoint import read_config
from sala.engine import parse_max_batch, parse_nodes
from sala.kv import load_plan
from sala.medusa.heads import has_medusa
from sala.reasoning import REASONING_FORMATS
from sala.text_markers import named
from sala.tools import FORMATS
from serve.router import PrefixAffinityRouter, PrefixRoutingIngress, RoutingOptions
from serve.server import SalaServer, served_names


class MedusaOff(ValueError):
    """A Medusa setting for a model served without Medusa."""


def build_app(model: str | None = None, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              num_cpus: float = 1.0, num_gpus: float = 0, batch_invariant: bool = False, num_threads: int | None = None,
              max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, kv_plan=None, num_replicas: int = 1,
              autoscaling_config: dict | None = None, prefix_routing: bool = True, prefix_routing_options: dict | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None, **engine_kwargs):
    """The Serve application for `serve.run`; api_key defaults to $SALA_API_KEY (unset: no auth).
    kv_plan (a kv_plan.json path or its dict; default: the checkpoint's own) is checked against the
    model here, so a bad plan fails before any replica starts (KVPlanError naming the problem).
    num_gpus > 0 reserves that many GPUs for the replica and runs the engine on CUDA; batch_invariant
    makes a request's logprobs bitwise independent of the rest of the batch (evaluation mode, slower).
    With several replicas (num_replicas > 1, or an autoscaling_config) and prefix_routing, requests
    sharing a prompt prefix go to the replica caching it (serve/router.py; prefix_routing_options are
    PrefixAffinityRouter's: block_chars, max_blocks, imbalanced_threshold, min_match_rate,
    refresh_interval_s); without
    prefix_routing Serve's power of two choices spreads them. medusa_nodes and medusa_max_batch
    (engine settings) are checked here too: MedusaOff when the model is served without Medusa.
    tool_call_parser and reasoning_parser name the model's tool-call and reasoning formats (None:
    the ones its chat template writes; "none": none), ValueError here for an unknown name."""
    served_names(served_model_name)  # a bad value fails here, not in the replica
    for name, known, what in ((tool_call_parser, FORMATS, "tool-call parser"), (reasoning_parser, REASONING_FORMATS,
                                                                                 "reasoning parser")):
        if name not in (None, "none"):
            named(known, name, what)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if prefix_routing_options and not prefix_routing:
        raise ValueError("prefix_routing_options given with prefix_routing off: drop them or turn prefix_routing on")
    routing = RoutingOptions(**(prefix_routing_options or {}))  # a bad option fails here, not in the router
    if model is None:  # tiny-sala, built here if need be: a replica only ever resolves, never trains
        from sala.tiny import ensure_tiny_sala

        model = str(ensure_tiny_sala())
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    for name, parse in (("medusa_nodes", parse_nodes), ("medusa_max_batch", parse_max_batch)):
        if engine_kwargs.get(name) is None:  # checked here: a replica failing to start says it less plainly
            engine_kwargs.pop(name, None)
            continue
        engine_kwargs[name] = parse(engine_kwargs[name])
        if batch_invariant or engine_kwargs.get("medusa") is False or not has_medusa(resolve_model_path(model)):
            raise MedusaOff(f"{name}={engine_kwargs[name]!r} but {model} is served without Medusa (medusa: false, "
                            "batch_invariant, or no medusa/ heads)")
    if kv_plan is not None:  # the replica gets the checked plan itself: a path may not exist on its node
        engine_kwargs["kv_plan"] = load_plan(kv_plan, read_config(resolve_model_path(model))).to_json()
    api_key = os.environ.get("SALA_API_KEY") if api_key is None else api_key
    routed = prefix_routing and (num_replicas > 1 or autoscaling_config is not None)
    options = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus}}
    options |= {"autoscaling_config": autoscaling_config} if autoscaling_config is not None else {"num_replicas": num_replicas}
    if routed:
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                                request_router_kwargs=prefix_routing_options or {})
    server = SalaServer.options(**options).bind(
        model, served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes,
        max_tokens_limit=max_tokens_limit, num_threads=num_threads, num_gpus=num_gpus, batch_invariant=batch_invariant,
        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, engine_kwargs=engine_kwargs)
    return (PrefixRoutingIngress.bind(server, max_body_bytes=max_body_bytes, refresh_interval_s=routing.refresh_interval_s)
            if routed else server)


def app_builder(args: dict):
    """`serve run serve/config.yaml` entry point: the YAML's `args` are build_app's keyword arguments."""
    return build_app(**args)
