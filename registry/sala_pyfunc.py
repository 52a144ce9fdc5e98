"""MLflow models-from-code entry: a registered SALA checkpoint as a pyfunc that generates text.

`mlflow.pyfunc.load_model("models:/name@alias").predict(["prompt", ...])` returns greedy
continuations; params may set max_new_tokens.
"""
import mlflow
from mlflow.pyfunc import PythonModel


class SALAPyfunc(PythonModel):
    def load_context(self, context):
        from transformers import AutoTokenizer

        from sala.checkpoint import load_model

        path = context.artifacts["checkpoint"]
        self.model = load_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        max_new = int((params or {}).get("max_new_tokens", 32))
        outs = []
        for prompt in model_input:
            ids = self.tokenizer(prompt, return_tensors="pt")
            seq = self.model.generate(**ids, max_new_tokens=max_new, do_sample=False)
            outs.append(self.tokenizer.decode(seq[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
        return outs


mlflow.models.set_model(SALAPyfunc())
