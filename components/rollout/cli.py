"""``posttrain serve``: an OpenAI-compatible completions server for one checkpoint.

    posttrain serve --checkpoint URI [--host 127.0.0.1] [--port 8000] [--model NAME] [--batch-size 64]
                    [--prompt-format raw|chat|auto]

See ``components/rollout/serve.py`` for what it serves and what it does not.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint on an OpenAI-compatible /v1/completions endpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint URI or folder (file://, s3://, or a path)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    p.add_argument("--model", default="posttrain-policy", help="model name clients send (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per generation batch (default: %(default)s)")
    p.add_argument("--prompt-format", choices=("raw", "chat", "auto"), default="auto",
                   help="how text prompts become token ids, as rollout.prompt_format: raw (BOS + text), chat (the "
                        "tokenizer's chat template, one user turn) or auto (chat when it has one) (default: %(default)s)")
    p.set_defaults(handler=_serve)


MAX_BATCH_SIZE = 4096
"""The most sequences one generation batch takes (``serve``'s requests hold at most 256 prompts)."""


def _serve(args: argparse.Namespace) -> int:
    from components.core.errors import UserError
    from components.rollout.serve import serve

    if not 0 < args.port < 65536:
        raise UserError("--port", args.port, "not a TCP port", "pass a port between 1 and 65535")
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:  # a batch is padded to its longest sequence: 10**14 would never fit
        raise UserError("--batch-size", args.batch_size, f"must be from 1 to {MAX_BATCH_SIZE}",
                        f"pass --batch-size from 1 to {MAX_BATCH_SIZE} (default 64)")
    if not args.model.strip() or not args.model.isprintable():
        raise UserError("--model", args.model, "is no model name clients can send (empty, or a control character)",
                        "pass a name such as posttrain-policy")
    serve(args.checkpoint, args.host, args.port, args.model, args.batch_size, args.prompt_format)
    return 0
