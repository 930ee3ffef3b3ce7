"""The ``hf`` engine: sampling with transformers' ``model.generate`` (the CPU default).

It records the log-probability of every sampled token under the sampling distribution
(``log_softmax(logits / temperature)``), which is what the trainer's importance ratio
needs. Prompts are sorted by token length and batched in that order ("length buckets"),
so short prompts never wait behind long ones and padding stays small; results come back
in the caller's order. ``HFEngine(bucket=False)`` batches in the caller's order instead
(the baseline of ``benchmarks/rollout/bench.py``).

Not covered: top-k/top-p truncation (the recorded logprobs would then need the truncated
distribution), and stop strings other than the EOS token.
"""

from __future__ import annotations

from components.rollout.engines import Engine, Generation


class HFEngine(Engine):
    name = "hf"

    def __init__(self, bucket: bool = True) -> None:
        self.bucket = bucket  # batch prompts by token length (True) or in the caller's order

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        import torch

        encoded = [policy.encode_prompt(p) for p in prompts]
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
                torch.manual_seed(seed + b)
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
                    comp = toks[:stop]
                    text_ids = comp[:-1] if comp and comp[-1] == eos else comp
                    results[i] = Generation(
                        prompt_ids=encoded[i], completion_ids=comp, logprobs=[float(x) for x in logp[row, :stop]],
                        text=policy.tokenizer.decode(text_ids, skip_special_tokens=True),
                        finish_reason="stop" if comp and comp[-1] == eos else "length",
                    )
                if progress:
                    progress(len(idx))
        return results  # type: ignore[return-value]
