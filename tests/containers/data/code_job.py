"""Run inside a posttrain image: code-domain jobs through the bwrap sandbox, strict and warm,
the task's reference solution and a wrong one, 20 rounds each; prints JSON with what the
verifier said, the isolation achieved and how many processes are left in the container.
Used by tests/containers/test_images.py (mounted into the container, run by the venv's python)."""

import json
import os
import random
from types import SimpleNamespace

from components.core.recipe import SandboxConfig
from components.domains.code import Code
from components.sandbox.executor import get_executor

ROUNDS = 20
WRONG = "x*0-1"

domain = Code()
task = domain.make_task(random.Random(7), "train")
right = domain.reference_completion(task)
report = {}
for mode in ("strict", "warm"):
    config = SimpleNamespace(**SandboxConfig(backend="bwrap", mode=mode, concurrency=1).model_dump())
    seen = {}
    with get_executor(config) as executor:
        for _ in range(ROUNDS):
            for name, completion in (("right", right), ("wrong", WRONG)):
                result = executor.run(domain.execution_plan(task, completion))
                verdict = domain.verify(task, completion, result)
                seen.setdefault(name, set()).add((result.status, verdict.passed, result.isolation))
    report[mode] = {name: [list(v) for v in sorted(values)] for name, values in seen.items()}
report["processes_left"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
print(json.dumps(report))
