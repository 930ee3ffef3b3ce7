"""A minimal OpenAI-compatible completions server around ``HFEngine``.

    posttrain serve --checkpoint URI --port 8000 [--host 127.0.0.1] [--model NAME] [--prompt-format raw|chat|auto]

Serves ``POST /v1/completions`` and ``GET /v1/models`` for one checkpoint (any store
URI or local folder ``load_policy`` reads). ``prompt`` may be a string, a list of
strings, a list of token ids or a list of token-id lists; each choice carries
``logprobs.tokens`` / ``logprobs.token_logprobs`` for every generated token (EOS
included when generation stopped on it), recorded exactly as ``HFEngine`` records them
(under ``softmax(logits / temperature)``). ``temperature: 0`` is greedy. With
``return_tokens_as_token_ids: true`` (vLLM's extension) tokens are ``"token_id:<id>"``.
Text prompts become token ids in ``--prompt-format`` (``components.core.prompts``):
``raw`` (the default: BOS and the text, what a completions endpoint is given), ``chat``
(the tokenizer's chat template around the text as one user turn, with the generation
prompt) or ``auto``; choose the recipe's ``rollout.prompt_format`` to serve prompts as the
pipeline puts them. Token-id prompts are used as they are. A request is generated as one ``HFEngine`` call, seeded with the request's ``seed``
(default 0), so the same request returns the same completions.

Not covered: chat completions, streaming, ``n > 1``, ``stop`` strings, top-k/top-p,
``echo``, concurrent batching of separate requests (requests run one at a time under a
lock), authentication. It is a test and development server, not a production one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from components.core.policy import Policy
from components.rollout.engines import TokenPromptPolicy
from components.rollout.hf_engine import HFEngine


def _prompts(policy: Policy, prompt: Any) -> list[list[int]]:
    """Normalise every OpenAI ``prompt`` shape to token-id lists (strings in the policy's prompt format, as rollout)."""
    if isinstance(prompt, str):
        return [policy.encode_prompt(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        return [policy.encode_prompt(p) if isinstance(p, str) else [int(x) for x in p] for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


def complete(policy: Policy, body: dict[str, Any], batch_size: int = 64, model_name: str = "") -> dict[str, Any]:
    """The ``/v1/completions`` response for ``body`` (raises ValueError on unsupported options)."""
    for key, ok in (("n", 1), ("echo", False), ("stream", False)):
        if body.get(key, ok) != ok:
            raise ValueError(f"{key}={body[key]!r} is not supported by posttrain serve (only {key}={ok!r})")
    if body.get("stop"):
        raise ValueError("'stop' strings are not supported by posttrain serve (generation stops on EOS only)")
    if float(body.get("top_p", 1.0)) != 1.0:
        raise ValueError("top_p != 1 is not supported by posttrain serve (logprobs are of the full distribution)")
    encoded = _prompts(policy, body.get("prompt"))
    temperature = float(body.get("temperature", 1.0))
    greedy = temperature == 0.0
    samples = HFEngine().generate(TokenPromptPolicy(policy), encoded, int(body.get("max_tokens", 16)),  # type: ignore[arg-type]
                                  1.0 if greedy else temperature, int(body.get("seed") or 0), batch_size, greedy=greedy)
    as_ids = bool(body.get("return_tokens_as_token_ids", False))
    tok = policy.tokenizer
    choices = []
    for index, s in enumerate(samples):
        tokens = [f"token_id:{t}" for t in s.completion_ids] if as_ids else tok.convert_ids_to_tokens(s.completion_ids)
        logprobs = None
        if body.get("logprobs") is not None:
            logprobs = {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": None,
                        "text_offset": [0] * len(tokens)}
        choices.append({"index": index, "text": s.text, "logprobs": logprobs, "finish_reason": s.finish_reason})
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    prompt_tokens = sum(len(ids) for ids in encoded)
    return {
        "id": f"cmpl-{int(time.time() * 1000)}", "object": "text_completion", "created": int(time.time()),
        "model": model_name or body.get("model", ""), "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def make_app(policy: Policy, model_name: str, batch_size: int = 64):
    """The FastAPI application serving ``policy`` under ``model_name``."""
    from fastapi import Body, FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="posttrain serve")
    lock = threading.Lock()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "posttrain"}]}

    @app.post("/v1/completions")
    def completions(body: dict[str, Any] = Body(...)):  # noqa: B008 - FastAPI's idiom
        if body.get("model") not in (None, "", model_name):
            return JSONResponse(status_code=404, content={"error": {
                "message": f"model {body.get('model')!r} is not served here; use {model_name!r}", "type": "invalid_request_error"}})
        try:
            with lock:
                return complete(policy, body, batch_size, model_name)
        except (ValueError, TypeError) as exc:
            return JSONResponse(status_code=400, content={"error": {"message": str(exc), "type": "invalid_request_error"}})

    return app


def serve(checkpoint: str, host: str, port: int, model_name: str = "", batch_size: int = 64,
          prompt_format: str = "raw") -> None:
    """Load ``checkpoint`` and serve it until interrupted, text prompts in ``prompt_format``."""
    import uvicorn

    from components.core.policy import load_policy
    from components.core.progress import say
    from components.core.prompts import resolve_format

    policy = load_policy(checkpoint, field="--checkpoint")
    # the flag's name in the error, not the recipe field's
    policy.prompt_format = resolve_format(policy.tokenizer, prompt_format, field="--prompt-format")
    name = model_name or "posttrain-policy"
    say(f"serve | {policy.uri} as {name!r} on http://{host}:{port}/v1")
    uvicorn.run(make_app(policy, name, batch_size), host=host, port=port, log_level="warning")
