"""Stage processes import transformers without scikit-learn (``components.core.hfimport``).

Each case runs in a fresh interpreter: whether scikit-learn is imported is decided by
the first model class import of the process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="scikit-learn is not installed, so there is nothing to leave out")


def imported_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; what it leaves imported, and what it printed last."""
    script = code + "\nimport json, sys\nprint(json.dumps({'sklearn': 'sklearn' in sys.modules, "\
                    "'scipy.stats': 'scipy.stats' in sys.modules}))\n"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_alone_imports_scikit_learn() -> None:
    """The control: without the switch a model class pulls scikit-learn in (so the tests
    below can fail)."""
    assert imported_after("from transformers import LlamaConfig")["sklearn"] is True


def test_a_fresh_model_leaves_scikit_learn_out() -> None:
    got = imported_after(
        "from components.core.policy import build_model\n"
        "from components.core.recipe import ModelConfig\n"
        "import torch\n"
        "m = build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), 40)\n"
        "assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 40)\n")
    assert got == {"sklearn": False, "scipy.stats": False}


def test_a_checkpoint_and_its_tokenizer_load_without_scikit_learn(tmp_path: Path) -> None:
    from components.core.policy import build_model, build_tokenizer
    from components.core.recipe import ModelConfig

    tokenizer = build_tokenizer()
    build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    got = imported_after(
        "from components.core.prompts import load_tokenizer\n"
        f"t = load_tokenizer({str(tmp_path)!r})\n"
        "from components.core.policy import load_policy\n"
        f"p = load_policy({str(tmp_path)!r})\n"
        "assert p.tokenizer.decode(p.tokenizer.encode('ab', add_special_tokens=False)) == 'ab'\n"
        "assert t.encode('ab', add_special_tokens=False) == p.tokenizer.encode('ab', add_special_tokens=False)\n")
    assert got["sklearn"] is False


def test_the_stage_host_preload_leaves_scikit_learn_out() -> None:
    got = imported_after(
        "from dags.local import import_name\n"
        "for name in ('torch', 'transformers:AutoModelForCausalLM', 'transformers:AutoTokenizer',"
        " 'transformers.models.llama.modeling_llama'):\n"
        "    import_name(name)\n")
    assert got["sklearn"] is False


def test_too_late_changes_nothing() -> None:
    """Once the generation module has loaded, ``lean()`` leaves transformers as it is."""
    got = imported_after(
        "from transformers import LlamaConfig\n"
        "import transformers.utils\n"
        "before = transformers.utils.is_sklearn_available\n"
        "from components.core import hfimport\n"
        "hfimport.lean()\n"
        "assert transformers.utils.is_sklearn_available is before and before() is True\n")
    assert got["sklearn"] is True
