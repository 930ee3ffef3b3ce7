"""Episodes on replay sessions see what they would see on live ones.

``play(..., replay=True)`` gives each command a reset pooled worker and re-runs the
episode's earlier commands there first (``ReplaySession``); ``replay=False`` keeps one
live sandbox session per episode. A scripted policy whose commands build on each other
(a file written, then listed, then read back; a probe, then an action on its output)
plays both ways against real bwrap sessions: every turn's action and observation, the
commands and the final verdicts are equal, and the replayed episodes start no more
sandboxes than commands run at once.
"""

from __future__ import annotations

import re

import pytest

from components.domains.base import DONE
from components.rollout import episode
from components.rollout.interactive import interactive_specs, play
from tests.domains.test_terminal_interactive import actor, cfgs, interactive_task, judged
from tests.sandbox.helpers import bwrap_unavailable

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")


def stateful(context: str) -> str:
    """Write a file, list the folder, read the file back (each depends on the one before), stop."""
    turns = len(re.findall(r"\n\[exit \d+ \w+\]\n", context))
    return ["echo $((6*7)) > made.txt", "ls", "cat made.txt; rm made.txt", DONE][min(turns, 3)]


def trace(rollouts) -> list[tuple]:
    return [(r.task_id, r.group_index, r.completion, [(t.action, t.observation, t.tool_call) for t in r.turns])
            for r in rollouts]


class CountingOpen:
    """Counts sandbox workers started by SessionPool (a real start each)."""

    def __init__(self, monkeypatch) -> None:
        from components.sandbox import session as sandbox_session

        self.started = 0
        real = sandbox_session.Worker

        def counted(*args, **kwargs):
            self.started += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(sandbox_session, "Worker", counted)


@pytest.mark.parametrize("policy", ["reads", "stateful"])
def test_replayed_episodes_see_and_end_as_live_ones(monkeypatch, policy) -> None:
    tasks = [interactive_task("pick"), interactive_task("note")]
    specs = interactive_specs(tasks)
    rollout_cfg, sandbox_cfg = cfgs(group_size=3)
    act = actor(reads=True) if policy == "reads" else stateful
    live = play(act, tasks, specs, rollout_cfg, sandbox_cfg, seed=0, iteration=1, replay=False)
    counter = CountingOpen(monkeypatch)
    replayed = play(act, tasks, specs, rollout_cfg, sandbox_cfg, seed=0, iteration=1, replay=True)
    assert trace(replayed) == trace(live)
    assert all(len(r.turns) >= 3 for r in live)  # several commands each: the replay had history to run
    if policy == "stateful":  # the file the first command wrote is there for the second and third
        assert "made.txt" in replayed[0].turns[1].observation.split("\n")
        assert replayed[0].turns[2].observation == "\n[exit 0 ok]\n42\n\n"
    assert counter.started <= sandbox_cfg.concurrency  # 6 episodes, at most 2 sandboxes
    assert [v.passed for v in judged(tasks, replayed, sandbox_cfg)] == [v.passed for v in judged(tasks, live, sandbox_cfg)]


class Scripted:
    """A session whose commands end as scripted: ``slow`` times out, ``broken`` is an infra error."""

    def __init__(self, log):
        self.log = log

    def exec(self, argv, timeout_s=None, files=None):
        from components.core.jobs import JobResult

        command = argv[-1]
        self.log.append(command)
        status = "timeout" if "slow" in command else "infra_error" if "broken" in command else "ok"
        return JobResult(status, 0, 0, command, "", 0.0, 0.0, 0.0)

    def close(self):
        self.log.append("closed")


def test_an_earlier_timeout_does_not_stop_the_replay_but_a_sandbox_failure_does() -> None:
    from components.domains.base import Interactive

    log: list[str] = []
    session = episode.ReplaySession(lambda: Scripted(log), Interactive(files={}, check=None, max_turns=4))
    assert session.exec("slow").status == "timeout"
    result = session.exec("next")  # a live session runs it after the timed-out command, and so does the replay
    assert (result.status, result.stdout) == ("ok", "next")
    assert log == ["slow", "closed", "slow", "next", "closed"] and session.history == ["slow", "next"]
    log.clear()
    session.history = ["broken"]
    assert session.exec("after").status == "infra_error"
    assert log == ["broken", "closed"] and session.history == ["broken", "after"]  # recorded, as in the completion
