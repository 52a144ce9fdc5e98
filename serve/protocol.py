"""The API's request bodies (OpenAI /v1/completions and /v1/chat/completions, SGLang's
/generate and the rest), their translation into SamplingParams, and the pieces responses are
made of (usage, logprobs, finish reasons). The same over HTTP and through a DeploymentHandle;
serve/errors.py holds how a refused one is answered.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from sala.engine import InvalidParam, RequestOutput, SamplingParams, SpecStats, StructuredOutputs, TokenLogprob
from sala.tools import Function
from sala.tools.messages import template_message
from serve.token_bytes import TokenBytes


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not know is a 400, never ignored


class StreamOptions(_Body):
    include_usage: bool | None = False


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, token ids as JSON object keys -> {token id: bias}."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidParam("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return out


MAX_SCHEMA_DEPTH = 100  # JSON nesting a schema may have: its checks and xgrammar's conversion recurse through it


def schema_text(schema: dict, param: str) -> str:
    """A JSON schema as the engine's constraint takes it: JSON text in the user's key order (the
    order the output's properties come in), its integral floats as integers. InvalidParam(param)
    where it nests deeper than MAX_SCHEMA_DEPTH, before anything recurses through it."""
    shallow(schema, param)
    return json.dumps(integral(schema), ensure_ascii=False)


def checked_schema_text(text: str, param: str) -> str:
    """A schema given as JSON text, refused (InvalidParam(param)) where it nests deeper than
    MAX_SCHEMA_DEPTH; text that is no JSON is left to the engine, which says so."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    except RecursionError:  # deeper than the parser goes
        raise InvalidParam(param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    shallow(schema, param)
    return text


def shallow(value, param: str) -> None:
    """InvalidParam(param) where `value`'s lists and objects nest deeper than MAX_SCHEMA_DEPTH
    (walked without recursion: the point is not to recurse that deep)."""
    level = [value]
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
        if not level:
            return
    raise InvalidParam(param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")


def integral(value):
    """`value` with numbers of zero fraction as integers, as JSON Schema reads them (a maxLength of
    12.0 is 12) and xgrammar does not: Ray Data's blocks turn a column's integers into floats
    where some rows lack the field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return [integral(v) for v in value] if isinstance(value, list) else value


def one_constraint(given: dict[str, StructuredOutputs | None]) -> tuple[str, StructuredOutputs] | None:
    """(the field that carries it, the constraint) of a request, from each field that may carry
    one; InvalidParam naming the second field where two do (an output follows one constraint)."""
    carried = [(name, c) for name, c in given.items() if c is not None]
    if len(carried) > 1:
        (first, _), (second, _) = carried[:2]
        raise InvalidParam(second, f"give one structured-output constraint per request: {first} and {second} are both given")
    return carried[0] if carried else None


def structural_tag_text(value: dict | str, param: str) -> str:
    """A structural tag in either of vLLM's shapes, as the engine's constraint takes it:
    xgrammar's {"type": "structural_tag", "format": {...}}, or the legacy {"structures": [{"begin",
    "schema", "end"}, ...], "triggers": [...]} (free text, each structure where a trigger starts
    it, its content JSON for its schema). InvalidParam(param) for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidParam(param, f"the structural tag is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidParam(param, f"the structural tag nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    shallow(value, param)
    if isinstance(value, dict) and isinstance(value.get("format"), dict):
        return json.dumps({"type": "structural_tag", "format": integral(value["format"])}, ensure_ascii=False)
    if isinstance(value, dict) and isinstance(value.get("structures"), list) and isinstance(value.get("triggers"), list):
        try:
            tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": integral(s["schema"])},
                     "end": s["end"]} for s in value["structures"]]
        except (KeyError, TypeError):
            raise InvalidParam(param, 'each of the structural tag\'s structures needs "begin", "schema" and "end"') from None
        return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": value["triggers"],
                                                                "tags": tags}}, ensure_ascii=False)
    raise InvalidParam(param, 'a structural tag is {"type": "structural_tag", "format": {...}}, or {"structures": '
                              '[{"begin", "schema", "end"}, ...], "triggers": [...]}')


class VLLMStructuredOutputs(_Body):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one of its fields."""

    json_: str | dict | None = Field(None, alias="json")  # a JSON schema: an object, or its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF)
    structural_tag: str | None = None  # as JSON text (structural_tag_text's shapes)

    def constraint(self) -> StructuredOutputs:
        schema = schema_text(self.json_, "structured_outputs") if isinstance(self.json_, dict) else \
            None if self.json_ is None else checked_schema_text(self.json_, "structured_outputs")
        tag = None if self.structural_tag is None else structural_tag_text(self.structural_tag, "structured_outputs")
        return StructuredOutputs(json=schema, json_object=bool(self.json_object), regex=self.regex, choice=self.choice,
                                 grammar=self.grammar, structural_tag=tag)


class SGLangConstraints(_Body):
    """SGLang's constraint fields (one a request), in /generate's sampling_params and as extra
    fields of the OpenAI routes."""

    json_schema: str | None = None  # a JSON schema as JSON text
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # as JSON text (structural_tag_text's shapes)

    def sglang_constraints(self, prefix: str = "") -> dict[str, StructuredOutputs | None]:
        schema = None if self.json_schema is None else checked_schema_text(self.json_schema, f"{prefix}json_schema")
        tag = None if self.structural_tag is None else structural_tag_text(self.structural_tag, f"{prefix}structural_tag")
        return {f"{prefix}json_schema": None if schema is None else StructuredOutputs(json=schema),
                f"{prefix}regex": None if self.regex is None else StructuredOutputs(regex=self.regex),
                f"{prefix}ebnf": None if self.ebnf is None else StructuredOutputs(grammar=self.ebnf),
                f"{prefix}structural_tag": None if tag is None else StructuredOutputs(structural_tag=tag)}


class _OpenAISampling(SGLangConstraints):
    model: str | None = None  # as in vLLM: omitted means the server's (first) model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the end user, for abuse monitoring: logged with the request id
    # Extensions, as vLLM and SGLang name them:
    top_k: int | None = None  # -1 or 0 = off
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False  # vLLM's name ...
    no_stop_trim: bool | None = False  # ... and SGLang's, for keeping the matched stop in the text
    structured_outputs: VLLMStructuredOutputs | None = None  # vLLM's; SGLang's json_schema, regex, ebnf come with SGLangConstraints

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    def constraints(self) -> dict[str, StructuredOutputs | None]:
        """Each field that may carry the output's constraint -> the one it carries."""
        vllm = None if self.structured_outputs is None else self.structured_outputs.constraint()
        return {"structured_outputs": vllm, **self.sglang_constraints()}

    def constraint(self) -> tuple[str, StructuredOutputs] | None:
        """(the field that carries it, the constraint): errors about the constraint name that field."""
        return one_constraint(self.constraints())

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        constraint = self.constraint()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            logprobs=logprobs,
            min_tokens=self.min_tokens or 0,
            logit_bias=logit_bias_ids(self.logit_bias),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            no_stop_trim=bool(self.include_stop_str_in_output or self.no_stop_trim),
            structured_outputs=constraint and constraint[1],
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False  # the prompt before the completion, with its logprobs (the first null) when logprobs is set
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprob tokens as "token_id:<id>", never ambiguous
    suffix: str | None = None
    best_of: int | None = None  # 1 (or none) only, as load testers send it

    def prompts(self) -> list[str | list[int]]:
        if self.suffix is not None or self.best_of not in (None, 1):
            field = "suffix" if self.suffix is not None else "best_of"
            raise InvalidParam(field, f"{field} is not supported by this server")
        p = self.prompt
        out = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not out or any(len(x) == 0 for x in out):
            raise InvalidParam("prompt", "prompt is empty")
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an assistant message made (OpenAI's message.tool_calls[i], sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """Any of OpenAI's chat messages: system, developer, user, assistant (content null beside its
    tool_calls), tool (a call's result, with its tool_call_id). `name` is the participant's."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant message's reasoning, as this server answers it
    refusal: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role != "assistant" and (self.tool_calls or self.reasoning_content is not None or self.refusal is not None):
            raise ValueError("only an assistant message has tool_calls, reasoning_content or refusal")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError(f"a {self.role} message needs content (only an assistant's with tool_calls may be null)")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def for_template(self, index: int) -> dict:
        """The message as chat templates read it (sala/tools/messages.py), as message `index` of its conversation."""
        return template_message(self.model_dump(exclude_none=True, exclude={"refusal"}), index)


class JSONSchemaFormat(_Body):
    """OpenAI's response_format.json_schema. The output always follows the schema, strict or not
    (as vLLM): strict only promises that."""

    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format, and vLLM's structural tag in either of its shapes (structural_tag_text)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: dict | None = None
    structures: list[dict] | None = None
    triggers: list[str] | None = None

    def constraint(self) -> StructuredOutputs | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidParam("response_format", 'response_format.json_schema goes with type "json_schema", and only with it')
        tag_fields = {k: v for k in ("format", "structures", "triggers") if (v := getattr(self, k)) is not None}
        if (self.type == "structural_tag") != bool(tag_fields):
            raise InvalidParam("response_format", 'response_format.format (or structures and triggers) goes with type '
                                                  '"structural_tag", and only with it')
        if self.type == "text":
            return None
        if self.type == "structural_tag":
            return StructuredOutputs(structural_tag=structural_tag_text(tag_fields, "response_format"))
        return StructuredOutputs(json_object=True) if self.type == "json_object" else \
            StructuredOutputs(json=schema_text(self.json_schema.schema_, "response_format"))


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # the arguments always follow `parameters` (as JSONSchemaFormat.strict)

    def arguments_schema(self) -> dict:
        return {"type": "object", "properties": {}} if self.parameters is None else self.parameters


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


# Chat fields of OpenAI's that are deprecated, refused unless they ask for nothing.
DEPRECATED = {"functions": ([], "tools"), "function_call": ("none", "tool_choice")}


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and SGLang's: extra variables of the chat template
    separate_reasoning: bool | None = True  # SGLang's: the reasoning in reasoning_content (false: left in the content)
    tool_call_parser: str | None = None  # extension: the tool-call format of this request (default: the server's)
    functions: Any = None
    function_call: Any = None
    # The constraint the tools make under the server's tool-call format (OpenAIAPI.chat sets it):
    # one of the request's constraints, named "tools".
    _tools_constraint: StructuredOutputs | None = PrivateAttr(None)

    def refuse_deprecated(self) -> None:
        for name, (harmless, instead) in DEPRECATED.items():
            value = getattr(self, name)
            if value is not None and value != harmless:
                raise InvalidParam(name, f"{name} is deprecated by OpenAI and not supported by this server: use {instead}")

    def tool_call(self) -> str | None:
        """What tool_choice asks of the output: None (text), "auto" (text or calls, the model's
        choice: OpenAI's default with tools), "required" (one or more calls of the tools) or the
        name of the one function to call."""
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if not names:
            if choice not in (None, "none"):
                raise InvalidParam("tool_choice", "tool_choice needs tools: give the functions it may call in tools")
            return None
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise InvalidParam("tools", f"two tools are named {twice[0]!r}: tool names must be distinct")
        if choice in (None, "none", "auto", "required"):
            return "auto" if choice is None else None if choice == "none" else choice
        if choice.function.name not in names:
            raise InvalidParam("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not one of "
                                              f"the tools ({', '.join(map(repr, names))})")
        return choice.function.name

    def tool_functions(self) -> list[Function]:
        """The tools' functions, each schema checked for depth before anything recurses through it."""
        out = []
        for t in self.tools or []:
            shallow(t.function.arguments_schema(), "tools")
            out.append(Function(t.function.name, integral(t.function.arguments_schema())))
        return out

    def set_tools_constraint(self, c: StructuredOutputs | None) -> None:
        self._tools_constraint = c

    def constraints(self) -> dict[str, StructuredOutputs | None]:
        response_format = None if self.response_format is None else self.response_format.constraint()
        return {"response_format": response_format, **super().constraints(), "tools": self._tools_constraint}

    def top_k_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs", "top_logprobs requires logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """vLLM's and SGLang's /tokenize: a prompt (SGLang: or a list of them) or chat messages (vLLM)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # for messages, as vLLM
    return_token_strs: bool = False  # vLLM

    def texts(self, chat_template) -> tuple[list[str], bool]:
        """-> (texts, batched): the texts to tokenize, and whether the answer is a list of them.
        chat_template(messages, add_generation_prompt=...) is the text the messages make."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParam("prompt", "give exactly one of prompt or messages")
        if self.messages is not None:
            if not self.messages:
                raise InvalidParam("messages", "messages is empty")
            return [chat_template(self.messages, add_generation_prompt=self.add_generation_prompt)], False
        return ([self.prompt], False) if isinstance(self.prompt, str) else (list(self.prompt), True)


class DetokenizeRequest(_Body):
    """vLLM's and SGLang's /detokenize: token ids (SGLang: or a list of lists) -> text."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False  # as given: the text the ids stand for


class GenerateSampling(SGLangConstraints):
    """SGLang's sampling_params; unknown keys are an error (a typo must not silently fall back)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None  # request id(s), one per prompt: /abort_request cancels by it

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidParam("text", "give exactly one of text or input_ids")
        p = self.text if self.text is not None else self.input_ids
        out = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not out or any(len(x) == 0 for x in out):
            raise InvalidParam("text" if self.text is not None else "input_ids", "prompt is empty")
        return out

    def constraint(self) -> tuple[str, StructuredOutputs] | None:
        """(the field that carries it, the constraint), as OpenAI's requests answer it."""
        return one_constraint(self.sampling_params.sglang_constraints("sampling_params."))

    def sampling(self) -> SamplingParams:
        s = self.sampling_params
        constraint = self.constraint()
        if not self.return_logprob and (self.top_logprobs_num or self.logprob_start_len >= 0):
            raise InvalidParam("return_logprob", "top_logprobs_num and logprob_start_len need return_logprob: true")
        return SamplingParams(
            max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
            seed=s.sampling_seed, stop=[s.stop] if isinstance(s.stop, str) else list(s.stop or []),
            stop_token_ids=list(s.stop_token_ids or []), ignore_eos=s.ignore_eos, skip_special_tokens=s.skip_special_tokens,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs_start=self.logprob_start_len if self.return_logprob and self.logprob_start_len >= 0 else None,
            min_tokens=s.min_new_tokens, min_p=s.min_p, no_stop_trim=s.no_stop_trim, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=logit_bias_ids(s.logit_bias),
            structured_outputs=constraint and constraint[1],
        )

    def rids(self, num_prompts: int) -> list[str] | None:
        """The rid of each prompt (None: the server makes ids)."""
        if self.rid is None:
            return None
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if len(rids) != num_prompts or len(set(rids)) != len(rids) or not all(rids):
            raise InvalidParam("rid", f"rid must be one distinct non-empty id per prompt ({num_prompts}), got {self.rid!r}")
        return rids


class AbortRequest(_Body):
    """SGLang's /abort_request: cancel the request(s) with this rid, or every running one."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class Choice:
    """One choice's outputs, accumulated as they arrive."""

    index: int
    request_id: str = ""  # the engine's id of the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None  # the stop string or token id that ended it
    stop_token_ids: tuple[int, ...] = ()  # the request's own, to tell them from eos
    spec: SpecStats | None = None  # a Medusa engine's verify steps and draft tokens

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop_token_ids entry that ended the choice; None
        for eos, a length finish, or an unfinished choice."""
        return self.matched if isinstance(self.matched, str) or self.matched in self.stop_token_ids else None

    def add(self, out: RequestOutput) -> None:
        self.request_id = out.request_id
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.spec = out.spec
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.prompt_logprobs += out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.matched = out.matched


def usage(choices: list[Choice], prompt_tokens: int, n: int = 1) -> dict:
    """OpenAI's usage; cached_tokens counts each prompt once (its first choice's), like prompt_tokens."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices[::n])
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    return out | spec_stats(choices)


def spec_stats(choices: list[Choice]) -> dict:
    """Medusa's per-request counters (none without Medusa), SGLang's names: verify steps, drafted
    and accepted tokens (the bonus token not counted), and the engine's accept length of their sum."""
    stats = [c.spec for c in choices if c.spec is not None]
    if not stats:
        return {}
    total = SpecStats(sum(s.verify_steps for s in stats), sum(s.draft_tokens for s in stats),
                      sum(s.accepted_tokens for s in stats))
    return {"spec_verify_ct": total.verify_steps, "spec_draft_token_num": total.draft_tokens,
            "spec_accept_token_num": total.accepted_tokens, "spec_accept_length": total.accept_length}


class TokenText:
    """Token id -> its text, as shown in logprobs (`.bytes`: the bytes it stands for)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.bytes = TokenBytes(tokenizer)

    def __call__(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id])
        return self.cache[token_id]


def token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling: distinct ids stay distinct keys whatever their text."""
    return f"token_id:{token_id}"


def completion_logprobs(text_of: Callable[[int], str], entries: list[TokenLogprob], offset: int,
                        first_token: int | None = None) -> dict:
    """OpenAI completion logprobs of `entries`; an echoed prompt passes its first token, which has no
    logprob and comes first with nulls (as vLLM and SGLang answer, and lm-evaluation-harness reads)."""
    head = [] if first_token is None else [first_token]
    tokens = [text_of(t) for t in head + [e.token_id for e in entries]]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None] * len(head) + [e.logprob for e in entries],
            "top_logprobs": [None] * len(head) + [{text_of(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(text_of: TokenText, entries: list[TokenLogprob]) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        t = text_of(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(text_of.bytes(token_id))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def sglang_logprobs(text_of: TokenText, entries: list[TokenLogprob], with_text: bool) -> tuple[list, list]:
    """-> (token_logprobs [[logprob, id, text]], top_logprobs [[[logprob, id, text], ...]])."""
    def one(token_id: int, logprob: float | None) -> list:
        return [logprob, token_id, text_of(token_id) if with_text else None]

    return [one(e.token_id, e.logprob) for e in entries], [[one(t, lp) for t, lp in e.top] for e in entries]


def sglang_finish_reason(c: Choice) -> dict | None:
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched}
    return {"type": "abort"} if c.finish_reason else None
