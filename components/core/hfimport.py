"""Importing transformers without the scikit-learn it does not need here.

transformers' generation module (loaded with every model class) imports
``sklearn.metrics`` whenever scikit-learn is installed, and scikit-learn comes with
MLflow. Without it a process importing what a rollout or trainer stage needs starts in
5.6-5.8 s instead of 6.4-6.5 s on a 2-core machine (nothing where Great Expectations, which
imports SciPy and pandas itself, is imported too); transformers uses it only for
assisted generation's confidence threshold (``assistant_confidence_threshold``), which
posttrain never uses.

``lean()`` makes transformers' own ``is_sklearn_available`` answer False. It must run
before the first model class loads (``AutoModelForCausalLM``, ``LlamaForCausalLM``);
after that it changes nothing. Not covered: assisted generation with a confidence
threshold then fails with transformers' "requires scikit-learn" error; a transformers
release that moves the check makes this a no-op (the import is only slower again).
"""

from __future__ import annotations

import sys


def _absent() -> bool:
    return False


def lean() -> None:
    """Make transformers treat scikit-learn as absent (idempotent; see the module)."""
    import transformers.utils

    if "transformers.generation.candidate_generator" in sys.modules:  # too late: the import already ran
        return
    if hasattr(transformers.utils, "is_sklearn_available"):
        transformers.utils.is_sklearn_available = _absent
