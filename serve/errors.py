"""Errors as the API answers them, over HTTP and through a DeploymentHandle alike.

Errors follow OpenAI: `{"error": {"message", "type", "param", "code"}}`. A body that is not
JSON is a 400; so is one that does not match the schema (a missing or mistyped field) and a
field with an impossible value, as OpenAI, vLLM and SGLang answer (clients catch them as
BadRequestError); `param` names the field as OpenAI does (`tools[0].function.name`). No field is ignored:
one this server does not know, or knows but cannot honour (functions, function_call), is a 400
naming it, as OpenAI answers an unrecognized argument. A structured-output constraint the
engine refuses (InvalidParam("structured_outputs")) is named by the field that carried it:
response_format, tools, regex, sampling_params.json_schema, ...

This module imports no engine (only for type checking): the routing ingress (serve/router.py),
which holds no model, answers its errors with it too.
"""
from __future__ import annotations

from types import UnionType
from typing import TYPE_CHECKING, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from sala.engine import InvalidParam


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: the body of every refused request, and a failed stream's in-band event."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(ValueError):
    """A refused request, in the shape the HTTP API answers it. A ValueError, so that a caller
    through a DeploymentHandle sees a bad request as one: Ray Data's ServeDeploymentProcessorConfig
    turns a ValueError into that row's `__inference_error__` instead of failing the job."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def __reduce__(self):  # Ray pickles it to the caller; the default would call APIError(message)
        return type(self), (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def schema_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    """The 400 of a body that does not fit `model`, naming the field of its most specific error
    (the deepest: of a union's branches, the one the body went furthest into)."""
    err = max(e.errors(), key=lambda x: len(x["loc"]))
    if err["type"] == "extra_forbidden":  # the last of loc is the unknown field itself
        param = ".".join(p for p in (field_path(model, err["loc"][:-1]), str(err["loc"][-1])) if p)
        return APIError(400, f"Unrecognized request argument supplied: {param} (this server does not support it)",
                        param=param, code="unknown_field")
    param = field_path(model, err["loc"]) or None
    message = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=err["type"])


def field_path(model: type[BaseModel], loc: tuple) -> str:
    """pydantic's error location as OpenAI names a field (`messages[1].content`): list indices
    in brackets, the tags pydantic adds for a union's branches ("str", "list[TextPart]") left out."""
    path, types = "", [model]
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            types = [a for t in types if get_origin(t) is list for a in branches(get_args(t)[0])]
            continue
        fields = {f.alias or name: f for t in types if isinstance(t, type) and issubclass(t, BaseModel)
                  for name, f in t.model_fields.items()}
        if item in fields:
            path += f".{item}" if path else item
            types = branches(fields[item].annotation)
        else:  # a union's branch (narrowed to that model), or a dict's key
            types = [t for t in types if getattr(t, "__name__", None) == item] or types
    return path


def branches(annotation) -> list:
    """The types a field's annotation allows: a union's members, or itself."""
    if get_origin(annotation) in (Union, UnionType):
        return [b for a in get_args(annotation) for b in branches(a)]
    return [annotation]


# Where each SamplingParams field lives in each endpoint's body, for error messages.
PARAM_NAMES = {
    "chat": {"logprobs": "top_logprobs", "prompt": "messages"},
    "generate": {"max_tokens": "sampling_params.max_new_tokens", "min_tokens": "sampling_params.min_new_tokens",
                 "n": "sampling_params.n", "seed": "sampling_params.sampling_seed",
                 "logprobs": "top_logprobs_num", "prompt_logprobs_start": "logprob_start_len", "prompt": "text",
                 **{f: f"sampling_params.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                                                        "repetition_penalty", "presence_penalty", "frequency_penalty",
                                                        "logit_bias")}},
}


def constraint_field(body: BaseModel) -> str | None:
    """The field of `body` carrying the constraint the engine refused; None where making the
    constraint is what failed (vLLM's own structured_outputs field: the error names it already)."""
    try:
        carried = body.constraint()
    except ValueError:  # InvalidParam
        return None
    return carried and carried[0]


def client_error(e: InvalidParam, endpoint: str, body: BaseModel | None) -> APIError:
    """The 400 a bad value in a request to `endpoint` is, naming the field as that endpoint's body spells it."""
    if e.param == "structured_outputs" and (carried := constraint_field(body)) is not None:
        return APIError(400, f"{carried}: {e}", param=carried)
    param = PARAM_NAMES.get(endpoint, {}).get(e.param, e.param)
    if endpoint == "generate" and param == "text" and body.text is None:  # no text: input_ids, or neither
        param = "input_ids"
    return APIError(400, str(e), param=param)


def parse(model: type[BaseModel], data) -> BaseModel:
    """`data` (a request's JSON) as `model`; APIError naming the field when it does not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise schema_error(e, model) from None
