"""The trainer benchmark's multi-process rows: the same global batches through
``components.trainer.distributed.train`` with 1 and with 2 processes, trained tokens per second.

``bench.py`` calls ``measure`` in the same run as its other rows, with the steps its
``posttrain`` run of the first seed took (the samples of every step that had signal, as
``grpo_step`` got them), from the same warm-start checkpoint and settings (lr, clip 0.2,
no KL, token mean, one micro-batch per step, device cpu). Each width is launched as the
trainer stage launches it (``train``: torchrun, one torch thread per worker, gloo), so a
launch's wall time includes starting the workers, loading the checkpoint, and writing the
consolidated checkpoint and optimizer state.

Two rates per width:

- end to end: trained tokens of the long run over its wall time (launch to checkpoint);
- steady: the long run (the recorded steps ``epochs`` times over) minus a short run of its
  first step, both launched the same way: (tokens long - tokens short) / (seconds long -
  seconds short), so the start-up and save costs, equal in both, cancel.

Widths are launched in turn, the order reversed on every other repeat, and the median
seconds of the repeats are used. The final weights of each width are compared with the
1-process run's (largest absolute difference): the same global batch gives the same
update at any width, so this should be float noise.

Not covered: GPUs (nccl), more than 2 processes, and machines whose cores are busy with
other work: on a shared 2-core machine a second process competes with that load, which
the load average recorded beside the rows shows.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

WIDTHS = ((1, "ddp"), (2, "ddp"), (2, "fsdp"))


def _launch(folder: Path, batches: list, cfg, seed: int) -> tuple[float, int, dict]:
    """(wall seconds, trained tokens, final weights) of one ``train`` call."""
    from components.core.policy import load_policy
    from components.trainer.distributed import train

    policy = load_policy(str(folder))
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-procs-") as tmp:
        started = time.perf_counter()
        trained = train(policy, batches, cfg, temperature=1.0, seed=seed, iteration=1, workdir=Path(tmp))
        wall = time.perf_counter() - started
        return wall, sum(s.tokens for s in trained.stats), trained.state_dict()


def measure(folder: Path, steps: list[list], lr: float, seed: int, *, epochs: int, repeats: int,
            widths=WIDTHS, steady: bool = True) -> dict:
    """The rows for ``steps`` (one list of samples per optimizer step, empty steps dropped)
    at each of ``widths`` ((processes, parallelism) pairs, the first the baseline)."""
    from components.core.recipe import TrainerConfig

    steps = [s for s in steps if s]
    long_batches = steps * epochs
    base = TrainerConfig(learning_rate=lr, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0, loss_aggregation="token_mean",
                         micro_batch_size=max(len(s) for s in steps), device="cpu")
    walls: dict[tuple, dict[str, list[float]]] = {w: {"long": [], "short": []} for w in widths}
    tokens: dict[tuple, dict[str, int]] = {w: {} for w in widths}
    weights: dict[tuple, dict] = {}
    loads = [os.getloadavg()[0]]
    for rep in range(repeats):
        for width in (widths if rep % 2 == 0 else widths[::-1]):
            cfg = base.model_copy(update={"processes": width[0], "parallelism": width[1]})
            for kind, batches in (("long", long_batches), ("short", steps[:1])) if steady else (("long", long_batches),):
                wall, n, final = _launch(folder, batches, cfg, seed)
                walls[width][kind].append(wall)
                tokens[width][kind] = n
                if kind == "long":
                    weights[width] = final
                print(f"processes | {width[0]} x {width[1]} | {kind} ({len(batches)} steps) | {wall:.1f} s | "
                      f"{n} trained tokens", flush=True)
            loads.append(os.getloadavg()[0])
    reference = weights[widths[0]]
    rows = []
    for width in widths:
        long_s = statistics.median(walls[width]["long"])
        row = {"processes": width[0], "parallelism": width[1], "steps": len(long_batches),
               "tokens": tokens[width]["long"], "long_s": long_s, "long_s_all": walls[width]["long"],
               "end_to_end_tokens_per_s": tokens[width]["long"] / long_s,
               "max_abs_weight_diff_vs_first": max(float((weights[width][k] - v).abs().max()) for k, v in reference.items())}
        if steady:
            short_s = statistics.median(walls[width]["short"])
            extra = long_s - short_s
            row.update(short_s=short_s, short_s_all=walls[width]["short"], short_tokens=tokens[width]["short"],
                       steady_tokens_per_s=(tokens[width]["long"] - tokens[width]["short"]) / extra if extra > 0 else None)
        rows.append(row)
    first = rows[0]
    for row in rows:
        row["end_to_end_vs_first"] = row["end_to_end_tokens_per_s"] / first["end_to_end_tokens_per_s"]
        if steady and row["steady_tokens_per_s"] and first["steady_tokens_per_s"]:
            row["steady_vs_first"] = row["steady_tokens_per_s"] / first["steady_tokens_per_s"]
    return {"cpus": os.cpu_count(), "epochs": epochs, "repeats": repeats, "recorded_steps": len(steps), "global_batch_samples":
            [len(s) for s in steps], "micro_batch_size": base.micro_batch_size, "rows": rows,
            "load_1min_range": [round(min(loads), 2), round(max(loads), 2)]}


def ratio_line(result: dict) -> str:
    """The line ``bench.py`` prints: 2 processes (DDP) against 1 on the same global batches."""
    first, two = result["rows"][0], next(r for r in result["rows"] if r["processes"] == 2 and r["parallelism"] == "ddp")
    steady = (f"{two['steady_vs_first']:.2f}x steady ({two['steady_tokens_per_s']:.0f} vs "
              f"{first['steady_tokens_per_s']:.0f} trained tokens/s)" if "steady_vs_first" in two else "steady not measured")
    return (f"processes: 2 (DDP) / 1 on the same global batches = {steady}, {two['end_to_end_vs_first']:.2f}x end to end "
            f"({two['end_to_end_tokens_per_s']:.0f} vs {first['end_to_end_tokens_per_s']:.0f} trained tokens/s, launch "
            f"to checkpoint) | weights differ by at most {two['max_abs_weight_diff_vs_first']:.1e}")


def markdown(result: dict) -> str:
    """The results.md section."""
    steady = "steady_tokens_per_s" in result["rows"][0]
    head = ("| processes | parallelism | steps | trained tokens | launch to checkpoint s (median) | tokens/s end to end "
            "| vs 1 process |" + (" short run s (1 step) | tokens/s steady | vs 1 process |" if steady else "")
            + " max abs weight difference vs 1 process |\n|---:|---|---:|---:|---:|---:|---:|"
            + ("---:|---:|---:|" if steady else "") + "---:|\n")

    def cells(r: dict) -> str:
        out = (f"| {r['processes']} | {r['parallelism']} | {r['steps']} | {r['tokens']:,} | {r['long_s']:.1f} | "
               f"{r['end_to_end_tokens_per_s']:.0f} | {r['end_to_end_vs_first']:.2f}x |")
        if steady:
            rate = f"{r['steady_tokens_per_s']:.0f}" if r["steady_tokens_per_s"] else "n/a"
            out += f" {r['short_s']:.1f} | {rate} | " + (f"{r['steady_vs_first']:.2f}x |" if "steady_vs_first" in r else "n/a |")
        return out + f" {r['max_abs_weight_diff_vs_first']:.1e} |\n"

    return ("## Processes\n\n"
            f"The first seed's {result['recorded_steps']} posttrain steps (the samples `grpo_step` got, "
            f"{min(result['global_batch_samples'])}-{max(result['global_batch_samples'])} per step), "
            f"{result['epochs']} time(s) over, through `components.trainer.distributed.train` (torchrun, gloo, one torch "
            f"thread per worker, one micro-batch of up to {result['micro_batch_size']} sequences per process) from the "
            f"same warm-start checkpoint, at each width; median of {result['repeats']} launch(es) each, the order "
            f"reversed every other repeat; {result['cpus']} CPUs, 1-minute load average {result['load_1min_range'][0]:.2f}-"
            f"{result['load_1min_range'][1]:.2f} (a second process competes with that load for the same cores). "
            "A launch's seconds include starting the workers, loading the "
            "checkpoint and writing the consolidated checkpoint and optimizer state."
            + (" The steady rate subtracts a launch of the first step alone: (tokens long - tokens short) / "
               "(seconds long - seconds short)." if steady else "") + "\n\n" + head
            + "".join(cells(r) for r in result["rows"])
            + "\nEach launch's seconds: " + "; ".join(
                f"{r['processes']} x {r['parallelism']}: long {', '.join(f'{x:.1f}' for x in r['long_s_all'])}"
                + (f", short {', '.join(f'{x:.1f}' for x in r['short_s_all'])}" if "short_s_all" in r else "")
                for r in result["rows"]) + ".\n\n" + ratio_line(result) + ".\n")
