"""torch's intra-op threads: ``POSTTRAIN_TORCH_THREADS`` (``settings.torch_threads``).

``posttrain run`` defaults it to ``auto`` (its stages run one after the other, so each
may use every core the process has); every other entry to 1. The trainer records what
it ran on as ``trainer/torch_threads``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from components.core import settings
from components.core.errors import UserError
from components.core.seeds import configure_torch
from tests.fixtures.runs import TINY, cli_env, run_posttrain

CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("raw", "expected"), [(None, 1), ("", 1), ("3", 3), ("auto", CPUS), ("AUTO", CPUS)])
def test_values(raw: str | None, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv("POSTTRAIN_TORCH_THREADS", raising=False)
    else:
        monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", raw)
    assert settings.torch_threads() == expected


@pytest.mark.parametrize(("raw", "default", "expected"), [(None, "auto", CPUS), ("", "auto", CPUS), ("2", "auto", 2)])
def test_the_default_applies_only_when_unset_or_empty(raw: str | None, default: str, expected: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv("POSTTRAIN_TORCH_THREADS", raising=False)
    else:
        monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", raw)
    assert settings.torch_threads(default=default) == expected


BAD = ["0", "-2", "two", "1.5", "513", "100000", "9" * 5000, "٣٠٠٠", "٣"]  # 5,000 digits; Arabic-Indic 3000 and 3


@pytest.mark.parametrize("raw", BAD, ids=["0", "-2", "two", "1.5", "513", "100000", "5000-digits", "arabic-3000",
                                          "arabic-3"])
def test_a_bad_value_names_the_variable_and_the_fix(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", raw)
    with pytest.raises(UserError) as err:
        settings.torch_threads()
    line = err.value.line()
    assert line.startswith("POSTTRAIN_TORCH_THREADS=")
    assert line.endswith(": not a thread count from 1 to 512 or 'auto'; "
                         "fix: export POSTTRAIN_TORCH_THREADS=auto (or 1, 2, ...), or unset it")
    assert len(line) < 400  # the value is shown cut short


@pytest.mark.parametrize("command", [["stage", "taskgen"], ["run", "--iterations", "1"]], ids=["stage", "run"])
def test_the_cli_refuses_a_bad_value_before_any_work(command: list[str], tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = run_posttrain([*command, "--recipe", str(TINY), "--run-root", f"file://{store}"], tmp_path,
                         cli_env(tmp_path / ".posttrain", POSTTRAIN_TORCH_THREADS="100000"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["posttrain: error: POSTTRAIN_TORCH_THREADS='100000': not a thread count "
                                        "from 1 to 512 or 'auto'; fix: export POSTTRAIN_TORCH_THREADS=auto "
                                        "(or 1, 2, ...), or unset it"]
    assert not store.exists()


def test_configure_torch_sets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", "auto")
        configure_torch()
        assert torch.get_num_threads() == CPUS
        monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", "1")
        configure_torch()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def trainer_threads(home: Path) -> float:
    manifest = json.loads((home / "store" / "tiny" / "iter-000001" / "trainer" / "_MANIFEST.json").read_text())
    return manifest["metrics"]["trainer/torch_threads"]


@pytest.mark.slow
@pytest.mark.skipif(CPUS < 2, reason="on one CPU 'auto' is 1, the same as the default")
def test_posttrain_run_trains_on_every_core_unless_told(tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    env = cli_env(home)
    env.pop("POSTTRAIN_TORCH_THREADS", None)
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert trainer_threads(home) == CPUS

    told = tmp_path / "told" / ".posttrain"
    told.parent.mkdir()
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], told.parent,
                         cli_env(told, POSTTRAIN_TORCH_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert trainer_threads(told) == 1
