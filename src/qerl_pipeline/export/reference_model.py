"""An MLflow pyfunc model (models from code) that generates with a model folder it references by path.

``registry.register_export`` with ``export.log_weights: false`` logs this file as the model's code
and the absolute path of ``merged/`` as its ``model_config``: the registered version holds a few
kilobytes, the weights stay where the export wrote them. MLflow copies this file into the logged
model and runs it when the model loads, so it imports nothing of this project:
``mlflow.pyfunc.load_model("models:/<name>/<version>").predict(["prompt", ...])`` returns the
generated texts (greedy; ``params={"max_new_tokens": n}`` where the model has a params schema).
"""

import mlflow
from mlflow.pyfunc import PythonModel


class ReferencedModel(PythonModel):
    """transformers' text-generation pipeline over the folder at ``model_config["path"]``."""

    def load_context(self, context):
        from transformers import pipeline

        config = context.model_config or {}
        self.max_new_tokens = int(config.get("max_new_tokens", 64))
        self.pipe = pipeline("text-generation", model=config["path"])

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        if hasattr(model_input, "iloc"):  # a DataFrame: its first column
            model_input = model_input.iloc[:, 0].tolist()
        prompts = [model_input] if isinstance(model_input, str) else list(model_input)
        n = int((params or {}).get("max_new_tokens", self.max_new_tokens))
        outputs = self.pipe(prompts, max_new_tokens=n, do_sample=False, return_full_text=False)
        return [out[0]["generated_text"] for out in outputs]


mlflow.models.set_model(ReferencedModel())
