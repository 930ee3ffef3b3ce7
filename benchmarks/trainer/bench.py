"""posttrain's GRPO against TRL's ``GRPOTrainer``, side by side on the same policy.

Goal (issue): at least TRL's held-out accuracy at no more than TRL's seconds per step.

Both trainers start from the SAME warm-started policy: a small Llama-architecture model
(``ModelConfig(hidden 128, 4 layers, 4 heads, intermediate 384)``, the demo's character
tokenizer) after a short SFT on arithmetic reference completions, stopped as soon as
the greedy check accuracy enters 20-50% (cached under ``--cache``, so a re-run skips
it). Each then trains ``--steps`` optimizer steps on the same arithmetic prompts in the
same order: per step 16 prompts x 8 samples, temperature 1, no top-k/top-p, at most 8
new tokens, no KL (beta 0), clip 0.2, token-mean loss over the step (posttrain
``token_mean``; TRL ``loss_type="dapo"``), group-std-scaled advantages, one AdamW step
per batch (the same optimizer: AdamW betas (0.9, 0.99), no weight decay, constant lr,
grad-norm clip 1), one forward/backward of all 128 sequences, same seed and torch
threads. Rewards come from the arithmetic verifier for both.

- ``posttrain``: ``HFEngine`` sampling with recorded logprobs, the arithmetic verifier,
  ``group_advantages``, the trainer's group filter (groups whose advantages are all 0 are
  dropped, as ``components/trainer/stage.py`` does) and ``grpo_step``, all in process.
- ``trl``: ``trl.GRPOTrainer`` (transformers generation, ``steps_per_generation=1``,
  ``num_iterations=1``, so one generation and one optimizer step per batch).

Seconds per step are the gaps between successive step ends (generation, reward and
update included; the first step excluded as warm-up), reported as the median. Accuracy
is greedy pass@1 on a fixed held-out set of ``--eval-tasks`` arithmetic tasks (never
trained on), scored by the same code for both. Writes ``benchmarks/trainer/results.json``
and ``results.md`` (or into ``--out``).

    python benchmarks/trainer/bench.py [--steps 30] [--seeds 3] [--eval-tasks 200] [--threads 1] [--lr 1e-4]
    python benchmarks/trainer/bench.py --quick [--out DIR]

``--quick`` is a smoke run through the same code (a short SFT warm start cached apart from
the full run's, 3 RL steps, one seed, 20 held-out tasks): it prints the same ratio line and
writes no results unless ``--out`` is given.

Needs ``trl`` (``pip install -e '.[bench]'``). Known differences that remain: TRL scales
advantages by the unbiased group std (ddof 1) plus 1e-4, posttrain by the population std
plus 1e-6; TRL keeps zero-signal groups in the token-mean denominator, posttrain drops
them (so its effective step is larger when many groups are all-right or all-wrong);
posttrain records sampling logprobs during generation, TRL does not need them on-policy.
Not measured: multi-process/GPU speed, vLLM generation in either, and variance over seeds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS_PER_STEP, SAMPLES = 16, 8
MAX_NEW_TOKENS = 8


def model_config():
    from components.core.recipe import ModelConfig

    return ModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_positions=64)


def greedy_accuracy(policy, tasks) -> float:
    from components.domains import registry
    from components.rollout.hf_engine import HFEngine

    domain = registry.get("arithmetic")
    policy.model.eval()
    out = HFEngine().generate(policy, [t.prompt for t in tasks], MAX_NEW_TOKENS, 1.0, seed=0, batch_size=100, greedy=True)
    return sum(domain.verify(t, s.text, None).passed for t, s in zip(tasks, out)) / len(tasks)


def warm_start(cache: Path, seed: int, eval_ids: set[str], max_steps: int = 1500, check_every: int = 25) -> tuple[Path, dict]:
    """SFT on arithmetic reference completions until the check accuracy is in [0.2, 0.5]; cached."""
    import torch

    from components.core.policy import EOS, Policy, build_model, build_tokenizer, pad_batch, save_policy, token_logprobs
    from components.core.storage import Store
    from components.domains import registry

    cfg = model_config()
    folder = cache / f"sft-h{cfg.hidden_size}-l{cfg.num_layers}-i{cfg.intermediate_size}-s{seed}-e{len(eval_ids)}"
    if max_steps != 1500:  # a shortened warm start is cached apart from the full one
        folder = folder.with_name(f"{folder.name}-m{max_steps}")
    info_file = folder / "bench_sft.json"
    if info_file.exists():
        return folder, json.loads(info_file.read_text())
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    policy = Policy(model=build_model(cfg, len(tokenizer)), tokenizer=tokenizer, uri="memory://sft")
    domain = registry.get("arithmetic")
    rng = random.Random(seed)
    check = domain.train_tasks(random.Random(seed + 1), 100, eval_ids)
    exclude = eval_ids | {t.task_id for t in check}
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.01)
    started, acc, step = time.perf_counter(), 0.0, 0
    for step in range(1, max_steps + 1):
        tasks = [domain.draw(rng, "train", exclude) for _ in range(64)]
        examples = [(policy.encode_prompt(t.prompt),
                     list(tokenizer(domain.reference_completion(t), add_special_tokens=False)["input_ids"]) + [EOS])
                    for t in tasks]
        ids, attn, mask = pad_batch(examples, policy.pad_id)
        policy.model.train()
        logp, _ = token_logprobs(policy.model, ids, attn)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        if step % check_every == 0 or step == max_steps:
            acc = greedy_accuracy(policy, check)
            print(f"sft | step {step} | loss {loss.item():.3f} | check acc {acc:.2f}", flush=True)
            if acc >= 0.2:
                break
    info = {"sft_steps": step, "sft_check_accuracy": acc, "sft_seconds": round(time.perf_counter() - started, 1)}
    folder.mkdir(parents=True, exist_ok=True)
    save_policy(policy.model.eval(), tokenizer, Store(str(folder), "cache"), "")
    info_file.write_text(json.dumps(info))
    return folder, info


def train_tasks(seed: int, steps: int, eval_ids: set[str]):
    """``steps`` x 16 distinct train tasks (none from the eval set), in step order."""
    from components.domains import registry

    return registry.get("arithmetic").train_tasks(random.Random(seed + 2), steps * PROMPTS_PER_STEP, eval_ids)


class Cfg:  # the trainer settings both sides use (build_optimizer reads learning_rate)
    def __init__(self, lr: float) -> None:
        self.learning_rate = lr


def run_posttrain(folder: Path, tasks, steps: int, lr: float, seed: int) -> tuple[object, list[float], list[float]]:
    import torch

    from components.core.policy import load_policy
    from components.domains import registry
    from components.reward.advantages import group_advantages
    from components.rollout.hf_engine import HFEngine
    from components.trainer.grpo import Sample, grpo_step
    from components.trainer.state import build_optimizer

    policy = load_policy(str(folder))
    torch.manual_seed(seed)
    domain, engine = registry.get("arithmetic"), HFEngine()
    optimizer = build_optimizer(policy.model, Cfg(lr))
    ends, rewards = [time.perf_counter()], []
    for step in range(steps):
        batch = tasks[step * PROMPTS_PER_STEP:(step + 1) * PROMPTS_PER_STEP]
        prompts = [t.prompt for t in batch for _ in range(SAMPLES)]
        policy.model.eval()
        out = engine.generate(policy, prompts, MAX_NEW_TOKENS, 1.0, seed=seed + 1000 * step, batch_size=len(prompts))
        scores = [domain.verify(batch[i // SAMPLES], s.text, None).score for i, s in enumerate(out)]
        samples = []
        for g in range(PROMPTS_PER_STEP):
            group = scores[g * SAMPLES:(g + 1) * SAMPLES]
            adv = group_advantages(group, eps=1e-6, scale_by_std=True)
            if any(a != 0 for a in adv):
                samples += [Sample(s.prompt_ids, s.completion_ids, s.logprobs, a)
                            for s, a in zip(out[g * SAMPLES:(g + 1) * SAMPLES], adv)]
        if samples:
            grpo_step(policy.model, optimizer, samples, pad_id=policy.pad_id, clip_eps=0.2, kl_coef=0.0, temperature=1.0,
                      micro_batch_size=PROMPTS_PER_STEP * SAMPLES, max_grad_norm=1.0, loss_aggregation="token_mean")
        rewards.append(sum(scores) / len(scores))
        ends.append(time.perf_counter())
    policy.model.eval()
    return policy, [b - a for a, b in zip(ends, ends[1:])], rewards


def run_trl(folder: Path, tasks, steps: int, lr: float, seed: int, threads: int) -> tuple[object, list[float], list[float]]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.core.policy import load_policy
    from components.domains import registry
    from components.trainer.state import build_optimizer

    policy = load_policy(str(folder))
    tokenizer, model = policy.tokenizer, policy.model
    domain = registry.get("arithmetic")
    # TRL tokenises the prompt text as it is; our tokenizer adds no BOS, so spell it out.
    data = Dataset.from_dict({"prompt": [tokenizer.bos_token + t.prompt for t in tasks], "index": list(range(len(tasks)))})
    ids = tokenizer(data[0]["prompt"])["input_ids"]
    assert ids == policy.encode_prompt(tasks[0].prompt), (ids, policy.encode_prompt(tasks[0].prompt))

    calls: list[tuple[list[int], float]] = []  # (prompt indices, mean reward) per generation batch

    def arithmetic_reward(completions, index, **_):
        scores = [domain.verify(tasks[i], c, None).score for c, i in zip(completions, index)]
        calls.append((sorted(set(index)), sum(scores) / len(scores)))
        return scores

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    clock = Clock()
    out_dir = tempfile.mkdtemp(prefix="posttrain-bench-trl-")
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, learning_rate=lr, seed=seed, data_seed=seed, use_cpu=True, bf16=False,
        gradient_checkpointing=False, per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, num_generations=SAMPLES,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", max_grad_norm=1.0, shuffle_dataset=False, report_to="none",
        logging_steps=10**6, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    optimizer = build_optimizer(model, Cfg(lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, optimizers=(optimizer, scheduler), callbacks=[clock])
    torch.set_num_threads(threads)  # Trainer/accelerate setup may have changed it
    trainer.train()
    rewards = [r for _, r in calls]
    expected = [list(range(k * PROMPTS_PER_STEP, (k + 1) * PROMPTS_PER_STEP)) for k in range(steps)]
    assert [i for i, _ in calls] == expected, "TRL did not see the same prompts in the same order"
    model = trainer.model
    model.eval()
    policy.model = model
    return policy, [b - a for a, b in zip(clock.ends, clock.ends[1:])], rewards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3, help="RL runs per trainer (seeds seed..seed+n-1: prompts and sampling)")
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (1: least disturbed by other load)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "posttrain-bench-trainer"))
    ap.add_argument("--only", choices=["posttrain", "trl"], default=None, help="run one side only (debugging)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: short warm start, 3 steps, 1 seed, 20 eval tasks; writes results only with --out")
    ap.add_argument("--out", default=None, help="folder for results.json/results.md (default: beside this script; "
                    "with --quick: none written unless given)")
    args = ap.parse_args()
    sft_steps, check_every = 1500, 25
    if args.quick:
        args.steps, args.seeds, args.eval_tasks = 3, 1, 20
        sft_steps, check_every = 40, 20
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)
    if args.only != "posttrain" and importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks/trainer/bench.py needs TRL (the bench extra): pip install -e '.[bench]'")

    os.environ["POSTTRAIN_TORCH_THREADS"] = str(args.threads)
    import torch
    import transformers

    from components.core.policy import load_policy
    from components.core.seeds import configure_torch
    from components.domains import registry

    configure_torch()
    eval_set = registry.get("arithmetic").eval_set(args.eval_tasks, seed=12345)
    eval_ids = {t.task_id for t in eval_set}
    folder, sft = warm_start(Path(args.cache), args.seed, eval_ids, sft_steps, check_every)
    start_acc = greedy_accuracy(load_policy(str(folder)), eval_set)
    print(f"warm start: {sft} | held-out greedy accuracy {start_acc:.3f}", flush=True)

    names = [n for n in ("posttrain", "trl") if not args.only or n == args.only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for seed in range(args.seed, args.seed + args.seeds):
        tasks = train_tasks(seed, args.steps, eval_ids)
        # Alternate which trainer goes first, so slow drifts in the machine's load hit both alike.
        for name in names if seed % 2 == 0 else names[::-1]:
            torch.set_num_threads(args.threads)
            started = time.perf_counter()
            if name == "posttrain":
                policy, step_s, rewards = run_posttrain(folder, tasks, args.steps, args.lr, seed)
            else:
                policy, step_s, rewards = run_trl(folder, tasks, args.steps, args.lr, seed, args.threads)
            wall = time.perf_counter() - started
            acc = greedy_accuracy(policy, eval_set)
            steady = step_s[1:]
            runs[name].append({"seed": seed, "accuracy": acc, "s_per_step_median": statistics.median(steady),
                               "s_per_step_mean": statistics.mean(steady), "first_step_s": round(step_s[0], 4),
                               "step_s": [round(x, 4) for x in step_s], "train_reward": [round(r, 4) for r in rewards],
                               "wall_s": round(wall, 1)})
            print(f"seed {seed} | {name:9s} | {statistics.median(steady):.3f} s/step (median of {len(steady)}, first "
                  f"{step_s[0]:.2f} s) | held-out accuracy {start_acc:.3f} -> {acc:.3f} | mean train reward "
                  f"{statistics.mean(rewards):.3f}", flush=True)
    summary = {n: {"s_per_step": statistics.median([x for r in rs for x in r["step_s"][1:]]),
                   "accuracy_mean": statistics.mean(r["accuracy"] for r in rs),
                   "accuracies": [r["accuracy"] for r in rs],
                   "train_reward_mean": statistics.mean(x for r in rs for x in r["train_reward"])} for n, rs in runs.items()}
    for n, v in summary.items():
        print(f"{n:9s} | {v['s_per_step']:.3f} s/step (median over all seeds) | accuracy {v['accuracy_mean']:.3f} "
              f"(per seed {', '.join(f'{a:.3f}' for a in v['accuracies'])})")
    if len(runs) < 2:
        return
    p, t = summary["posttrain"], summary["trl"]
    ratio = p["s_per_step"] / t["s_per_step"]
    diff = p["accuracy_mean"] - t["accuracy_mean"]
    met = ratio <= 1.0 and diff >= 0.0
    print(f"posttrain/TRL s/step = {ratio:.2f}x (goal <= 1.0) | accuracy posttrain - TRL = {diff:+.3f} (goal >= 0) | "
          f"goal {'MET' if met else 'NOT met'}")
    cfg = model_config()
    import trl

    result = {
        "benchmark": "trainer: posttrain GRPO vs TRL GRPOTrainer", "date": dt.date.today().isoformat(),
        "model": cfg.model_dump(), "parameters": sum(x.numel() for x in load_policy(str(folder)).model.parameters()),
        "warm_start": sft, "start_accuracy": start_acc, "steps": args.steps, "seeds": list(range(args.seed, args.seed + args.seeds)),
        "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES, "max_new_tokens": MAX_NEW_TOKENS,
        "lr": args.lr, "eval_tasks": args.eval_tasks, "summary": summary, "runs": runs, "s_per_step_ratio": ratio,
        "accuracy_diff": diff, "goal": "posttrain s/step <= TRL s/step and accuracy >= TRL accuracy", "goal_met": met,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                 "threads": args.threads},
    }
    spread = max(statistics.pstdev(v["accuracies"]) for v in summary.values())
    noise = (f", but only within noise: the accuracy difference is smaller than the seed-to-seed standard deviation "
             f"({spread:.3f}), so read it as parity, not as an improvement" if abs(diff) < spread else "")
    result["accuracy_seed_std"] = spread
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    per_seed = "".join(f"| {n} | {r['seed']} | {r['s_per_step_median']:.3f} | {r['first_step_s']:.2f} | {r['accuracy']:.3f} | "
                       f"{statistics.mean(r['train_reward']):.3f} |\n" for n, rs in runs.items() for r in rs)
    (out_dir / "results.md").write_text(
        "# Trainer: posttrain GRPO vs TRL GRPOTrainer\n\n"
        f"`python benchmarks/trainer/bench.py --steps {args.steps} --seeds {args.seeds} --eval-tasks {args.eval_tasks} "
        f"--lr {args.lr} --threads {args.threads}` on {result['date']}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared with other load), {args.threads} torch thread(s), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}.\n\n"
        f"Policy: Llama-architecture, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"intermediate {cfg.intermediate_size} ({result['parameters']:,} parameters), character tokenizer, warm-started "
        f"by {sft['sft_steps']} SFT steps on arithmetic (held-out greedy accuracy {start_acc:.3f}); every run starts "
        f"from that same checkpoint. Per step: {PROMPTS_PER_STEP} prompts x {SAMPLES} samples, temperature 1, no "
        f"top-k/top-p, <= {MAX_NEW_TOKENS} new tokens, beta 0, clip 0.2, token-mean loss, one AdamW step "
        f"(lr {args.lr}, betas (0.9, 0.99)); for each seed both trainers see the same prompts in the same order.\n\n"
        f"| trainer | s/step (median, first step of each run excluded) | held-out accuracy after {args.steps} steps "
        "(mean over seeds) | per seed | mean train reward |\n|---|---:|---:|---|---:|\n"
        + "".join(f"| {n} | {v['s_per_step']:.3f} | {v['accuracy_mean']:.3f} | {', '.join(f'{a:.3f}' for a in v['accuracies'])} "
                  f"| {v['train_reward_mean']:.3f} |\n" for n, v in summary.items())
        + f"\n**posttrain s/step / TRL s/step = {ratio:.2f}x** (goal <= 1.0); **accuracy difference posttrain - TRL = "
          f"{diff:+.3f}** (goal >= 0) on {args.eval_tasks} held-out tasks. Goal {'met' if met else 'not met'}"
          f"{noise}.\n\n"
          "Per run:\n\n| trainer | seed | s/step (median) | first step s | accuracy | mean train reward |\n"
          "|---|---:|---:|---:|---:|---:|\n" + per_seed +
          "\nRemaining differences: TRL scales advantages by the unbiased group std (+1e-4), posttrain by the population "
          "std (+1e-6); TRL keeps all-zero-advantage groups in the token-mean denominator, posttrain drops those groups "
          "(as its trainer stage does); posttrain records sampling logprobs during generation.\n")


if __name__ == "__main__":
    main()
