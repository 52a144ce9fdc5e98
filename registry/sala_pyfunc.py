"""MLflow models-from-code entry: a registered SALA checkpoint as a pyfunc that generates text.

    model = mlflow.pyfunc.load_model("models:/tiny-sala-nvfp4@champion")
    model.predict(["The for statement", "def fib(n):"], params={"max_new_tokens": 16})

returns one continuation per prompt, the prompts generated together in one engine batch. Params
(`mlflow models serve` takes them as the request's "params"), with the defaults of the signature
registry/models.py logs: max_new_tokens (32), temperature (0: greedy), top_p (1), top_k (0: off),
seed (none: each call draws anew), and at most one structured-output constraint for every prompt
of the call: json_schema (a JSON schema, as JSON text), json_object (true: any JSON object),
regex (the whole output matches it), choice (a list of strings) or grammar (EBNF, GBNF dialect).

    model.predict(["Name a colour:"], params={"choice": ["red", "green", "blue"]})
"""
import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

# The constraint params, each to its StructuredOutputs field (a schema is `json` there, as in vLLM's
# structured_outputs; json_schema here, as generate.py's --json-schema).
CONSTRAINTS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
PARAM_OF = {field: param for param, field in CONSTRAINTS.items()}


class SALAPyfunc(PythonModel):
    def load_context(self, context):
        from sala.engine import Engine

        # Eager decode steps: compiling them costs 15-60 s on CPU, which a pyfunc predicting a
        # batch now and then does not win back (serve.app compiles: it serves for hours).
        self.engine = Engine.from_pretrained(context.artifacts["checkpoint"], compile=False)
        self.engine.warmup()  # with Medusa heads: times the steps its draft trees are chosen by

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> list[str]:
        from mlflow.exceptions import MlflowException

        from sala.engine import InvalidParam, SamplingParams

        # The signature's one string column; MLflow has filled in the params the caller left out.
        try:
            sampling = SamplingParams(max_tokens=params["max_new_tokens"], temperature=params["temperature"],
                                      top_p=params["top_p"], top_k=params["top_k"], seed=params["seed"],
                                      structured_outputs=constraint(params))
            # Checked, and the constraint compiled, before any prompt of the batch is queued.
            sampling.validate(self.engine.model.config.vocab_size)
            if (structured := sampling.structured_outputs) is not None:
                param = PARAM_OF[structured.kind]
                try:
                    self.engine.grammars.compiled(structured)
                except InvalidParam as e:
                    raise InvalidParam(param, f"{param}: {e}") from None
            completions = self.engine.generate(model_input.iloc[:, 0].tolist(), sampling)
        except InvalidParam as e:  # the caller's mistake: MLflow answers 400 with this line, not a traceback
            raise MlflowException.invalid_parameter_value(str(e)) from None
        return [c.text for c in completions]


def constraint(params: dict):
    """The StructuredOutputs of the constraint params given (None without one); InvalidParam for
    more than one, or a bad one, naming the param."""
    from sala.engine import InvalidParam, StructuredOutputs

    # The signature's defaults (null, false, the empty list) mean "not given".
    given = {name: params[name] for name in CONSTRAINTS if params.get(name) not in (None, False, [])}
    if len(given) > 1:
        raise InvalidParam("structured_outputs", f"give at most one of {', '.join(CONSTRAINTS)}; got {', '.join(given)}")
    if not given:
        return None
    ((name, value),) = given.items()
    try:
        return StructuredOutputs(**{CONSTRAINTS[name]: value}).validate()
    except InvalidParam as e:
        raise InvalidParam(name, f"{name}: {e}") from None


mlflow.models.set_model(SALAPyfunc())
