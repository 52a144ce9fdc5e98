"""MLflow models-from-code entry: a registered SALA checkpoint as a pyfunc that generates text.

    model = mlflow.pyfunc.load_model("models:/tiny-sala-nvfp4@champion")
    model.predict(["The for statement", "def fib(n):"], params={"max_new_tokens": 16})

returns one continuation per prompt, the prompts generated together in one engine batch. Params
(`mlflow models serve` takes them as the request's "params"), with the defaults of the signature
registry/models.py logs: max_new_tokens (32), temperature (0: greedy), top_p (1), top_k (0: off),
seed (none: each call draws anew).
"""
import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


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
        sampling = SamplingParams(max_tokens=params["max_new_tokens"], temperature=params["temperature"],
                                  top_p=params["top_p"], top_k=params["top_k"], seed=params["seed"])
        try:
            sampling.validate(self.engine.model.config.vocab_size)  # before any prompt of the batch is queued
            completions = self.engine.generate(model_input.iloc[:, 0].tolist(), sampling)
        except InvalidParam as e:  # the caller's mistake: MLflow answers 400 with this line, not a traceback
            raise MlflowException.invalid_parameter_value(str(e)) from None
        return [c.text for c in completions]


mlflow.models.set_model(SALAPyfunc())
