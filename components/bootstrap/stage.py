"""Stage ``bootstrap`` (once per pipeline): tokenizer + base policy + SFT warm start -> v1.

With ``model.source: scratch`` it builds the character-level tokenizer and a
Llama-architecture model from ``model``, then runs supervised fine-tuning on reference
completions of the recipe's domains (one domain per step, round-robin;
``bootstrap.batch_tokens`` caps a step's padded tokens, so a long-prompt domain's steps
take fewer examples instead of costing several times more). Every ``bootstrap.eval_every`` steps it checks the
greedy pass rate on a held-out check set (train distribution, disjoint from the eval
suite) and stops as soon as the mean reaches ``target_low`` (inside ``[target_low,
target_high]``, or above it: then the overshoot rule below picks the snapshot)
(with ``bootstrap.balance_domains`` each step's domain is drawn with weight
``max(0.05, target_high - pass rate)`` from the last check, so weak domains get the steps) — SFT
accuracy jumps suddenly, so it checks often and keeps the previous snapshot when a jump
overshoots, whichever lies closer to the band. The result is saved in Hugging Face
format, scored on the fixed eval suite (its facts record the settings it was scored under,
``evalsuite.suite.eval_settings``, for promotion to compare like for like), registered as a version of
``<pipeline>-policy`` and aliased ``champion`` and ``candidate``. A re-run (after its
``bootstrap``, ``evaluation``, ``rollout`` or ``sandbox`` section, the domains or the code
version changed) moves no alias while the champion's line (``models.lineage_root``)
started from a bootstrap of the same ``model`` section (tag ``posttrain.model_digest``):
the nightly line goes on from the champion. Another ``model`` section starts a new line:
both aliases move to the new version, and its line says which version was champion.

With any other ``model.source`` (a Hugging Face folder, a store URI, or a registry URI
``models:/<name>@<alias>`` / ``models:/<name>/<version>``) it skips SFT and
registers that model as it is. Deterministic from the recipe seed; a second call is a
cache hit, unless the source holds other files now (``source_fingerprint``: new weights
in the folder, an alias moved to another version, another version of a GGUF package).

Interactive tasks (``Domain.interactive``) with a reference episode
(``reference["episode"]``) are learnt from that episode: actions and their EOS are
trained on, the observations between them are context only (mask 0 in the loss), as the
trainer treats an episode's observation tokens (``components.evalsuite.episodes``).

SFT prompts are encoded in ``rollout.prompt_format`` (``components.core.prompts``), as
rollout and evaluation put them to the policy; the scratch tokenizer has no chat
template, so ``auto`` is ``raw`` there and ``chat`` is a UserError. Not covered:
LoRA/PEFT warm starts and multi-GPU SFT.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections import Counter
from pathlib import Path

from components.core import gguf, models
from components.core.checkpoint import LOADED_FOLDERS
from components.core.context import StageContext
from components.core.errors import InfraError, outage
from components.core.facts import Scored
from components.core.manifest import WEIGHTS, InputRef
from components.core.policy import (
    EOS,
    TRAINER_STATE,
    Policy,
    build_model,
    build_tokenizer,
    load_policy,
    pad_batch,
    save_policy,
    token_logprobs,
)
from components.core.progress import say
from components.core.records import Task
from components.core.seeds import seed_everything
from components.core.storage import Store, normalize_uri, sha256_bytes
from components.domains import registry
from components.domains.base import exclusion
from components.evalsuite.decision import record_decision, unpaired
from components.evalsuite.episodes import episode_example
from components.evalsuite.score import eval_tags, evaluate_and_log
from components.evalsuite.suite import eval_settings, eval_tasks, pass_rates, run_suite
from components.sandbox.executor import get_executor

SECTIONS = ("model", "bootstrap", "evaluation", "rollout", "sandbox")
"""Recipe sections read: the model and SFT settings, and what scoring on the eval suite needs."""


FIELD = "model.source"


def inputs(ctx: StageContext) -> None:
    """Bootstrap depends on its config and, for a pretrained ``model.source``, on what the
    source holds now (input ``model_source``, ``source_fingerprint``): other weights behind
    the same source re-run it. A scratch model depends on its config alone."""
    source = ctx.recipe.model.source
    if source != "scratch":
        ctx.inputs["model_source"] = source_fingerprint(source)


def source_fingerprint(source: str) -> InputRef:
    """What ``model.source`` points at now, without reading any weights:

    - a folder or file (a path, ``file://``, ``s3://``): the files a load copies (those at
      its top and in ``checkpoint.LOADED_FOLDERS``, not ``trainer_state.pt``), each by its
      relative name and size, and its ``mtime_ns`` on a local disk or ETag in a store;
    - ``models:/<name>@<alias>`` or ``models:/<name>/<version>``: the version it resolves
      to now and the weights digest that version was registered with;
    - ``gguf:<package>/<file>.gguf``: the version of the distribution holding the package
      (the file's ``mtime_ns`` for a package no distribution declares) and the file's size.

    A source that is not there (nothing at the path, no such version, package or file)
    fingerprints as such, or raises the load's own UserError, so bootstrap refuses it as
    it always did; an unreachable store or tracking server is an outage."""
    if gguf.is_gguf(source):
        path = gguf.locate(source, FIELD)  # a missing package or file: the UserError the load raises
        return InputRef(uri=path.as_uri(), digest=_gguf_digest(source, path))
    if source.startswith("models:/"):
        mv = models.registry_version(source, FIELD)  # a missing version or alias: the UserError the load raises
        weights = dict(mv.tags).get(models.TAG_WEIGHTS, "")
        return InputRef(uri=models.checkpoint_of(mv), digest=f"version:{mv.version} weights:{weights}")
    uri = normalize_uri(source, FIELD)
    return InputRef(uri=uri, digest=_listing_digest(uri))


def _gguf_digest(source: str, path: Path) -> str:
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    package = source[len(gguf.PREFIX):].partition("/")[0]
    found = []
    for dist in sorted(set(packages_distributions().get(package, []))):
        try:
            found.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            continue
    stat = path.stat()
    return f"{', '.join(found) or f'mtime_ns {stat.st_mtime_ns}'}; size {stat.st_size}"


def _listing_digest(uri: str) -> str:
    """sha256 of the (name, size, mtime_ns or ETag) of each file a load of ``uri`` copies;
    that of an empty list when nothing is there (the load then refuses it)."""
    store = Store(uri, FIELD)
    base = store.root.rstrip("/")
    local = uri.startswith("file://")
    try:
        found = store.fs.find(base, detail=True)
        rows = []
        for path, info in found.items():
            name = path[len(base) + 1:]
            folder = name.rpartition("/")[0]
            if name == TRAINER_STATE or (folder and folder not in LOADED_FOLDERS):
                continue  # what the load does not copy (policy.load_policy)
            if local:
                stat = os.stat(path)
                rows.append((name, stat.st_size, stat.st_mtime_ns))
            else:
                rows.append((name, int(info.get("size") or 0), str(info.get("ETag", info.get("LastModified", "")))))
    except Exception as exc:  # noqa: BLE001 - unreadable now: the load says why, as it always did
        if isinstance(exc, InfraError) or outage(exc) is not None:
            raise
        return f"unreadable ({type(exc).__name__})"
    return sha256_bytes(json.dumps(sorted(rows)).encode())


Example = tuple[list[int], list[int], list[int]]
"""(prompt ids, completion ids, loss mask per completion token: 1 trained on, 0 context)."""


def _examples(policy: Policy, tasks: list[Task]) -> list[Example]:
    out = []
    for t in tasks:
        domain = registry.get(t.domain)
        if domain.interactive(t) is not None and t.reference.get("episode"):
            ids, mask = episode_example(policy, t.reference["episode"])
        else:
            completion = domain.reference_completion(t)
            ids = list(policy.tokenizer(completion, add_special_tokens=False)["input_ids"]) + [EOS]
            mask = [1] * len(ids)
        out.append((policy.encode_prompt(t.prompt), ids, mask))
    return out


def sft_batch(policy: Policy, examples: list[Example]):
    """(ids, attention, loss mask) of a padded batch: the completion positions, with each
    example's mask-0 tokens (an episode's observations) switched off."""
    import torch

    ids, attn, mask = pad_batch([(p, c) for p, c, _ in examples], policy.pad_id)
    for row, (prompt, _, keep) in enumerate(examples):
        start = len(prompt) - 1
        mask[row, start:start + len(keep)] *= torch.tensor(keep, dtype=mask.dtype)
    return ids, attn, mask


def token_budget(examples: list[Example], budget: int) -> list[Example]:
    """The first examples whose padded batch (count x longest) fits ``budget`` tokens
    (at least one); all of them when ``budget`` is 0."""
    if budget <= 0:
        return examples
    longest = 0
    for n, (prompt, completion, _) in enumerate(examples):
        longest = max(longest, len(prompt) + len(completion))
        if n and (n + 1) * longest > budget:
            return examples[:n]
    return examples


def balance_weights(pass_rates: list[float], target_high: float, floor: float = 0.05) -> list[float]:
    """SFT sampling weight per domain: how far its pass rate is below the band's top
    (at least ``floor``, so a domain above the band is still rehearsed)."""
    return [max(floor, target_high - rate) for rate in pass_rates]


def sft(ctx: StageContext, policy: Policy, executor) -> dict[str, float]:
    import torch

    cfg, recipe = ctx.recipe.bootstrap, ctx.recipe
    exclude = exclusion(eval_tasks(recipe))
    rng = random.Random(ctx.seed("sft-data"))
    check = [t for name in recipe.domains for t in registry.get(name).train_tasks(random.Random(ctx.seed("check", name)),
                                                                                   cfg.eval_tasks_per_domain, exclude)]
    exclude |= exclusion(check)
    domains = [registry.get(n) for n in recipe.domains]
    model = policy.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.01)
    prev: tuple[float, dict] | None = None
    mean, step = 0.0, 0
    weights = [1.0] * len(domains)
    for step in range(1, cfg.max_steps + 1):
        # One domain per step: prompts of one domain have similar lengths, so little padding.
        if cfg.balance_domains:
            domain = rng.choices(domains, weights=weights)[0]
        else:
            domain = domains[(step - 1) % len(domains)]
        tasks = [domain.draw(rng, "train", exclude) for _ in range(cfg.batch_size)]
        ids, attn, mask = sft_batch(policy, token_budget(_examples(policy, tasks), cfg.batch_tokens))
        model.train()
        logp, _ = token_logprobs(model, ids, attn)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % cfg.eval_every and step != cfg.max_steps:
            continue
        model.eval()
        rates = pass_rates(run_suite(policy, check, recipe, executor, label="bootstrap check"))
        mean = sum(rates.values()) / len(rates)
        # Spend the next steps where the policy is furthest below the band's top, so no
        # domain is left at zero (no GRPO signal) while others saturate.
        weights = balance_weights([rates[d.name] for d in domains], cfg.target_high)
        say(f"bootstrap | step {step} | loss {loss.item():.3f} | " + " ".join(f"{d} {v:.2f}" for d, v in rates.items())
            + f" | mean {mean:.2f}")
        if mean >= cfg.target_low:
            if mean > cfg.target_high and prev is not None and (cfg.target_low - prev[0]) < (mean - cfg.target_high):
                model.load_state_dict(prev[1])
                mean = prev[0]
                say(f"bootstrap | overshot the band; keeping the previous snapshot (mean {mean:.2f})")
            break
        prev = (mean, copy.deepcopy(model.state_dict()))
    model.eval()
    return {"sft_steps": float(step), "sft_check_mean": mean}


MODEL_TAG = "posttrain.model_digest"
"""Tag of a bootstrap's registry version: the digest of the recipe's ``model`` section it was made from."""


def _same_model(ctx: StageContext, champion: str, version: str) -> bool:
    """Whether the champion is a trained policy (not a bootstrap itself, whose checkpoint this
    run may just have re-written) whose line started from this bootstrap's version, or from
    a bootstrap of the same ``model`` section (its ``MODEL_TAG``); a version registered
    before the tag existed counts only by the first rule."""
    root = models.lineage_root(ctx.pipeline, champion)
    if root == champion:
        return False
    if root == version:
        return True
    tags = models.version_tags(ctx.pipeline, root)
    return tags.get(MODEL_TAG, "") == ctx.recipe.whole.digest(("model",))


def run(ctx: StageContext) -> dict[str, float]:
    recipe = ctx.recipe
    seed_everything(ctx.seed())
    metrics: dict[str, float] = {}
    if recipe.model.source == "scratch":
        tokenizer = build_tokenizer()
        policy = Policy(model=build_model(recipe.model, len(tokenizer)), tokenizer=tokenizer, uri="", version="1",
                        prompt_format=recipe.rollout.prompt_format)
        with get_executor(recipe.sandbox) as executor:
            metrics.update(sft(ctx, policy, executor))
    else:
        policy = load_policy(models.resolve_model_uri(recipe.model.source, "model.source"), "1", field="model.source",
                             prompt_format=recipe.rollout.prompt_format)
    metrics["parameters"] = float(sum(p.numel() for p in policy.model.parameters()))
    rel = f"{ctx.prefix}/checkpoint"
    digests = save_policy(policy.model, policy.tokenizer, ctx.store, rel)
    ctx.add_checkpoint(rel, rows=int(metrics["parameters"]), digests=digests)
    uri = ctx.store.url(rel)
    version = models.register_checkpoint(ctx.pipeline, uri, ctx.mlflow_run_id,
                                           {"posttrain.iteration": "0", "posttrain.run_root": ctx.store.uri,
                                            MODEL_TAG: ctx.recipe.whole.digest(("model",))},
                                           run_root=ctx.store.uri, max_new_tokens=recipe.evaluation.max_new_tokens,
                                           prompt_format=recipe.rollout.prompt_format,
                                           weights_sha256=digests.get(WEIGHTS, ""))
    policy.version = version
    results, rates, worst = evaluate_and_log(ctx, policy)
    models.set_version_tags(ctx.pipeline, version, eval_tags(rates))
    record_decision(ctx.pipeline, version, promoted=True, reason="bootstrap: the first policy",
                    rows=unpaired(rates, {}, Counter(r.domain for r in results)), run_id=ctx.mlflow_run_id,
                    checkpoint_uri=uri)
    scores = "bootstrap | eval suite | " + " ".join(f"{d} {v:.3f}" for d, v in rates.items())
    champion = models.resolve_alias(ctx.pipeline, "champion")
    if champion is not None and champion[0] != version and _same_model(ctx, champion[0], version):
        # A re-run (another SFT, domain, rollout, evaluation or sandbox setting; a new code
        # version) of the same model: the champion trained from it stays, and so does its line.
        say(f"{scores} | registered version {version}; champion stays version {champion[0]}, trained from the "
            "same model")
    else:
        models.set_alias(ctx.pipeline, "champion", version, run_root=ctx.store.uri)
        models.set_alias(ctx.pipeline, "candidate", version, run_root=ctx.store.uri)
        moved = f" (was version {champion[0]}, trained from another model)" if champion and champion[0] != version else ""
        say(f"{scores} | registered version {version} as champion{moved}")
    ctx.facts = Scored(checkpoint_uri=uri, version=version, pass_rates=rates, weakest_slice=worst,
                       eval_settings=eval_settings(recipe))  # what evaluation's promotion checks its own against
    metrics.update({f"{d}/pass_at_1": v for d, v in rates.items()})
    return metrics
