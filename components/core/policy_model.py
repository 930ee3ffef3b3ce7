"""A registered policy version as an MLflow pyfunc model that loads and serves.

``build(checkpoint_uri, folder, max_new_tokens, batch_size, prompt_format)`` writes an MLflow model
(``mlflow.pyfunc.save_model``) that holds no weights: its ``model_config`` names the
stored checkpoint, and ``PolicyModel.load_context`` loads it from the store with
``load_policy`` (the same verified read every stage uses), its prompts in ``prompt_format``
(``rollout.prompt_format``: ``auto`` by default, the chat template when the tokenizer has
one; a model saved before the setting existed is ``raw``). ``predict`` returns the
greedy completions of the ``hf`` engine, exactly what the eval suite scores when
``rollout.engine`` is ``hf`` (another engine's may differ)::

    import mlflow
    model = mlflow.pyfunc.load_model("models:/tiny-policy@champion")
    model.predict(["Reverse the string 'abc'."])            # -> ["cba"]
    model.predict({"prompt": ["..."]}, params={"max_new_tokens": 8})

or ``mlflow models serve -m models:/tiny-policy@champion --env-manager local`` and a
POST of ``{"inputs": ["..."]}`` (or ``dataframe_split`` with a ``prompt`` column) to
``/invocations``. ``models:/`` URIs resolve through ``MLFLOW_TRACKING_URI``; for the
embedded tracking that is ``sqlite:///<POSTTRAIN_HOME>/mlflow.db``. A request's
``max_new_tokens`` (the model's own when not sent) is an integer of at least 1; another
is a ValueError, which a served model answers with HTTP 400.

Not covered: the model is only as portable as the checkpoint URI inside it: whoever
loads it needs read access to the store (``file://`` checkpoints load only on the
machine that wrote them) and the ``posttrain`` package importable (the project's image
or virtualenv; the pickled model refers to this module, no code is copied). Sampling
(temperature, top-p), multi-turn chat messages and token-level outputs (logprobs) are not
exposed; serving at rollout scale is ``posttrain serve`` (``components.rollout.serve``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import numbers
import warnings
from typing import Any

import mlflow.pyfunc
import pandas as pd

REQUIREMENTS = ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pandas", "fsspec", "s3fs",
                "pyarrow", "pydantic", "pyyaml")
"""Distributions the model's environment pins (``posttrain`` itself is not on an index)."""


def requirements() -> list[str]:
    """``name==version`` of each of REQUIREMENTS installed here, without a local version
    tag (``torch==2.13.0+cpu`` cannot be installed from an index; ``torch==2.13.0`` can)."""
    out = []
    for name in REQUIREMENTS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(f"{name}=={version.split('+', 1)[0]}")
    return out


def prompts_of(model_input: Any) -> list[str]:
    """The prompts of a pyfunc input: a list of strings (or a numpy array of them, as
    ``{"inputs": [...]}`` reaches a served model), a single string, a dict with a
    ``prompt`` list, or a pandas DataFrame with a ``prompt`` column (or a single column)."""
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        if "prompt" not in model_input:
            raise ValueError(f"a dict input needs the key 'prompt'; got keys {sorted(model_input)}")
        return prompts_of(model_input["prompt"])
    if isinstance(model_input, pd.DataFrame):
        if "prompt" in model_input.columns:
            column = model_input["prompt"]
        elif len(model_input.columns) == 1:
            column = model_input.iloc[:, 0]
        else:
            raise ValueError(f"a DataFrame input needs a 'prompt' column; got {list(model_input.columns)}")
        return [str(p) for p in column.tolist()]
    if isinstance(model_input, pd.Series):
        return [str(p) for p in model_input.tolist()]
    if hasattr(model_input, "tolist"):  # numpy arrays
        model_input = model_input.tolist()
    if isinstance(model_input, (list, tuple)):
        flat = [p[0] if isinstance(p, (list, tuple)) and len(p) == 1 else p for p in model_input]
        if all(isinstance(p, str) for p in flat):
            return list(flat)
    raise ValueError(f"expected prompts (list of strings, {{'prompt': [...]}} or a DataFrame with a 'prompt' column); "
                     f"got {type(model_input).__name__}")


def new_tokens(params: dict[str, Any] | None, default: int) -> int:
    """The request's ``max_new_tokens`` (``default``, the model's, when absent): an integer
    of at least 1, else a ValueError (a served model answers it with HTTP 400, as ``posttrain
    serve`` answers a ``max_tokens`` below 1). A value past the model's positions is only
    capped by the engine."""
    value = (params or {}).get("max_new_tokens")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_new_tokens={value!r:.40} is out of range: send an integer of at least 1, or leave it "
                         f"out for {default}")
    return int(value)


class PolicyModel(mlflow.pyfunc.PythonModel):
    """Greedy completions of the checkpoint named by ``model_config["checkpoint_uri"]``."""

    def load_context(self, context) -> None:
        from components.core.models import TAG_WEIGHTS, check_weights
        from components.core.policy import load_policy

        config = context.model_config or {}
        self.config = dict(config)
        if config.get("weights_sha256"):  # the checkpoint's place re-written since: refused, never served unjudged
            check_weights("of this model", config["checkpoint_uri"], {TAG_WEIGHTS: config["weights_sha256"]},
                          "checkpoint_uri")
        self.policy = load_policy(config["checkpoint_uri"], field="checkpoint_uri",
                                  prompt_format=str(config.get("prompt_format", "raw")))

    # The hint names the form a served model receives; a DataFrame hint also tells MLflow
    # not to validate or convert the input, so lists and dicts reach prompts_of as they are.
    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        from components.core.plugins import ENGINES  # the engine by name: core imports no stage package

        prompts = prompts_of(model_input)
        if not prompts:
            return []
        max_new_tokens = new_tokens(params, int(self.config.get("max_new_tokens", 24)))
        batch_size = int(self.config.get("batch_size", 64))
        samples = ENGINES.load("hf")().generate(self.policy, prompts, max_new_tokens, 1.0, 0, batch_size, greedy=True)
        return [s.text for s in samples]


def signature(max_new_tokens: int):
    """Any input passes (``prompts_of`` reads it); ``max_new_tokens`` is a request parameter."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(inputs=None, outputs=Schema([ColSpec("string")]),
                          params=ParamSchema([ParamSpec("max_new_tokens", "long", int(max_new_tokens))]))


def build(checkpoint_uri: str, folder: str, max_new_tokens: int, batch_size: int = 64, prompt_format: str = "auto",
          weights_sha256: str = "") -> None:
    """Write the MLflow model of ``checkpoint_uri`` into the empty or absent ``folder``;
    with ``weights_sha256`` its load refuses a checkpoint that holds other weights by then
    (``models.check_weights``)."""
    config = {"checkpoint_uri": checkpoint_uri, "max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size),
              "prompt_format": prompt_format, **({"weights_sha256": weights_sha256} if weights_sha256 else {})}
    # MLflow's advice (type hints, an input example, models-from-code) does not apply to a
    # model whose input is read by prompts_of and whose code is the posttrain package:
    # keep it out of every stage's log.
    pyfunc_log = logging.getLogger("mlflow.pyfunc")
    level = pyfunc_log.level
    pyfunc_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            mlflow.pyfunc.save_model(path=folder, python_model=PolicyModel(), model_config=config,
                                     pip_requirements=requirements(), signature=signature(max_new_tokens))
    finally:
        pyfunc_log.setLevel(level)
