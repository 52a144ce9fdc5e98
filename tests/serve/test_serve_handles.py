"""SalaServer called through DeploymentHandles, as Ray Serve LLM's server is: Ray Data's
ServeDeploymentProcessorConfig sending a dataset's rows to the running app, and a second
deployment composing ours. The references are the same app's answers over HTTP (the evaluation
mode, so a greedy answer does not depend on what shares its batch).
"""
import json

import httpx
import jsonschema
import pytest
from ray import serve

from serve.errors import APIError
from serve.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import serve_tiny_sala

APP = "sala-handles"
PROMPTS = ["The json module", "def fib(n):", "A list is", "Q: what is a dict?"]


@pytest.fixture(scope="module")
def server(tiny_sala_dir):
    yield from serve_tiny_sala(tiny_sala_dir, APP, batch_invariant=True, compile=False, max_tokens_limit=64)


def over_http(server: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{server}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_ray_data_rows_through_the_deployment(server):
    """build_processor(ServeDeploymentProcessorConfig(...)) over a dataset: each row's completion
    equals /v1/completions' for its prompt, and a refused row comes back with its error in
    __inference_error__ while the job completes."""
    import ray
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

    rows = [{"prompt": p, "max_tokens": 8} for p in PROMPTS] + [{"prompt": "refused", "max_tokens": 0}]
    config = ServeDeploymentProcessorConfig(deployment_name="SalaServer", app_name=APP, batch_size=len(rows), concurrency=1,
                                            should_continue_on_error=True)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(row, method="completions",
                                    request_kwargs={"prompt": row["prompt"], "max_tokens": row["max_tokens"], "temperature": 0}),
        postprocess=lambda row: {"prompt": row["prompt"], "text": row["choices"][0]["text"],
                                 "completion_tokens": row["usage"]["completion_tokens"]},
        # The replica holds half of the test's two CPUs and the stage's actor one: the row maps take what is left.
        preprocess_map_kwargs={"num_cpus": 0.1}, postprocess_map_kwargs={"num_cpus": 0.1})
    out = {row["prompt"]: row for row in processor(ray.data.from_items(rows)).take_all()}
    assert sorted(out) == sorted(r["prompt"] for r in rows)
    for prompt in PROMPTS:
        want = over_http(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        got = out[prompt]
        assert (got["text"], got["completion_tokens"]) == (want["choices"][0]["text"], want["usage"]["completion_tokens"])
        assert got["__inference_error__"] == ""
    refused = out["refused"]["__inference_error__"]
    print("refused row:", refused)
    assert refused.startswith("RayTaskError(APIError)") and "max_tokens must be a positive integer, got 0" in refused


# Bounded fields: greedy tiny-sala ends the object well within max_tokens_limit.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def chat_request(prompt: str, schema: dict) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}}


def test_ray_data_rows_with_response_format_through_the_deployment_and_http(server):
    """Ray Data LLM rows carrying response_format, through ServeDeploymentProcessorConfig (the
    handle) and HttpRequestProcessorConfig (the HTTP API): each answer validates against the
    schema and equals the HTTP API's. Rows whose schema the server refuses (a keyword no grammar
    enforces, one over the size limit) get the error, naming the field, in __inference_error__,
    and the job goes on. Those carry their schema as JSON text in vLLM's structured_outputs:
    Ray Data's blocks give the dicts of a column one struct type, so a schema dict of another
    shape would come with the other rows' keys, null (and the good rows' integers as floats,
    which the server reads as JSON Schema does: 12.0 is 12)."""
    import ray
    from ray.data.llm import HttpRequestProcessorConfig, ServeDeploymentProcessorConfig, build_processor

    prompts = PROMPTS[:2]
    refused = {"not": dict(PERSON, **{"not": {"required": ["age"]}}), "huge": dict(PERSON, description="x" * 70000)}
    rows = [{"prompt": p, "request": chat_request(p, PERSON)} for p in prompts] + \
        [{"prompt": name, "request": {"messages": [{"role": "user", "content": name}], "max_tokens": 64,
                                      "structured_outputs": {"json": json.dumps(schema)}}} for name, schema in refused.items()]
    config = ServeDeploymentProcessorConfig(deployment_name="SalaServer", app_name=APP, batch_size=len(rows), concurrency=1,
                                            should_continue_on_error=True)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(row, method="chat", request_kwargs=row["request"]),
        postprocess=lambda row: {"prompt": row["prompt"], "content": row["choices"][0]["message"]["content"]},
        preprocess_map_kwargs={"num_cpus": 0.1}, postprocess_map_kwargs={"num_cpus": 0.1})
    out = {row["prompt"]: row for row in processor(ray.data.from_items(rows)).take_all()}
    http = build_processor(
        HttpRequestProcessorConfig(url=f"{server}/v1/chat/completions", batch_size=len(prompts), concurrency=1),
        preprocess=lambda row: {"prompt": row["prompt"], "payload": row["request"]},
        postprocess=lambda row: {"prompt": row["prompt"], "content": row["http_response"]["choices"][0]["message"]["content"]},
        preprocess_map_kwargs={"num_cpus": 0.1}, postprocess_map_kwargs={"num_cpus": 0.1})
    over_http_rows = {row["prompt"]: row["content"] for row in http(ray.data.from_items(rows[:len(prompts)])).take_all()}
    for prompt in prompts:
        want = over_http(server, "/v1/chat/completions", chat_request(prompt, PERSON))["choices"][0]
        assert want["finish_reason"] == "stop"
        jsonschema.validate(json.loads(want["message"]["content"]), PERSON)
        assert out[prompt]["__inference_error__"] == "" and out[prompt]["content"] == want["message"]["content"]
        assert over_http_rows[prompt] == want["message"]["content"]
    for name in refused:
        error = out[name]["__inference_error__"]
        print(f"refused row {name}:", error.splitlines()[-1])
        assert error.startswith("RayTaskError(APIError)") and "structured_outputs: " in error
    assert "'not'" in out["not"]["__inference_error__"] and "65536" in out["huge"]["__inference_error__"]


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Drafts:
    """Another deployment using SalaServer through a handle: a typed streamed completion, a dict
    /generate over two prompts, and a refused chat request caught as the APIError it is."""

    def __init__(self, app_name: str):
        self.sala = serve.get_deployment_handle("SalaServer", app_name).options(stream=True)

    async def __call__(self, prompt: str) -> dict:
        request = CompletionRequest(prompt=prompt, max_tokens=8, temperature=0, stream=True)
        chunks = [chunk async for chunk in self.sala.completions.remote(request)]
        sampling = {"max_new_tokens": 6, "temperature": 0}
        batch = [r async for r in self.sala.generate.remote({"text": [prompt, prompt + " again"], "sampling_params": sampling})]
        try:
            [r async for r in self.sala.chat.remote(ChatCompletionRequest(messages=[{"role": "user", "content": prompt}],
                                                                          max_tokens=10**6))]
            refused = None
        except APIError as e:
            refused = (e.status, e.param)
        return {"streamed": "".join(c["choices"][0]["text"] for c in chunks), "chunks": len(chunks), "batch": batch,
                "refused": refused}


def test_a_deployment_composes_the_server_through_a_handle(server):
    composer = serve.run(Drafts.bind(APP), name="drafts", route_prefix=None)
    try:
        got = composer.remote(PROMPTS[0]).result(timeout_s=120)
    finally:
        serve.delete("drafts")
    want = over_http(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert got["streamed"] == want["choices"][0]["text"] and got["chunks"] > 1
    generated = over_http(server, "/generate", {"text": [PROMPTS[0], PROMPTS[0] + " again"],
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    (batch,) = got["batch"]  # one response object: the list of both prompts' results
    assert [(r["index"], r["text"], r["output_ids"]) for r in batch] == [(r["index"], r["text"], r["output_ids"]) for r in generated]
    assert got["refused"] == (400, "max_tokens")
