"""The ``hf`` engine: sampling from a transformers causal LM on the CPU (the default engine).

It records the log-probability of every sampled token under the sampling distribution
(``log_softmax(logits / temperature)``), which is what the trainer's importance ratio
needs. Prompts are sorted by token length and batched in that order ("length buckets"),
so short prompts never wait behind long ones and padding stays small; results come back
in the caller's order. ``HFEngine(bucket=False)`` batches in the caller's order instead.

Prefix sharing (the default): ``generate_groups`` prefills each distinct prompt once and
repeats its keys and values G times in the batch dimension, so a batch holds
``batch_size // G`` prompts (at least one) times G rows. On the demo's prompts the G-fold
prefill was about 70% of the previous path's time (cProfile).

Decoding is a short loop over the model's forward rather than ``model.generate``, for
what ``generate`` cannot do: continue from a cache that already holds the whole prompt
(it needs at least one uncached token, so the loop takes the first token's logits from
the prefill itself), and drop rows that stopped on EOS from the batch and the cache
(once a quarter of the rows stopped, since each drop copies the cache), where
``generate`` computes every row until the last one stops. The cache is transformers'
``StaticCache``: the default ``DynamicCache`` concatenates, i.e. copies itself, at every
step (about 8% of the time on the demo's prompts, measured side by side; more under
memory contention and for longer completions). It starts with room for the prompt and
``CACHE_BLOCK`` (256) new tokens and doubles (one copy) when full, up to prompt plus
``max_new_tokens``: a cache for the whole completion up front reserved
rows x (prompt + max_new_tokens) positions however early the rows stopped (about 51 GB,
calculated, for one ``posttrain serve`` request of 64 prompts near a 32k context of
Qwen2.5-0.5B in fp32), and each step attended over all of them. The tokens are the same
either way, the logprobs up to float rounding (a cache of another length sums the
attention in another order: within 1e-6 on the tests' policy, bit-identical while
``max_new_tokens`` <= 256; ``tests/rollout/test_cache_growth.py``). Greedy decoding (G = 1) goes through the same
loop: argmax of the logits of the forward passes ``generate`` makes, up to float
rounding from the masked cache.

``workers`` > 1 (``rollout.workers``) spreads the batches over that many processes
(``forked.forked_map``): each batch is seeded by its index (``sub_seed(seed, "batch", b)``,
a hash, so batches of nearby seeds never share a stream), so the samples are the
same as with one process; only the wall time changes. Only with one torch thread
(``POSTTRAIN_TORCH_THREADS=1``, the default outside ``posttrain run``): a fork of a
multi-threaded OpenMP pool can hang, so with more threads the batches stay in this
process. On the demo (2 cores) one process on two threads sampled faster than two
forked one-thread workers (rollout 10.0 s against 12.0 s per iteration), so
``posttrain run`` (every core, see ``settings.torch_threads``) leaves ``workers`` at 1;
it is for a process pinned to one torch thread with spare cores.

``HFEngine(prefix_sharing=False)`` is the previous path, kept as the baseline of
``benchmarks/rollout/bench.py`` and of the equivalence tests: ``model.generate`` on G
copies of each prompt.

Not covered: top-k/top-p truncation (the recorded logprobs would then need the truncated
distribution), stop strings other than the EOS token, models whose layers are not plain
full attention (sliding-window or linear-attention layers), and sharing the prefix in
memory: after the repeat each of the G rows holds its own copy of the prompt's keys and
values, and decoding attends over each copy. Nor a per-row length budget: a batch's new
tokens are capped by its widest prompt against the model's positions, so a prompt near
the limit shortens its batch-mates' completions (length bucketing keeps such prompts
together), and a prompt at or past the limit is not refused: it gets one token. (A
multi-turn episode whose prompt leaves no room for an action gets none, and the
data-quality gate then stops the iteration.)
"""

from __future__ import annotations

from components.core.progress import say
from components.rollout.engines import Engine, Generation, check_encoded, sub_seed
from components.rollout.forked import forked_map


class HFEngine(Engine):
    name = "hf"

    def __init__(self, bucket: bool = True, prefix_sharing: bool = True, workers: int = 1) -> None:
        self.bucket = bucket  # batch prompts by token length (True) or in the caller's order
        self.prefix_sharing = prefix_sharing  # one prefill per prompt + lean loop (True) or model.generate on copies
        self.workers = workers  # processes sampling batches side by side (prefix-shared path; forked_map)

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        if self.prefix_sharing:
            return self.generate_groups(policy, prompts, 1, max_new_tokens, temperature, seed, batch_size, greedy, progress)
        return self._generate_copies(policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress)

    def generate_groups(self, policy, prompts, group_size, max_new_tokens, temperature, seed, batch_size, greedy=False,
                        progress=None):
        if not self.prefix_sharing:
            return super().generate_groups(policy, prompts, group_size, max_new_tokens, temperature, seed, batch_size,
                                           greedy, progress)
        import torch

        encoded = [policy.encode_prompt(p) for p in prompts]
        check_encoded(prompts, encoded)
        order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), i)) if self.bucket else list(range(len(prompts)))
        per_batch = max(1, batch_size // group_size)  # prompts per batch; a group is never split
        limit = getattr(policy.model.config, "max_position_embeddings", 10**9)
        batches = [order[start:start + per_batch] for start in range(0, len(order), per_batch)]

        def sample_batch(b: int) -> list[tuple[list[int], list[float]]]:
            idx = batches[b]
            width = max(len(encoded[i]) for i in idx)
            # a batch's samples depend on its index, not on the process that runs it; hashed, so
            # the batches of two nearby seeds (episode turns, task batches, requests) never share a stream
            torch.manual_seed(sub_seed(seed, "batch", b))
            with torch.inference_mode():
                return self._sample(policy, [encoded[i] for i in idx], group_size,
                                    max(1, min(max_new_tokens, limit - width)), temperature, greedy)

        # A forked child of a process whose OpenMP pool has more than one thread can hang in
        # its first parallel region: spread batches only when torch runs one thread (the default).
        workers = self.workers if torch.get_num_threads() == 1 else 1
        if workers < self.workers:
            say(f"rollout.workers={self.workers} ignored: torch runs {torch.get_num_threads()} threads "
                "(POSTTRAIN_TORCH_THREADS); forked sampling needs 1, so batches stay in this process")
        sampled = forked_map(sample_batch, len(batches), workers,
                             done=(lambda b: progress(len(batches[b]) * group_size)) if progress else None)
        results: list[Generation | None] = [None] * (len(prompts) * group_size)
        for idx, rows in zip(batches, sampled, strict=True):
            for k, (comp, logprobs) in enumerate(rows):
                i, g = idx[k // group_size], k % group_size
                results[i * group_size + g] = _generation(policy, encoded[i], comp, logprobs)
        return results  # type: ignore[return-value]

    @staticmethod
    def _sample(policy, prompts: list[list[int]], group: int, new_tokens: int, temperature: float,
                greedy: bool) -> list[tuple[list[int], list[float]]]:
        """(completion ids, logprobs) for ``group`` samples of each prompt, grouped per prompt."""
        import torch

        model, eos, pad = policy.model, policy.eos_id, policy.pad_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() sets them
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float().repeat_interleave(group, 0)
        # The prompt's keys and values, G rows per prompt, in a static cache with room for
        # CACHE_BLOCK new tokens, doubled (copied) when full, up to the whole completion: a
        # DynamicCache would concatenate, i.e. copy itself, at every step, and a cache for the
        # whole completion up front reserves rows x (prompt + max_new_tokens) positions however
        # early the rows stop (GBs for one serve request of 64 prompts near the context).
        full = width + new_tokens
        length = width + min(new_tokens, CACHE_BLOCK)
        cache = static_cache(model, [(layer.keys.repeat_interleave(group, 0), layer.values.repeat_interleave(group, 0))
                                     for layer in out.past_key_values.layers], length)
        mask = torch.cat([mask, mask.new_ones((len(prompts), new_tokens))], dim=1).repeat_interleave(group, 0)
        rows = logits.shape[0]
        live = torch.arange(rows)  # original row of each row still in the batch
        done = torch.zeros(rows, dtype=torch.bool)  # rows in the batch that already stopped
        next_pos = mask[:, :width].sum(-1)
        tokens = torch.full((rows, new_tokens), pad, dtype=torch.long)
        logps = torch.zeros((rows, new_tokens))
        lengths = torch.full((rows,), new_tokens, dtype=torch.long)  # tokens past a row's length are ignored
        for step in range(new_tokens):
            logp = torch.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
            tok = logits.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1).squeeze(1)
            tokens[live, step] = tok
            logps[live, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            stopped = (tok == eos) & ~done
            if bool(stopped.any()):
                lengths[live[stopped]] = step + 1
                done |= stopped
                if bool(done.all()):
                    break
                if 4 * int(done.sum()) >= len(done):  # dropping rows copies the cache: only when a quarter stopped
                    keep = (~done).nonzero().squeeze(1)
                    cache = static_cache(model, [(layer.keys[keep, :, :width + step], layer.values[keep, :, :width + step])
                                                 for layer in cache.layers], length)
                    live, tok, mask, next_pos, done = live[keep], tok[keep], mask[keep], next_pos[keep], done[keep]
            if step + 1 == new_tokens:
                break
            if width + step >= length:  # full: this step writes position width + step
                length = min(full, 2 * length)
                cache = static_cache(model, [(layer.keys[:, :, :width + step], layer.values[:, :, :width + step])
                                             for layer in cache.layers], length)
            out = model(input_ids=tok.unsqueeze(1), attention_mask=mask[:, :length], position_ids=next_pos.unsqueeze(1),
                        past_key_values=cache, cache_position=torch.tensor([width + step]), use_cache=True)
            logits, next_pos = out.logits[:, -1].float(), next_pos + 1
        return [(tokens[r, :n].tolist(), logps[r, :n].tolist()) for r, n in enumerate(lengths.tolist())]

    def _generate_copies(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress):
        """The previous path: ``model.generate`` on the prompts as given (G copies for a group)."""
        import torch

        encoded = [policy.encode_prompt(p) for p in prompts]
        check_encoded(prompts, encoded)
        order = list(range(len(prompts)))
        if self.bucket:
            order.sort(key=lambda i: (len(encoded[i]), i))
        results: list[Generation | None] = [None] * len(prompts)
        model, eos, pad = policy.model, policy.eos_id, policy.pad_id
        limit = getattr(model.config, "max_position_embeddings", 10**9)
        with torch.inference_mode():
            for b, start in enumerate(range(0, len(order), batch_size)):
                idx = order[start:start + batch_size]
                width = max(len(encoded[i]) for i in idx)
                new_tokens = max(1, min(max_new_tokens, limit - width))
                input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):
                    ids = encoded[i]
                    input_ids[row, width - len(ids):] = torch.tensor(ids)
                    mask[row, width - len(ids):] = 1
                torch.manual_seed(sub_seed(seed, "batch", b))
                kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                out = model.generate(
                    input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad,
                    eos_token_id=eos, output_logits=True, return_dict_in_generate=True, **kwargs,
                )
                gen = out.sequences[:, width:]
                logits = torch.stack(out.logits, dim=1).float()  # (batch, steps, vocab), unprocessed
                scale = 1.0 if greedy else temperature
                logp = torch.log_softmax(logits / scale, dim=-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
                for row, i in enumerate(idx):
                    toks = gen[row].tolist()
                    stop = toks.index(eos) + 1 if eos in toks else len(toks)
                    results[i] = _generation(policy, encoded[i], toks[:stop], [float(x) for x in logp[row, :stop]])
                if progress:
                    progress(len(idx))
        return results  # type: ignore[return-value]


CACHE_BLOCK = 256
"""New tokens a prefix-shared batch's KV cache has room for at first; it doubles when full."""


def static_cache(model, layers, max_len: int):
    """A transformers ``StaticCache`` of ``max_len`` positions holding ``layers`` ((keys, values)
    per layer, batch first) at its first positions."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return cache


def _generation(policy, prompt_ids: list[int], comp: list[int], logprobs: list[float]) -> Generation:
    stopped = bool(comp) and comp[-1] == policy.eos_id
    return Generation(
        prompt_ids=prompt_ids, completion_ids=comp, logprobs=logprobs,
        text=policy.tokenizer.decode(comp[:-1] if stopped else comp, skip_special_tokens=True),
        finish_reason="stop" if stopped else "length",
    )
