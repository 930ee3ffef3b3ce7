"""Terminal: a shell command line, judged by the filesystem state it leaves behind.

The prompt states a goal in a few words and ends at a shell prompt (``"new dir a\\n$ "``);
the completion is one bash command line (``"mkdir a"``). Some tasks start from files
that already exist (listed in the prompt, laid out before the command runs).
Difficulty 1 creates one thing; difficulty 2 changes existing files (delete, rename,
write text); difficulty 3 is multi-step: one command per line (``"mkdir a\n>a/b"``).

Execution (``DRIVER``): a trusted Python driver lays out the start state in ``ws/``,
makes itself non-dumpable, forks, and in the child closes the result fd and runs
``bash -c <completion>`` in ``ws/`` in its own process group under a wall-clock limit.
After the child exits (or is killed with its group) the driver walks ``ws/`` without
following links and without opening anything but regular files (a FIFO would block it)
and writes ``{"state": {path: "dir" | "file:<text>" | "link" | "other"}}`` to the
executor's result pipe. So the command cannot forge the state listing: it never holds
the result fd, it has exited before the listing is taken, and the expected state never
enters the sandbox. Killing the driver only loses the result (score 0).

Verifier: the listed state is compared with the expected one outside the sandbox. Score
= paths whose state matches / paths in either state; a pass needs the states equal.
An ``infra_error`` job is excluded, a job with no result (killed driver, timeout) is 0.

Trap tasks (``metadata["trap"] = True``): deletions where another file must survive
(``"del x.log\\n(has x.log y.txt)\\n$ "``): the shortcut ``rm *`` that passes the ordinary
deletion tasks (one file only) removes too much and fails.

Multi-step tasks (``metadata["multi_step"]``, difficulty 3) run in a sandbox session
(``SessionJob``, ``components/sandbox/session.py``): each completion line (at most
``MAX_STEPS``) is its own command in ``ws/`` under the job limits, the work folder
persists between them, and a lister written after the last step reports the state; the
host adds every step's exit code (component ``exit_ok`` needs all of them 0). The policy
writes all steps in one completion; it does not see a step's output before the next
(episodes that do are the interactive tasks below). Not covered: permissions, file modes, symlink targets,
processes left running, or anything outside the work folder.

Interactive tasks (``metadata["interactive"]``, difficulty 3, from ``make_interactive_task``:
``INTERACTIVE_SHARE`` of ``terminal``'s difficulty-3 tasks, the rest being the blind
multi-step ones; ``TerminalInteractive``, domain name ``terminal-interactive``, draws only
these, for a recipe that wants them weighted and reported apart): the goal names a file only by what it holds,
so the policy must read an observation before it can act. ``pick``: "del the file that
says ok" among three files; ``note``: "new dir named in n", where file ``n`` holds the
name. Neither prompt shows what it hides, so one prompt is many tasks: they are marked
``metadata["hidden_reference"]`` (``base.HIDDEN_REFERENCE``), their ids digest the reference
too, and a train task may share an eval task's prompt, never its reference.
``interactive(task)`` declares the session: the start files under ``ws/``, each action run
in ``ws/`` (``ACTION_PREFIX`` makes it: a task file's task may have no start files), at most
``MAX_STEPS`` actions, and ``LISTER`` as the final check. Not covered: an episode with no
command and no start files leaves no ``ws/`` to list (score 0, even for an empty expected state).
The completion the sandbox replays is the episode's commands, one per line
(``Interactive.replay``: a fresh session from the same start, then the lister), judged
by the same state comparison as every terminal task. The reference
(``reference["episode"]``) is a correct episode, ``[[action, observation], ...]`` ending
in ``["DONE", ""]``, each observation formatted by ``observation_text`` as the episode
runner formats it (outputs here are far shorter than any ``rollout.observation_chars``).
Start states of interactive tasks hold files only (no empty directories).

A task file's reference is checked as it loads (``task_problem``): every path is relative,
without ``.``, ``..``, empty parts or control characters, each part a valid file name; a
start or expected state holds at most ``MAX_STATE_PATHS`` paths (the listing stops at
``MAX_ENTRIES``); a start state holds only ``dir`` and ``file:`` entries, none inside a
file, and no ``dir`` in a multi-step or interactive task (its session lays out files only;
a start file's folders need not be listed: they are made for it); every folder above an
expected path is listed as ``dir`` (the listing reports each one); an expected file's text
is at most ``LISTED_BYTES`` bytes (the listing reads one byte more, so a file longer than
the text never matches it); each entry's text is at most ``MAX_REFERENCE_CHARS``
characters; ``metadata.multi_step`` and ``metadata.interactive``, when present, are JSON
booleans. ``start`` may be left out (an empty work folder).
"""

from __future__ import annotations

import json
import random

from components.core.jobs import PYTHON, RESULT_FD, Job, Outcome, SessionJob
from components.core.records import Task
from components.domains.base import (
    DONE,
    HIDDEN_REFERENCE,
    MAX_REFERENCE_CHARS,
    MAX_REFERENCE_ITEMS,
    Domain,
    Interactive,
    Verdict,
    has_control_character,
    is_text,
    make_task,
    malformed,
    observation_text,
)

NAMES = "abcdefghjkmnpqrstuvwxyz"
WORDS = ("hi", "ok", "yes", "no", "up", "go", "on", "red", "sun", "top")
COMMAND_TIMEOUT_S = 2.0
MAX_ENTRIES = 64  # a listing longer than this is cut
MAX_STATE_PATHS = MAX_ENTRIES - 1  # most paths of a start or expected state: a cut listing (64) never equals one
LISTED_BYTES = 64  # the longest expected file text; the listing reads one byte more, so a longer file differs

# Lists ws/ without following links: {path: "dir" | "file:<first 65 bytes>" | "link" | "other"}.
_LIST_STATE = r"""
def list_state():
    state, ok = {}, True
    if os.path.islink("ws") or not os.path.isdir("ws"):
        return False, state
    for root, dirs, files in os.walk("ws", followlinks=False):
        for name in sorted(dirs) + sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, "ws")
            if os.path.islink(full):
                state[rel] = "link"
            elif os.path.isdir(full):
                state[rel] = "dir"
            elif not os.path.isfile(full):  # a FIFO, socket or device: opening one could block the listing
                state[rel] = "other"
            else:
                try:
                    with open(full, "rb") as fh:
                        state[rel] = "file:" + fh.read(LISTED + 1).decode("utf-8", "replace")
                except OSError:
                    state[rel] = "unreadable"
            if len(state) >= MAX:
                return ok, state
    return ok, state
""".replace("MAX", str(MAX_ENTRIES)).replace("LISTED", str(LISTED_BYTES))

DRIVER = r"""
import json, os, select, signal, sys

RESULT_FD = int(sys.argv[1])
TIMEOUT = float(sys.argv[2])
with open("cmd.txt", newline="") as fh:  # a "\r" stays in the command, as the session paths keep it
    CMD = fh.read()
with open("start.json") as fh:
    START = json.load(fh)
os.mkdir("ws")
for path, kind in sorted(START.items()):
    full = os.path.join("ws", path)
    if kind == "dir":
        os.makedirs(full, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(full) or "ws", exist_ok=True)
        with open(full, "w") as fh:
            fh.write(kind[len("file:"):])
import ctypes
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
    raise SystemExit("driver: cannot make itself non-dumpable")
sys.stdout.flush()
sys.stderr.flush()
pid = os.fork()
if pid == 0:
    # ---- untrusted territory: the command never holds RESULT_FD ----
    os.close(RESULT_FD)
    os.setpgid(0, 0)
    os.chdir("ws")
    os.execvp("bash", ["bash", "-c", CMD])
# ---- trusted parent: woken when the command exits (a pidfd), not on a polling tick ----
pidfd = os.pidfd_open(pid)
timed_out = not select.select([pidfd], [], [], TIMEOUT)[0]
if timed_out:
    os.killpg(pid, signal.SIGKILL)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os.close(pidfd)
try:
    os.killpg(pid, signal.SIGKILL)  # stragglers the command left in its group
except ProcessLookupError:
    pass
""" + _LIST_STATE + r"""
ok, state = list_state()
os.write(RESULT_FD, json.dumps({"ok": ok, "exit": code, "timed_out": timed_out, "state": state}).encode())
os.close(RESULT_FD)
"""

# The check of a multi-step task: runs after the steps, in the same session, from a file
# written just before it runs.
LISTER = "import json, os, sys\n" + _LIST_STATE + r"""
ok, state = list_state()
os.write(int(sys.argv[1]), json.dumps({"ok": ok, "exit": 0, "timed_out": False, "state": state}).encode())
"""
MAX_STEPS = 3
# Each step of a multi-step task runs in ws/ (made by the first step: d3 tasks start empty).
STEP_PREFIX = "mkdir -p ws && cd ws || exit 97\n"
# Each action of an interactive task runs in ws/ (laid out with the start files; made by
# the first action when there are none: a task file's task may leave ``start`` out).
ACTION_PREFIX = "mkdir -p ws && cd ws || exit 97\n"
REFERENCE_OBSERVATION_CHARS = 256  # the recipe's default rollout.observation_chars
INTERACTIVE_SHARE = 0.5  # of terminal's difficulty-3 tasks: multi-turn episodes (the rest: blind multi-step)


def _two(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


def _shown(start: dict[str, str]) -> str:
    return "(has " + " ".join(sorted(start)) + ")\n" if start else ""


def path_problem(path: object) -> str | None:
    """Why ``path`` cannot name an entry of the work folder (None when it can): a
    relative path of at most 256 characters whose parts are not empty, ``.`` or ``..``,
    hold no control characters (NUL included) and fit a file name (255 bytes)."""
    if not is_text(path, 256) or not path:
        return "must be a relative path of 1 to 256 characters"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "must be a relative path inside the work folder (no leading '/', no '.', '..' or '//')"
    if has_control_character(path):
        return "must hold no control characters (NUL, newline, tab, ...)"
    if any(len(part.encode()) > 255 for part in parts):
        return "has a part longer than a file name can be (255 bytes)"
    return None


class Terminal(Domain):
    name = "terminal"

    def make_task(self, rng: random.Random, split: str) -> Task:
        difficulty = rng.choice((1, 2, 3))
        a, b = _two(rng)
        start: dict[str, str] = {}
        trap = False
        if difficulty == 1:
            kind = rng.choice(("dir", "file", "deep"))
            if kind == "dir":
                goal, solution, expected = f"new dir {a}", f"mkdir {a}", {a: "dir"}
            elif kind == "file":
                goal, solution, expected = f"new file {a}", f"touch {a}", {a: "file:"}
            else:
                goal, solution, expected = f"new dir {a}/{b}", f"mkdir -p {a}/{b}", {a: "dir", f"{a}/{b}": "dir"}
        elif difficulty == 2:
            kind = rng.choice(("del", "mv", "write"))
            if kind == "del":
                start = {f"{a}.log": "file:"}
                trap = rng.random() < 0.5
                if trap:
                    start[f"{b}.txt"] = "file:"
                goal, solution = f"del {a}.log", f"rm {a}.log"
                expected = {k: v for k, v in start.items() if k != f"{a}.log"}
            elif kind == "mv":
                start = {a: "file:"}
                goal, solution, expected = f"rename {a} {b}", f"mv {a} {b}", {b: "file:"}
            else:
                word = rng.choice(WORDS)
                goal, solution, expected = f"{a} says {word}", f"echo {word}>{a}", {a: f"file:{word}\n"}
        elif rng.random() < INTERACTIVE_SHARE:
            return self.make_interactive_task(rng, split)
        else:
            goal, solution = f"new dir {a}, then file {b} in it", f"mkdir {a}\n>{a}/{b}"
            expected = {a: "dir", f"{a}/{b}": "file:"}
        prompt = f"{goal}\n{_shown(start)}$ "
        reference = {"solution": solution, "start": start, "expected": expected}
        return make_task(self.name, split, difficulty, prompt, reference, trap=trap, multi_step=difficulty == 3)

    def make_interactive_task(self, rng: random.Random, split: str) -> Task:
        """One interactive task: its goal needs what a command shows (see the module docstring)."""
        kind = rng.choice(("pick", "note"))
        if kind == "pick":
            names = sorted(rng.sample(NAMES, 3))
            target = rng.choice(names)
            others = [w for w in WORDS if w != "ok"]
            start = {n: "file:" + ("ok" if n == target else rng.choice(others)) + "\n" for n in names}
            goal = "del the file that says ok"
            steps = [("grep -l ok *", f"{target}\n"), (f"rm {target}", "")]
            expected = {k: v for k, v in start.items() if k != target}
        else:
            note, name = _two(rng)
            start = {note: f"file:{name}\n"}
            goal = f"new dir named in {note}"
            steps = [(f"cat {note}", f"{name}\n"), (f"mkdir {name}", "")]
            expected = {**start, name: "dir"}
        episode = [[action, observation_text(0, "ok", out, REFERENCE_OBSERVATION_CHARS)] for action, out in steps]
        reference = {"solution": "\n".join(a for a, _ in steps), "start": start, "expected": expected,
                     "episode": episode + [[DONE, ""]]}
        return make_task(self.name, split, 3, f"{goal}\n{_shown(start)}$ ", reference, trap=False, multi_step=False,
                         interactive=True, kind=kind, **{HIDDEN_REFERENCE: True})

    def interactive(self, task: Task) -> Interactive | None:
        if not task.metadata.get("interactive"):
            return None
        start = task.reference.get("start", {})
        return Interactive(
            files={f"ws/{path}": kind[len("file:"):] for path, kind in start.items() if kind.startswith("file:")},
            check=Job(job_id=task.task_id, files={"lister.py": LISTER}, argv=[PYTHON, "-I", "-S", "lister.py", RESULT_FD]),
            max_turns=MAX_STEPS, step_prefix=ACTION_PREFIX, step_timeout_s=COMMAND_TIMEOUT_S,
        )

    def reference_completion(self, task: Task) -> str:
        return task.reference["solution"]

    def execution_plan(self, task: Task, completion: str) -> Job | SessionJob | None:
        if (spec := self.interactive(task)) is not None:
            return spec.replay(task.task_id, completion)
        if task.metadata.get("multi_step"):
            steps = [line for line in completion.split("\n") if line.strip()][:MAX_STEPS] or [""]
            start = task.reference.get("start", {})
            return SessionJob(
                job_id=task.task_id,
                files={f"ws/{path}": kind[len("file:"):] for path, kind in start.items() if kind.startswith("file:")},
                steps=[STEP_PREFIX + step for step in steps],
                check=Job(job_id=task.task_id, files={"lister.py": LISTER},
                          argv=[PYTHON, "-I", "-S", "lister.py", RESULT_FD]),
                step_timeout_s=COMMAND_TIMEOUT_S,
            )
        command = completion.split("\n", 1)[0]
        return Job(
            job_id=task.task_id,
            files={"driver.py": DRIVER, "cmd.txt": command, "start.json": json.dumps(task.reference.get("start", {}))},
            argv=[PYTHON, "-I", "-S", "driver.py", RESULT_FD, str(COMMAND_TIMEOUT_S)],
        )

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        for name in ("start", "expected"):
            state = reference.get(name, {} if name == "start" else None)
            if not isinstance(state, dict) or len(state) > MAX_STATE_PATHS:
                return name, (f"must be an object of at most {MAX_STATE_PATHS} paths: {{path: 'dir' | 'file:<text>'}} "
                              f"(the state listing stops at {MAX_ENTRIES} entries)")
            for path, kind in state.items():
                if (why := path_problem(path)) is not None:
                    return f"{name}[{path!r:.40}]", why
                if isinstance(kind, str) and len(kind) > MAX_REFERENCE_CHARS:  # not a wrong kind: a long text
                    return (f"{name}[{path!r:.40}]", f"is {len(kind):,} characters, more than {MAX_REFERENCE_CHARS:,} "
                            "(the longest text a reference holds)")
                if name == "start" and not (is_text(kind) and (kind == "dir" or kind.startswith("file:"))):
                    return f"{name}[{path!r:.40}]", "must be 'dir' or 'file:<text>' (a start state cannot hold a link)"
                if not is_text(kind) or not (kind == "dir" or kind == "link" or kind.startswith("file:")):
                    return f"{name}[{path!r:.40}]", "must be 'dir', 'link' or 'file:<text>'"
                if name == "expected" and kind.startswith("file:") and len(kind[5:].encode()) > LISTED_BYTES:
                    return (f"{name}[{path!r:.40}]", f"file text must be at most {LISTED_BYTES} bytes (the state "
                            f"listing reads {LISTED_BYTES + 1} bytes of each file, so a longer text never matches)")
            for path in state:
                parent = path.rpartition("/")[0]
                while parent:
                    if name == "expected" and parent not in state:
                        return (f"{name}[{path!r:.40}]", f"lies inside {parent!r:.40}, which is not listed: the state "
                                f"listing reports every folder, so add {parent!r:.40}: 'dir'")
                    if state.get(parent, "dir") != "dir":
                        return (f"{name}[{path!r:.40}]", f"lies inside {parent!r}, which is {state[parent]!r:.40}, "
                                "not 'dir'")
                    parent = parent.rpartition("/")[0]
        episode = reference.get("episode", [])
        if not isinstance(episode, list) or len(episode) > MAX_REFERENCE_ITEMS or not all(
                isinstance(turn, list) and len(turn) == 2 and all(is_text(x) for x in turn) for turn in episode):
            return "episode", "must be a list of [action, observation] pairs of text"
        return None

    def task_problem(self, reference: dict, metadata: dict) -> tuple[str, str] | None:
        for key in ("multi_step", "interactive"):  # read as flags: a string "no" would turn the mode on
            if key in metadata and not isinstance(metadata[key], bool):
                return f"metadata.{key}", ("must be true or false without quotes (a JSON boolean: the string 'no' "
                                           "would turn the mode on)")
        if (problem := self.reference_problem(reference)) is not None:
            return problem
        if metadata.get("multi_step") or metadata.get("interactive"):
            for path, kind in reference.get("start", {}).items():
                if kind == "dir":
                    return (f"start[{path!r:.40}]", "must be 'file:<text>' in a multi-step or interactive task (its "
                            "session lays out files only; a file inside gives a folder)")
        return None

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        if result is None or result.status == "infra_error":
            return Verdict(0.0, False, status="infra_error", detail="sandbox did not run the command")
        expected: dict[str, str] = task.reference["expected"]
        payload = result.result if isinstance(result.result, dict) else {}
        state = payload.get("state") if payload.get("ok") is True else None
        if not isinstance(state, dict):
            return Verdict(0.0, False, components={"ran": 0.0, "state_match": 0.0, "exit_ok": 0.0},
                           detail=f"no state listing ({result.status})")
        paths = set(expected) | set(state)
        same = sum(state.get(p) == expected.get(p) for p in paths)
        score = same / len(paths) if paths else 1.0
        steps = payload.get("steps")  # added by the host after a multi-step session
        exits = ([s.get("exit") if isinstance(s, dict) else None for s in steps] if isinstance(steps, list)
                 else [payload.get("exit")])
        components = {"ran": 1.0, "state_match": score, "exit_ok": float(all(e == 0 for e in exits))}
        if isinstance(steps, list):
            components["steps"] = float(len(steps))
        return Verdict(
            score=score,
            passed=state == expected,
            components=components,
            detail=result.status,
        )


class TerminalInteractive(Terminal):
    """The terminal domain's interactive tasks only (``make_interactive_task``), under their
    own domain name, so they are weighted, rewarded and reported apart from one-shot
    terminal tasks."""

    name = "terminal-interactive"

    def make_task(self, rng: random.Random, split: str) -> Task:
        return self.make_interactive_task(rng, split)
