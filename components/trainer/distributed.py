"""The trainer's optimizer steps under ``torchrun``: DDP or FSDP2 over ``trainer.processes``
processes on each node (one, or the nodes of a cluster job), saved as one consolidated
Hugging Face checkpoint.

``train(policy, batches, cfg, ...)`` is the whole of it, for the trainer stage and for
benchmarks alike (run N steps with ``cfg.processes`` processes; ``Trained.state_dict()``
gives the weights, ``Trained.stats`` the per-step ``StepStats``)::

    trained = train(policy, batches, cfg.model_copy(update={"processes": 2}), temperature=1.0,
                    seed=0, iteration=1, workdir=tmp)

It writes what the workers need into ``workdir`` (the starting checkpoint, the step
batches, the config, the carried ``trainer_state.pt`` if any) and runs
``python -m torch.distributed.run --standalone --nproc_per_node P -m
components.trainer.distributed <workdir>`` with ``OMP_NUM_THREADS=1`` per worker.

On several nodes (``node``, from the ``PET_*`` variables a PyTorchJob gives every replica;
``components/core/nodes.py``) every node runs ``train`` on the same batches and starting checkpoint, and
torchrun joins the job's static rendezvous instead (``--nnodes N --node_rank R
--master_addr A --master_port P``): N x P workers, global rank 0 on node 0. Only node 0
gets results back (``Trained``); the other nodes get ``None`` once their workers are done.
Node 0 shows the steps done (a bar, or plain lines in a log); the others, which cannot see
them, print ``trainer (node R of N, P processes) still training, <elapsed>`` every
``progress.HEARTBEAT_WAIT_S`` (5 minutes) while they wait.
Each worker (``main``):

- joins the process group (gloo on CPU, nccl on CUDA, one GPU per local rank), loads the
  starting checkpoint, adds LoRA adapters (``trainer.lora``, before wrapping), and wraps
  the ``grpo.Scorer`` around it in DDP, or in FSDP2 (``fully_shard`` on every decoder
  layer, then on the root) per ``trainer.parallelism``;
- takes its share of every step (``split_step``: deterministic, balanced by tokens) and
  runs ``grpo.grpo_step`` with a ``StepPart``: token weights come from the whole step,
  gradients are summed over the processes, clipping uses the global norm, so a P-process
  step equals the 1-process step on the same global batch
  (``tests/trainer/test_distributed.py``);
- at the end, rank 0 writes the consolidated checkpoint (the full state dict gathered to
  CPU, adapters merged: a plain HF safetensors folder that ``load_policy`` and every
  engine load as is), ``trainer_state.pt`` (the full, unsharded AdamW state keyed by
  parameter index, as a 1-process run writes it, so a later run of any width carries
  it) and the per-step statistics.

Failures come back as one error: a worker's ``UserError`` is re-raised as it is; a crashed
worker, a collective that timed out or no result within ``timeout_s`` is an
``InfraError`` with the worker's last error line, or, for a worker that a signal ended
without an error of its own (the OOM killer's SIGKILL), ``rank R killed by SIGKILL``
rather than the connection errors of its peers. A step with no samples, or CUDA asked
for on a machine without enough GPUs, is a UserError before anything starts; a step with
fewer samples than processes trains, the processes without a sample of it taking part
at weight 0.

No worker outlives the call: torchrun runs in a process group of its own and gets
SIGTERM from the kernel when the launching process dies (``PR_SET_PDEATHSIG``,
``components/core/children.py``; its agent then stops the workers), each worker gets
SIGKILL when torchrun dies, and any exception out of the wait (the timeout,
``Terminated`` from SIGTERM, Ctrl-C) sends the group SIGTERM, SIGKILL after
``STOP_GRACE_S``, and reaps it before it propagates. The stage trains in
``work_folder()``, ``<tmp>/posttrain-trainer-<pid>-*``, removed on the way out; the
folders whose owner pid is dead (a SIGKILLed stage's) are swept when the next one starts.

Not covered: starting the nodes (a cluster engine does: the Kubeflow Training Operator's
PyTorchJob, ``dags/execution/pytorchjob.py``), elastic node counts, tensor or pipeline
parallelism, sharded checkpoints (always consolidated on rank 0, which must hold the
full model in CPU memory), and resuming a half-done run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from components.core.children import alive, die_with_parent, set_death_signal
from components.core.errors import InfraError, UserError
from components.core.nodes import ONE_NODE, Node
from components.core.progress import HEARTBEAT_WAIT_S, bar, heartbeat
from components.trainer.grpo import Sample, StepStats

START, OUT, CHECKPOINT, STATS = "start", "out", "checkpoint", "stats.json"
PROGRESS = "steps_done"
"""Rank 0 writes how many optimizer steps are done here after each one; the launching
process reads it into its progress bar while it waits (the workers' own output goes to
``workers.log``)."""
POLL_S = 1.0
STOP_GRACE_S = 10.0  # torchrun's time to stop its workers on SIGTERM before it gets SIGKILL
WORK_PREFIX = "posttrain-trainer-"
COLLECTIVE_TIMEOUT_S = 600  # a collective waiting longer than this on a peer fails instead of hanging


@dataclass(frozen=True)
class Trained:
    """What a run left in its workdir: the per-step stats, the consolidated checkpoint
    folder, the trainer state file beside it and the model's parameter count."""

    stats: list[StepStats]
    checkpoint: Path
    trainer_state: Path
    parameters: int

    def state_dict(self) -> dict:
        from safetensors.torch import load_file

        return load_file(self.checkpoint / "model.safetensors")


def split_step(samples: list[Sample], world: int) -> list[list[int]]:
    """Each process's sample indices of a step (in step order): longest first, each to the
    process with the fewest tokens so far (the lowest rank on a tie)."""
    load = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(samples)), key=lambda k: (-(len(samples[k].prompt_ids) + len(samples[k].completion_ids)), k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        parts[rank].append(i)
        load[rank] += len(samples[i].prompt_ids) + len(samples[i].completion_ids)
    return [sorted(p) for p in parts]


def check_launch(batches: list[list[Sample]], cfg) -> str:
    """The backend for ``cfg`` (gloo or nccl); a UserError for a step with no samples or a
    width the machine cannot serve. A step with fewer samples than processes trains: the
    processes without a sample of it take part at weight 0 (``grpo.grpo_step``)."""
    import torch

    from components.trainer.device import resolve_device

    device = resolve_device(cfg.device)
    empty = next((i for i, b in enumerate(batches) if not b), None)
    if empty is not None:
        raise UserError("trainer step", empty, "has no samples, so there is nothing to train on in it",
                        "leave steps without samples out of the batches")
    if device.type == "cuda" and cfg.processes > torch.cuda.device_count():
        raise UserError("trainer.processes", cfg.processes, f"needs one GPU per process (nccl) but "
                        f"{torch.cuda.device_count()} are visible", "set trainer.processes to at most the GPU count")
    return "nccl" if device.type == "cuda" else "gloo"


def train(policy, batches: list[list[Sample]], cfg, *, temperature: float, seed: int, iteration: int,
          workdir: Path, carried: bytes | None = None, timeout_s: float = 6 * 3600,
          node: Node = ONE_NODE) -> Trained | None:
    """Run ``batches`` (one list of samples per optimizer step) from ``policy`` with
    ``cfg.processes`` processes under torchrun, on this node of ``node.count``; ``None``
    on a node other than 0. See the module docstring."""
    backend = check_launch(batches, cfg)
    workdir = Path(workdir)
    for stale in (OUT, f"{OUT}.partial"):  # a workdir used before: only this run's results count
        shutil.rmtree(workdir / stale, ignore_errors=True)
    for stale_file in [*workdir.glob("error-*.json"), *workdir.glob("failed-*.txt"), *workdir.glob(f"{PROGRESS}*")]:
        stale_file.unlink()
    policy.model.save_pretrained(workdir / START, safe_serialization=True)
    policy.tokenizer.save_pretrained(workdir / START)
    (workdir / "batches.json").write_text(json.dumps([[asdict(s) for s in b] for b in batches]))
    (workdir / "config.json").write_text(json.dumps({
        "trainer": cfg.model_dump(), "temperature": temperature, "seed": seed, "iteration": iteration,
        "pad_id": policy.pad_id, "backend": backend}))
    (workdir / "trainer_state.pt").unlink(missing_ok=True)  # an earlier run's: the workers load whatever is there
    if carried is not None:
        (workdir / "trainer_state.pt").write_bytes(carried)
    _launch(workdir, cfg.processes, timeout_s, node, steps=len(batches) if node.leader else 0)
    if not node.leader:
        return None
    out = workdir / OUT
    result = json.loads((out / STATS).read_text())
    return Trained(stats=[StepStats(**s) for s in result["steps"]], checkpoint=out / CHECKPOINT,
                   trainer_state=out / "trainer_state.pt", parameters=int(result["parameters"]))


@contextmanager
def work_folder() -> Iterator[Path]:
    """A new work folder for one ``train``, ``<tmp>/posttrain-trainer-<pid>-<random>``
    (``pid``: this process, its owner), removed on the way out, an exception included
    (``_launch`` has stopped the workers by then). The folders of owners that died without
    removing theirs (SIGKILL, the OOM killer: a copy of the starting checkpoint and the
    results each) are swept first (``sweep_work_folders``)."""
    sweep_work_folders()
    path = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep_work_folders(root: Path | None = None) -> list[Path]:
    """Remove this user's work folders under ``root`` (the temporary folder) whose owner
    process is gone; returns them. Folders of a live owner, of another user and names
    without an owner pid are left alone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"):
        owner, sep, _ = path.name[len(WORK_PREFIX):].partition("-")
        try:
            mine = path.is_dir() and not path.is_symlink() and path.lstat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if not (sep and owner.isdigit() and int(owner) > 0 and mine) or alive(int(owner)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def launch_args(processes: int, node: Node) -> list[str]:
    """torchrun's placement arguments: a standalone rendezvous on one node, else the job's
    static one (global rank = node rank x processes + local rank)."""
    if not node.multi:
        return ["--standalone", "--nproc_per_node", str(processes)]
    return ["--nnodes", str(node.count), "--node_rank", str(node.rank), "--master_addr", node.master_addr,
            "--master_port", str(node.master_port), "--nproc_per_node", str(processes)]


def _launch(workdir: Path, processes: int, timeout_s: float, node: Node = ONE_NODE, steps: int = 0) -> None:
    """Run torchrun on ``workdir`` and wait for it. torchrun gets SIGTERM from the kernel if
    this process dies (``die_with_parent``; its agent then stops the workers, which in turn
    get SIGKILL if torchrun dies: ``main``), and any exception out of the wait (a timeout,
    ``Terminated`` from SIGTERM, Ctrl-C) stops its process group and reaps it first
    (``_stop``), so no worker outlives the call."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_TORCH_THREADS": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch_args(processes, node),
           "-m", "components.trainer.distributed", str(workdir)]
    with open(workdir / "workers.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                                start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
        try:
            deadline, shown = time.monotonic() + timeout_s, 0
            # a node other than the leader cannot see the steps done (rank 0's PROGRESS file is
            # on the leader's disk): it says it is still training every HEARTBEAT_WAIT_S instead
            with bar(f"trainer ({processes} processes)", steps) as advance, \
                    heartbeat(f"trainer (node {node.rank} of {node.count}, {processes} processes)",
                              0 if steps else HEARTBEAT_WAIT_S, "still training") as beat:
                while True:
                    try:
                        code = proc.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            raise InfraError("trainer workers", str(workdir),
                                             f"no result within {timeout_s:.0f}s; killed") from None
                    shown = _advanced(workdir, shown, advance)
                    beat()
                _advanced(workdir, shown, advance)
        except BaseException:
            _stop(proc)
            raise
    for error in sorted(workdir.glob("error-*.json")):
        raise UserError.from_json(error.read_text())
    if code != 0 or (node.leader and not (workdir / OUT / STATS).exists()):
        failed = sorted(workdir.glob("failed-*.txt"))
        why = _killed(workdir) or (failed[0].read_text() if failed else _last_error(workdir / "workers.log"))
        raise InfraError("trainer workers", str(workdir), f"torchrun exited with {code}: {why}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group (its agent stops the workers), SIGKILL after
    ``STOP_GRACE_S`` or when a second signal cuts the wait short (the workers then get
    SIGKILL as torchrun dies), and reap it."""
    try:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-\d+)")
"""A worker torchrun saw end by a signal, in the failure summary it prints (global rank, -signal)."""


def _killed(workdir: Path) -> str | None:
    """``rank R killed by SIGNAL`` for each worker that torchrun's failure summary shows ended
    by a signal without an error file of its own (the OOM killer's SIGKILL, a segfault);
    None when there is none. The survivors' errors (a peer's connection reset) are what
    followed, not the cause."""
    try:
        text = (workdir / "workers.log").read_text(errors="replace")
    except OSError:
        return None
    found = []
    for rank, code in dict(FAILURE.findall(text)).items():
        if (workdir / f"failed-{rank}.txt").exists() or (workdir / f"error-{rank}.json").exists():
            continue
        try:
            name = signal.Signals(-int(code)).name
        except ValueError:
            name = f"signal {-int(code)}"
        hint = " (out of memory? see the kernel log)" if name == "SIGKILL" else ""
        found.append(f"rank {rank} killed by {name}{hint}")
    return "; ".join(found) or None


def _advanced(workdir: Path, shown: int, advance) -> int:
    """Move the bar to the steps rank 0 reports done (``PROGRESS``); returns that count."""
    try:
        done = int((workdir / PROGRESS).read_text())
    except (OSError, ValueError):  # not written yet
        return shown
    if done > shown:
        advance(done - shown)
    return max(done, shown)


def _report_progress(workdir: Path, done: int) -> None:
    """Rank 0's count of finished steps, replaced whole (a reader never sees half a number)."""
    tmp = workdir / f"{PROGRESS}.tmp"
    tmp.write_text(str(done))
    tmp.replace(workdir / PROGRESS)


def _last_error(log: Path) -> str:
    """The last error line a worker printed (torchrun prefixes them with ``[rankN]:``), else
    the log's last line naming an error, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for pick in (lambda ln: ln.startswith("[rank") and "Error" in ln, lambda ln: "Error" in ln, lambda ln: True):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1][-300:]
    return "no output"


# ---- the worker: runs in each torchrun process ----


def _wrap(scorer, parallelism: str, device):
    import torch
    from torch.distributed.fsdp import fully_shard

    if parallelism == "fsdp":
        for layer in scorer.policy.get_decoder().layers:
            fully_shard(layer)
        fully_shard(scorer)
        return scorer
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(scorer, device_ids=ids)


def _names(scorer, parallelism: str) -> list[str]:
    """The optimizer's parameters' names as ``torch.distributed.checkpoint`` keys them."""
    prefix = "" if parallelism == "fsdp" else "module."
    return [n[len(prefix):] for n, p in scorer.named_parameters() if p.requires_grad]


def _load_optimizer(scorer, optimizer, parallelism: str):
    """How a full, index-keyed optimizer state loads into this process's optimizer."""
    if parallelism != "fsdp":
        return optimizer.load_state_dict  # DDP: a full replica, the same parameter order

    def load(state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = _names(scorer, parallelism)
        keyed = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(scorer, optimizer, keyed, options=StateDictOptions(full_state_dict=True))

    return load


def _full_optimizer_state(scorer, optimizer, parallelism: str) -> dict:
    """The full optimizer state keyed by parameter index (every rank calls it; rank 0's counts)."""
    if parallelism != "fsdp":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(scorer, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index = {n: i for i, n in enumerate(_names(scorer, parallelism))}
    return {"state": {index[n]: v for n, v in full["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}


def _run(workdir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from components.core.policy import load_policy
    from components.core.recipe import TrainerConfig
    from components.core.seeds import seed_everything
    from components.trainer.device import prepare_model, resolve_device
    from components.trainer.grpo import Scorer, StepPart, grpo_step
    from components.trainer.lora import apply_lora, merge_for_save
    from components.trainer.state import (
        DataPosition,
        build_optimizer,
        build_scheduler,
        read_trainer_state,
        restore_trainer_state,
        trainer_state_bytes,
    )

    conf = json.loads((workdir / "config.json").read_text())
    cfg = TrainerConfig.model_validate(conf["trainer"])
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(conf["backend"], timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [[Sample(**s) for s in b] for b in json.loads((workdir / "batches.json").read_text())]
    policy = load_policy(str(workdir / START))
    seed_everything(conf["seed"])
    model = prepare_model(apply_lora(policy.model, cfg.lora), device, cfg.gradient_checkpointing)
    scorer = _wrap(Scorer(model), cfg.parallelism, device)
    optimizer = build_optimizer(scorer, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    start_step = 0
    carried = workdir / "trainer_state.pt"
    if carried.exists():  # under LoRA only the schedule's position (restore_trainer_state)
        state = read_trainer_state(carried.read_bytes(), str(carried))
        start_step = restore_trainer_state(state, optimizer, scheduler, cfg, False, str(carried),
                                           _load_optimizer(scorer, optimizer, cfg.parallelism)).global_step

    def all_reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device if conf["backend"] == "nccl" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    from components.trainer.grpo import plan_micro_batches

    stats = []
    for batch in batches:
        parts = split_step(batch, world)
        passes = max(len(plan_micro_batches([batch[i] for i in p], cfg.micro_batch_size, cfg.micro_batch_tokens,
                                            cfg.packing)) for p in parts)
        part = StepPart(indices=parts[rank], world=world, micro_batches=passes, all_reduce=all_reduce)
        s = grpo_step(scorer, optimizer, batch, pad_id=conf["pad_id"], clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                      temperature=conf["temperature"], micro_batch_size=cfg.micro_batch_size,
                      max_grad_norm=cfg.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                      loss_aggregation=cfg.loss_aggregation, scheduler=scheduler, packing=cfg.packing,
                      dtype=cfg.dtype, part=part)
        stats.append(asdict(s))
        if rank == 0:
            _report_progress(workdir, len(stats))
    weights = get_model_state_dict(scorer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optim_state = _full_optimizer_state(scorer, optimizer, cfg.parallelism)
    if rank == 0:
        plain = apply_lora(load_policy(str(workdir / START)).model, cfg.lora)
        plain.load_state_dict({k.removeprefix("policy."): v for k, v in weights.items()})
        plain = merge_for_save(plain)
        out, partial = workdir / OUT, workdir / f"{OUT}.partial"  # complete files only, then renamed into place
        plain.save_pretrained(partial / CHECKPOINT, safe_serialization=True)
        policy.tokenizer.save_pretrained(partial / CHECKPOINT)
        position = DataPosition(iteration=conf["iteration"], steps_done=len(batches), global_step=start_step + len(batches))
        (partial / "trainer_state.pt").write_bytes(trainer_state_bytes(optim_state, scheduler.state_dict(), position))
        (partial / STATS).write_text(json.dumps({"steps": stats, "parameters": sum(p.numel() for p in plain.parameters())}))
        partial.rename(out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    set_death_signal(signal.SIGKILL)  # torchrun starts the workers in sessions of their own: none outlives it
    try:
        _run(workdir)
    except UserError as exc:
        rank = os.environ.get("RANK", "0")
        (workdir / f"error-{rank}.json").write_text(exc.to_json())
        return 2
    except Exception as exc:  # noqa: BLE001 - any crash: one line for the launcher's InfraError, the traceback in the log
        import traceback

        traceback.print_exc()
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        (workdir / f"failed-{os.environ.get('RANK', '0')}.txt").write_text(f"rank {os.environ.get('RANK', '0')}: "
                                                                          f"{type(exc).__name__}: {text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
