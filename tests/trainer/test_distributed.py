"""The trainer under torchrun (``components/trainer/distributed.py``), 2 processes on gloo:
the same 3 steps as one in-process run on the same global batch give the same parameters
and statistics, with DDP and with FSDP2; the consolidated checkpoint loads with
``load_policy`` and greedy-decodes like the 1-process checkpoint; its trainer state is the
1-process optimizer state; bad widths and dead workers are one clear error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from components.core.errors import InfraError, UserError
from components.core.policy import load_policy, pad_batch, save_policy, token_logprobs
from components.core.recipe import TrainerConfig
from components.core.seeds import seed_everything
from components.core.storage import Store
from components.rollout.hf_engine import HFEngine
from components.trainer.distributed import _launch, split_step, train
from components.trainer.grpo import Sample, grpo_step
from components.trainer.state import build_optimizer, build_scheduler, read_trainer_state
from tests.rollout.helpers import PROMPTS, tiny_policy

CFG = TrainerConfig(learning_rate=1e-3, micro_batch_size=3, kl_coef=0.05, lr_schedule="linear", warmup_steps=1,
                    decay_steps=4, max_grad_norm=0.5, device="cpu", processes=2)
SEED, TEMPERATURE, STEPS, PER_STEP = 5, 1.0, 3, 10


def make_batches(policy) -> list[list[Sample]]:
    """3 steps of 10 samples: random prompts and completions of mixed lengths, old logprobs
    the policy's own plus noise (some ratios clip), advantages of both signs."""
    rng = random.Random(0)
    batches = []
    for _ in range(STEPS):
        batch = []
        for _ in range(PER_STEP):
            prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 12))]
            completion = [rng.randrange(4, 60) for _ in range(rng.randrange(1, 14))]
            ids, attn, _ = pad_batch([(prompt, completion)], 0)
            with torch.no_grad():
                logp, _ = token_logprobs(policy.model, ids, attn)
            old = [float(x) + rng.gauss(0, 0.2) for x in logp[0, len(prompt) - 1:]]
            batch.append(Sample(prompt, completion, old, rng.uniform(-1, 1)))
        batches.append(batch)
    return batches


def one_process(cfg: TrainerConfig = CFG, batches: list[list[Sample]] | None = None):
    """The same steps (``make_batches`` unless given) in this process, the trainer stage's in-process path."""
    policy = tiny_policy()
    optimizer = build_optimizer(policy.model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    seed_everything(SEED)
    stats = [grpo_step(policy.model, optimizer, b, pad_id=policy.pad_id, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                       temperature=TEMPERATURE, micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                       loss_aggregation=cfg.loss_aggregation, scheduler=scheduler, packing=cfg.packing)
             for b in (batches or make_batches(tiny_policy()))]
    return policy, optimizer, stats


@pytest.fixture(scope="module")
def reference():
    return one_process()


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two(request, tmp_path_factory):
    cfg = CFG.model_copy(update={"parallelism": request.param})
    policy = tiny_policy()
    return request.param, train(policy, make_batches(policy), cfg, temperature=TEMPERATURE, seed=SEED, iteration=1,
                                workdir=tmp_path_factory.mktemp(request.param))


def test_two_processes_give_the_one_process_parameters(reference, two) -> None:
    policy, _, stats = reference
    kind, trained = two
    weights = trained.state_dict()
    start = tiny_policy().model.state_dict()
    expected = policy.model.state_dict()
    assert set(weights) == set(expected) - {"lm_head.weight"}  # tied to the embedding: saved once
    for name, value in weights.items():
        assert not torch.equal(value, start[name]), name  # it trained
        assert torch.allclose(value, expected[name], atol=1e-5, rtol=0), (kind, name, (value - expected[name]).abs().max())
    assert len(trained.stats) == STEPS
    for got, want in zip(trained.stats, stats):
        assert got.tokens == want.tokens and got.lr == pytest.approx(want.lr)
        for key in ("loss", "clip_frac", "kl", "entropy", "grad_norm"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-4, abs=1e-6), (kind, key)
    assert any(s.clip_frac > 0 for s in stats) and all(s.grad_norm > CFG.max_grad_norm for s in stats)  # clipping at work
    assert trained.parameters == sum(p.numel() for p in policy.model.parameters())


def test_the_trainer_state_is_the_full_one_process_optimizer_state(reference, two) -> None:
    _, optimizer, _ = reference
    kind, trained = two
    state = read_trainer_state(trained.trainer_state.read_bytes(), "test")
    expected = optimizer.state_dict()
    assert state["position"] == {"iteration": 1, "steps_done": STEPS, "global_step": STEPS}
    assert state["scheduler"]["last_epoch"] == STEPS
    saved = state["optimizer"]
    assert sorted(saved["state"]) == sorted(expected["state"]) == list(range(len(expected["state"])))
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    for index, moments in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(saved["state"][index][key], moments[key], atol=1e-6, rtol=1e-3), (kind, index, key)
        assert float(saved["state"][index]["step"]) == STEPS


def test_the_consolidated_checkpoint_decodes_like_the_one_process_one(reference, two, tmp_path) -> None:
    policy, _, _ = reference
    kind, trained = two
    store = Store(str(tmp_path), "test")
    save_policy(policy.model, policy.tokenizer, store, "one")
    one = load_policy(store.url("one"))
    many = load_policy(str(trained.checkpoint))
    engine = HFEngine()
    a = engine.generate(one, PROMPTS, max_new_tokens=12, temperature=1.0, seed=0, batch_size=8, greedy=True)
    b = engine.generate(many, PROMPTS, max_new_tokens=12, temperature=1.0, seed=0, batch_size=8, greedy=True)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert len({tuple(s.completion_ids) for s in a}) > 1  # not one degenerate answer


def test_the_split_is_deterministic_and_balanced_by_tokens() -> None:
    s = [Sample([1] * p, [2] * c, [0.0] * c, 1.0) for p, c in ((2, 10), (2, 1), (3, 3), (1, 1), (5, 5))]  # 12, 3, 6, 2, 10
    assert split_step(s, 2) == [[0, 1, 3], [2, 4]]  # 17 and 16 tokens
    assert split_step(s, 5) == [[0], [4], [2], [1], [3]]


def test_a_step_without_samples_is_a_user_error(tmp_path) -> None:
    policy = tiny_policy()
    batches = make_batches(policy)
    with pytest.raises(UserError, match=r"^trainer step=1: has no samples, so there is nothing to train on in it"):
        train(policy, [batches[0], []], CFG, temperature=1.0, seed=0, iteration=1, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_step_with_fewer_samples_than_processes_trains(parallelism, tmp_path) -> None:
    """A step of 1 sample under 2 processes was refused (exit 2: "trainer.processes=2: is
    more than the 1 samples of the smallest step"), so a recipe that ran for k iterations
    stopped at the one whose last step kept a single trainable sample. The process without
    a sample now takes part at weight 0: the same steps as one process."""
    full, one = make_batches(tiny_policy())[:2]
    batches = [full, one[:1]]
    policy, _, stats = one_process(batches=batches)
    trained = train(tiny_policy(), batches, CFG.model_copy(update={"parallelism": parallelism}),
                    temperature=TEMPERATURE, seed=SEED, iteration=1, workdir=tmp_path)
    expected, start = policy.model.state_dict(), tiny_policy().model.state_dict()
    for name, value in trained.state_dict().items():
        assert not torch.equal(value, start[name]), name
        assert torch.allclose(value, expected[name], atol=1e-5, rtol=0), (parallelism, name)
    assert [s.tokens for s in trained.stats] == [s.tokens for s in stats]
    for got, want in zip(trained.stats, stats):
        for key in ("loss", "clip_frac", "kl", "entropy", "grad_norm"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-4, abs=1e-6), (parallelism, key)


def test_rank_0_reports_each_step_to_the_launching_process(two, tmp_path) -> None:
    """The launching process was silent until torchrun ended; it now moves its bar to the
    steps rank 0 reports done (``steps_done``)."""
    from components.trainer.distributed import PROGRESS, _advanced

    _, trained = two
    assert (trained.checkpoint.parent.parent / PROGRESS).read_text() == str(STEPS)
    moved: list[int] = []
    assert _advanced(tmp_path, 0, moved.append) == 0 and moved == []  # nothing reported yet
    (tmp_path / PROGRESS).write_text("2")
    assert _advanced(tmp_path, 0, moved.append) == 2 and _advanced(tmp_path, 2, moved.append) == 2
    (tmp_path / PROGRESS).write_text("3")
    assert _advanced(tmp_path, 2, moved.append) == 3 and moved == [2, 1]


def test_a_crashed_or_stuck_worker_is_an_infra_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{")  # fault: every worker dies reading it
    with pytest.raises(InfraError, match=r"trainer workers unreachable.*torchrun exited with 1.*JSONDecodeError"):
        _launch(tmp_path, 2, timeout_s=300)
    with pytest.raises(InfraError, match=r"no result within 0s; killed"):
        _launch(tmp_path, 2, timeout_s=0.2)


def test_lora_in_the_workers_changes_only_the_adapted_modules(tmp_path) -> None:
    """LoRA with FSDP2, bfloat16 autocast and gradient checkpointing together: the saved
    checkpoint is a plain model (adapters merged) whose attention projections moved and
    nothing else."""
    from components.core.recipe import LoraConfig

    cfg = CFG.model_copy(update={"parallelism": "fsdp", "lora": LoraConfig(rank=4), "dtype": "bfloat16",
                                 "gradient_checkpointing": True})
    policy = tiny_policy()
    trained = train(policy, make_batches(policy)[:1], cfg, temperature=TEMPERATURE, seed=SEED, iteration=1,
                    workdir=tmp_path)
    weights, start = trained.state_dict(), tiny_policy().model.state_dict()
    changed = {k for k in weights if not torch.equal(weights[k], start[k])}
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert trained.parameters == sum(p.numel() for p in policy.model.parameters())  # no adapter left in the file


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_one_process_trainer_state_carries_into_two_processes(reference, parallelism, tmp_path) -> None:
    """1 step in this process, its weights and trainer_state.pt handed to 2 processes for
    the other 2 steps: the same parameters as 3 steps in one process (the carried AdamW
    moments and schedule position load into DDP replicas and FSDP2 shards alike)."""
    from components.trainer.state import DataPosition, trainer_state_bytes

    expected = reference[0].model.state_dict()
    policy = tiny_policy()
    batches = make_batches(tiny_policy())
    optimizer = build_optimizer(policy.model, CFG)
    scheduler = build_scheduler(optimizer, CFG)
    seed_everything(SEED)
    grpo_step(policy.model, optimizer, batches[0], pad_id=policy.pad_id, clip_eps=CFG.clip_eps, kl_coef=CFG.kl_coef,
              temperature=TEMPERATURE, micro_batch_size=CFG.micro_batch_size, max_grad_norm=CFG.max_grad_norm,
              scheduler=scheduler)
    carried = trainer_state_bytes(optimizer.state_dict(), scheduler.state_dict(), DataPosition(1, 1, 1))
    trained = train(policy, batches[1:], CFG.model_copy(update={"parallelism": parallelism}), temperature=TEMPERATURE,
                    seed=SEED, iteration=2, workdir=tmp_path, carried=carried)
    assert [s.lr for s in trained.stats] == pytest.approx([s.lr for s in reference[2][1:]])
    for name, value in trained.state_dict().items():
        assert torch.allclose(value, expected[name], atol=1e-5, rtol=0), (parallelism, name)
    state = read_trainer_state(trained.trainer_state.read_bytes(), "test")
    assert state["position"] == {"iteration": 2, "steps_done": STEPS - 1, "global_step": STEPS}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp_in_bfloat16_on_cuda_follows_the_cpu_steps(reference, tmp_path) -> None:
    """The GPU path of the trainer stage: torchrun with nccl, FSDP2, bf16 autocast, on as
    many GPUs as are visible (one is enough); close to the float32 CPU steps."""
    processes = min(2, torch.cuda.device_count())
    cfg = CFG.model_copy(update={"device": "cuda", "dtype": "bfloat16", "parallelism": "fsdp", "processes": processes})
    policy = tiny_policy()
    trained = train(policy, make_batches(policy), cfg, temperature=TEMPERATURE, seed=SEED, iteration=1, workdir=tmp_path)
    expected = reference[0].model.state_dict()
    start = tiny_policy().model.state_dict()
    weights = trained.state_dict()
    assert all(w.dtype == torch.float32 for w in weights.values())
    moved = torch.cat([(weights[k] - start[k]).flatten() for k in sorted(weights)])
    moved_on_cpu = torch.cat([(expected[k] - start[k]).flatten() for k in sorted(weights)])
    assert torch.nn.functional.cosine_similarity(moved, moved_on_cpu, dim=0) > 0.9  # the same update, up to bf16
    for got, want in zip(trained.stats, reference[2]):
        assert got.loss == pytest.approx(want.loss, abs=0.02)


def test_a_reused_workdir_carries_no_earlier_runs_trainer_state(tmp_path, monkeypatch) -> None:
    """The workers load ``trainer_state.pt`` whenever it is there: a workdir a carried run
    used before made the next run without a carried state resume that run's AdamW moments
    and schedule position (global_step 3 and a decayed learning rate instead of 1)."""
    from components.trainer import distributed

    seen: list[bool] = []

    class Launched(Exception):
        pass

    def launch(workdir, *args, **kwargs):
        seen.append((Path(workdir) / "trainer_state.pt").exists())
        raise Launched

    monkeypatch.setattr(distributed, "_launch", launch)
    (tmp_path / "trainer_state.pt").write_bytes(b"an earlier run's state")
    policy = tiny_policy()
    for carried in (None, b"this run's state"):
        with pytest.raises(Launched):
            train(policy, make_batches(policy)[:1], CFG, temperature=TEMPERATURE, seed=SEED, iteration=1,
                  workdir=tmp_path, carried=carried)
    assert seen == [False, True] and (tmp_path / "trainer_state.pt").read_bytes() == b"this run's state"
