"""The command line: serve a SALA checkpoint on this machine's Ray (or $RAY_ADDRESS's).

    python -m serve.app --model models:/sala@champion --port 8000  # served as `sala`
    serve run serve/config.yaml                                   # the same app from its config: tiny-sala on 127.0.0.1:8000

The application itself is build_app's (serve/build.py): SalaServer (serve/server.py), behind the
prefix-routing ingress with several replicas. Endpoints: /v1/models, /v1/completions,
/v1/chat/completions, /generate, /tokenize, /detokenize, /abort_request, /flush_cache,
/get_model_info, /get_server_info (SGLang's), /health and /metrics (Prometheus). With
SALA_API_KEY set (or `api_key=`), every endpoint but /health and /metrics needs
`Authorization: Bearer KEY`. The served model is named after the checkpoint (the registered
model, or the directory) unless `served_model_name` gives one or more names; a request may
name any of them, or none.
"""
import argparse
import os
import shlex
import signal
import sys
import sysconfig
import threading

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RayServeException

from sala.checkpoint import DeviceUnavailable, gpu_device
from sala.engine import SpeculationSettingError, parse_max_batch, parse_nodes
from sala.engine.config import add_medusa_arguments
from sala.kv import KVPlanError
from sala.process_exit import exit_now
from sala.reasoning import REASONING_FORMATS
from sala.tools import FORMATS
from serve.build import MedusaOff, build_app

# Serve kills a proxy that misses 3 readiness checks of RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s)
# from its start, and starts another; on a loaded 2-core node a proxy process takes longer than
# that to import Serve and its HTTP stack, and serve.start can meet the proxy it waits on killed.
PROXY_READY_CHECK_S = 30


def local_ray_env() -> None:
    """Before starting a local Ray that will run Serve: its controller gives a starting proxy
    PROXY_READY_CHECK_S a readiness check, unless the environment says otherwise. (A cluster's
    controller reads its own environment: set the variable where the cluster starts.)"""
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_CHECK_S))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m serve.app", description="Serve a SALA checkpoint over HTTP")
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="name(s) requests may use; responses carry the one asked for, or the first "
                         "(default: the registered model's name, or the directory's)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the replica reserves in Ray (default: %(default)s)")
    ap.add_argument("--num-gpus", type=float, default=0.0,
                    help="GPUs the replica reserves in Ray; > 0 runs the engine on CUDA (default: %(default)s)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="evaluation mode: a request's logprobs are bitwise identical whatever else is in the batch; "
                         "costs throughput")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="decode eagerly: no compiled (CPU) or CUDA-graph (GPU) decode step, so a replica starts "
                         "seconds sooner and decodes slower")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="compute every prompt in full instead of reusing cached prefixes (K/V pages, lightning-state snapshots)")
    ap.add_argument("--num-threads", type=int, help="torch threads in the replica (default: torch's choice)")
    ap.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default: %(default)s)")
    ap.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"], default="EveryNode",
                    help="Serve's HTTP proxies: one on every node that runs a replica, or one on the head node only "
                         "(several nodes on one machine share one port: only one proxy can hold it)")
    ap.add_argument("--no-prefix-routing", dest="prefix_routing", action="store_false",
                    help="with several replicas, leave requests to Serve's power of two choices instead of sending "
                         "those that share a prompt prefix to the replica caching it")
    ap.add_argument("--max-tokens-limit", type=int, default=1024,
                    help="largest max_tokens a request may ask for (default: %(default)s)")
    ap.add_argument("--tool-call-parser", choices=[*sorted(FORMATS), "none"],
                    help="the model's tool-call format, which tool_choice \"auto\" needs (default: the one its chat "
                         "template writes, if any)")
    ap.add_argument("--reasoning-parser", choices=[*sorted(REASONING_FORMATS), "none"],
                    help="the model's reasoning format, split out as reasoning_content (default: the one its chat "
                         "template writes, if any)")
    add_medusa_arguments(ap)
    ap.add_argument("--kv-plan", help="kv_plan.json for the cache: each layer's K/V format or state dtype "
                                      "(default: the checkpoint's own, if it has one)")
    args = ap.parse_args(argv)
    if args.num_gpus < 0:
        ap.error("--num-gpus must be >= 0")
    if args.num_replicas < 1:
        ap.error("--num-replicas must be >= 1")
    try:
        args.medusa_max_batch = parse_max_batch(args.medusa_max_batch)
        if args.medusa_nodes is not None:
            args.medusa_nodes = parse_nodes(args.medusa_nodes)
    except SpeculationSettingError as e:
        ap.error(str(e))
    return args


def _app_running(name: str) -> bool:
    try:
        return name in serve.status().applications
    except (RayActorError, RayServeException):  # the controller is gone: `serve shutdown` stopped Serve
        return False


def main(argv: list[str] | None = None) -> int:
    import ray

    args = parse_args(argv)
    if not os.environ.get("RAY_ADDRESS"):
        # A local Ray has this machine's GPUs or none; a cluster may add GPU nodes on demand.
        try:
            gpu_device(args.num_gpus)
        except DeviceUnavailable as e:
            print(f"error: --num-gpus: {e}", file=sys.stderr)
            return 2
    try:  # before Ray starts: a bad plan is one line and exit 2
        app = build_app(args.model, served_model_name=args.served_model_name, num_cpus=args.num_cpus,
                        num_gpus=args.num_gpus, batch_invariant=args.batch_invariant, num_threads=args.num_threads,
                        max_tokens_limit=args.max_tokens_limit, kv_plan=args.kv_plan, prefix_cache=args.prefix_cache,
                        compile=args.compile, num_replicas=args.num_replicas, prefix_routing=args.prefix_routing,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        **({} if args.medusa is None else {"medusa": args.medusa}),
                        **{k: v for k in ("medusa_nodes", "medusa_max_batch") if (v := getattr(args, k)) is not None})
    except KVPlanError as e:
        print(f"error: --kv-plan: {e}", file=sys.stderr)
        return 2
    except MedusaOff as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # What serve.start would do, keeping the dashboard's address; without RAY_ADDRESS a Ray of its
    # own, never one that another program started on this machine (ray.init's own default).
    if not os.environ.get("RAY_ADDRESS"):
        local_ray_env()
    ctx = ray.init(address=os.environ.get("RAY_ADDRESS") or "local", namespace="serve")
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location=args.proxy_location)
    serve.run(app, name="sala", route_prefix="/")
    # The serve CLI beside this interpreter, by its full path: the printed command runs from any
    # shell, whether or not this environment's bin directory is on its PATH.
    stop_cmd = f"{shlex.quote(os.path.join(sysconfig.get_path('scripts'), 'serve'))} shutdown -y"
    if ctx.dashboard_url and ctx.dashboard_url.rsplit(":", 1)[-1] != "8265":
        stop_cmd += f" --address http://{ctx.dashboard_url}"
    if os.environ.get("RAY_AUTH_MODE") == "token":  # set by ray.init when it enabled token auth
        stop_cmd = f"RAY_AUTH_MODE=token {stop_cmd}"
    print(f"serving on http://{args.host}:{args.port}; stop with Ctrl-C, or from another shell: {stop_cmd}", flush=True)
    # Ray's own SIGTERM handler dumps a stack trace and kills the process: stop cleanly instead.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(2):
        if not _app_running("sala"):
            print("Serve was shut down; exiting", flush=True)
            return 0
    # Only this app: on a shared cluster Serve and its other apps stay (and serve.shutdown's
    # killed controller would add a raylet line about a failed, retried task).
    serve.delete("sala")
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    exit_now(main())
