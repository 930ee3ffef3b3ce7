"""Prompts as a policy sees them: the raw or chat prompt format, and its token count.

``rollout.prompt_format`` picks how a task prompt becomes the token ids a policy
generates from (and is scored on):

- ``raw``: the tokenizer's BOS token (when it has one), then the prompt's tokens;
- ``chat``: the tokenizer's chat template around the prompt as one user turn, with the
  generation prompt added (``apply_chat_template(..., add_generation_prompt=True)``): an
  instruct model sees what it was tuned on. A tokenizer without a template is a
  ``UserError`` naming ``rollout.prompt_format``;
- ``auto`` (the default): ``chat`` when the tokenizer has a template, else ``raw``. The
  demo's character tokenizer has none, so the demo stays ``raw``.

``resolve_format(tokenizer, fmt)`` turns ``auto`` into ``raw`` or ``chat``;
``encode(tokenizer, prompt, fmt)`` gives the ids (``Policy.encode_prompt`` calls it
with the policy's resolved format). The template is rendered to text and that text is
tokenised without adding special tokens, which is what ``apply_chat_template(...,
tokenize=True)`` does.

Multi-turn episodes under ``chat`` (``observation_ids``): each observation becomes the
next user turn. After an action the context gets the rest of the assistant turn's
closing as the template writes it (e.g. ``<|im_end|>\\n``; the part an action that
stopped on EOS already produced is not repeated), then the user turn holding the
observation, then the generation prompt for the next action. All of it is observation
tokens (mask 0): the policy trains only on its actions. Under ``raw`` an observation is
its text's tokens, appended as they are. The observation is program output, so its text
is tokenised with ``split_special_tokens=True`` (``text_ids``): special-token text in it
(``<eos>``, ``<|im_end|>``) is plain characters, never the special token; under ``chat``
it is tokenised apart from the template's pieces, so a merge across their boundary that
tokenising the rendered conversation whole would make is not made.

``load_tokenizer(uri)`` reads a checkpoint's small top-level files, the tokenizer's among
them (never its weights or optimizer state, nor ``generation_config.json``, and its
``config.json`` only when the tokenizer's own config does not name its class), so a stage
that only counts tokens (taskgen) downloads a few kilobytes; ``context_tokens(tasks, count)`` sets each task's ``context_tokens`` to its
prompt's length under a counter such as ``counter(tokenizer, fmt)``.

Not covered: system prompts, templates that need keyword arguments beyond
``add_generation_prompt`` (tools, documents), and chat templates that do not extend a
conversation by appending turns (a ``UserError`` for multi-turn episodes under ``chat``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from components.core.errors import UserError
from components.core.records import Task

FIELD = "rollout.prompt_format"
FORMATS = ("auto", "raw", "chat")
Resolved = Literal["raw", "chat"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
"""Files ``load_tokenizer`` never downloads: weights and optimizer state."""
MODEL_FILES = ("config.json", "generation_config.json")
"""The model's own settings: read by ``load_tokenizer`` only when ``tokenizer_config.json``
does not name the tokenizer class (transformers then finds it through the model type)."""

PROBE_LIMIT_S = 10.0
"""Seconds the chat template may take to render the probe prompt as the policy loads (a
real template takes milliseconds)."""

_ACTION = "\x00posttrain-action\x00"
_OBSERVATION = "\x00posttrain-observation\x00"


def has_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _resolved(tokenizer: Any, fmt: str, field: str) -> Resolved:
    if fmt not in FORMATS:
        raise UserError(field, fmt, "unknown prompt format", f"use one of {list(FORMATS)}")
    if fmt == "chat" and not has_template(tokenizer):
        raise UserError(field, fmt, "the policy's tokenizer has no chat template",
                        "set rollout.prompt_format: raw (or auto), or start from a checkpoint whose tokenizer has one")
    return ("chat" if has_template(tokenizer) else "raw") if fmt == "auto" else fmt  # type: ignore[return-value]


def resolve_format(tokenizer: Any, fmt: str, field: str = FIELD) -> Resolved:
    """``raw`` or ``chat`` for a requested format; ``chat`` without a template is a UserError,
    and so is a template that cannot render a prompt (checked here, once: as the policy loads)."""
    resolved = _resolved(tokenizer, fmt, field)
    if resolved == "chat":
        _probe(tokenizer)
    return resolved


def _probe(tokenizer: Any) -> None:
    """Render a one-line prompt with the chat template on a thread, waiting at most
    ``PROBE_LIMIT_S``: a template that renders for ever (nested loops, each under Jinja's
    ``range`` bound) is a UserError instead of a hang, and its render is stopped by an
    exception raised in that thread at its next Python step. Not covered: a template that
    runs long only on some prompts, one that writes gigabytes of text (a single C call, such
    as repeating a string, runs to its end before the thread can be stopped)."""
    failed: list[BaseException] = []

    def render() -> None:
        try:
            chat_text(tokenizer, "1+1=")
        except BaseException as exc:  # handed to the caller below (or the stop, ignored)
            failed.append(exc)

    thread = threading.Thread(target=render, name="posttrain-chat-template-probe", daemon=True)
    thread.start()
    thread.join(PROBE_LIMIT_S)
    if thread.is_alive():
        assert thread.ident is not None
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Overran))
        thread.join(PROBE_LIMIT_S)
        raise UserError("chat_template", _name(tokenizer),
                        f"the tokenizer's chat template renders a one-line prompt for over {PROBE_LIMIT_S:g} s",
                        _TEMPLATE_FIX)
    if failed:
        raise failed[0]


class _Overran(Exception):
    """Raised in a probe's thread to stop a render that ran past ``PROBE_LIMIT_S``."""


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the policy's tokenizer"


_TEMPLATE_FIX = ("fix chat_template in the checkpoint's tokenizer_config.json (or chat_template.jinja), "
                 "or set rollout.prompt_format: raw")


def _render(tokenizer: Any, messages: list[dict[str, str]], **options: Any) -> str:
    """``apply_chat_template(messages, tokenize=False, **options)``; a template that fails
    to render (``raise_exception``, a syntax error, an undefined variable, a template that
    is not text) is a UserError naming the tokenizer's folder. Not time-limited here (see
    ``_probe``, which ``resolve_format`` runs as the policy loads)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        if not isinstance(text, str):
            raise TypeError(f"it renders a {type(text).__name__}, not text")
    except Exception as exc:  # jinja2's TemplateError family, TypeError, OverflowError, RecursionError, ...
        detail = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise UserError("chat_template", _name(tokenizer),
                        f"the tokenizer's chat template fails to render ({type(exc).__name__}: {detail})",
                        _TEMPLATE_FIX) from None
    return text


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of untrusted ``text`` (a command's output) read as plain text: special-token
    text in it (``<eos>``, ``<|im_end|>``) becomes the tokens of its characters, never the
    special token (``split_special_tokens=True``, which Hugging Face's fast and Python
    tokenizers take). A tokenizer that refuses the option (mistral-common's raises) or
    ignores it (its own EOS text still comes back as the EOS id) is a UserError naming the
    policy's tokenizer, whatever ``text`` holds: an episode's output could end the policy's
    turn or forge a chat turn."""
    special = (getattr(tokenizer, "eos_token", None) or next(iter(getattr(tokenizer, "all_special_tokens", [])), None))
    try:
        ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        split = (not special or tokenizer.convert_tokens_to_ids(special) not in
                 tokenizer(special, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except (TypeError, ValueError):  # no such keyword, or "does not support split_special_tokens"
        split = False
    if not split:
        raise UserError("policy", _name(tokenizer), f"its tokenizer ({type(tokenizer).__name__}) cannot read special-"
                        "token text in a command's output as plain text (split_special_tokens)",
                        "use a checkpoint whose tokenizer is a Hugging Face fast or Python tokenizer")
    return ids


def chat_text(tokenizer: Any, prompt: str) -> str:
    """The chat template around ``prompt`` as one user turn, generation prompt added."""
    return _render(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)


def encode(tokenizer: Any, prompt: str, fmt: str) -> list[int]:
    """The ids a policy generates from for ``prompt`` under ``fmt`` (``auto`` is resolved here)."""
    if _resolved(tokenizer, fmt, FIELD) == "chat":
        return _ids(tokenizer, chat_text(tokenizer, prompt))
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + _ids(tokenizer, prompt)


def counter(tokenizer: Any, fmt: str) -> Callable[[str], int]:
    """prompt -> its length in policy tokens under ``fmt``."""
    resolved = resolve_format(tokenizer, fmt)
    return lambda prompt: len(encode(tokenizer, prompt, resolved))


def context_tokens(tasks: Iterable[Task], count: Callable[[str], int]) -> list[Task]:
    """The tasks with ``context_tokens`` set to ``count(prompt)``."""
    return [dataclasses.replace(t, context_tokens=count(t.prompt)) for t in tasks]


def _turn_pieces(tokenizer: Any) -> tuple[str, str, str]:
    """(closing of an assistant turn, text before an observation, text after it) as the
    chat template writes a conversation extended by one user turn."""
    first = [{"role": "user", "content": "task"}, {"role": "assistant", "content": _ACTION}]
    base = _render(tokenizer, first)
    full = _render(tokenizer, first + [{"role": "user", "content": _OBSERVATION}], add_generation_prompt=True)
    if not full.startswith(base) or _ACTION not in base or full[len(base):].count(_OBSERVATION) != 1:
        raise UserError(FIELD, "chat", "the tokenizer's chat template does not extend a conversation by appending turns",
                        "set rollout.prompt_format: raw for recipes with multi-turn episodes")
    closing = base[base.rindex(_ACTION) + len(_ACTION):]
    before, after = full[len(base):].split(_OBSERVATION)
    return closing, before, after


def observation_ids(tokenizer: Any, observation: str, fmt: str, action_stopped: bool) -> list[int]:
    """The ids appended to an episode's context after an action: the observation's text
    under ``raw``; under ``chat`` the end of the assistant turn (less the EOS the action
    already ended with when ``action_stopped``), the observation as a user turn, and the
    generation prompt. The template's pieces are tokenised as the template's text (their
    special tokens are special), the observation apart from them as plain text
    (``text_ids``): output that prints ``<eos>`` or ``<|im_end|>`` gives the tokens of
    those characters."""
    if _resolved(tokenizer, fmt, FIELD) == "raw":  # the policy's format, probed as it loaded
        return text_ids(tokenizer, observation)
    closing, before, after = _turn_pieces(tokenizer)
    eos = tokenizer.eos_token or ""
    if action_stopped and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    return _ids(tokenizer, closing + before) + text_ids(tokenizer, observation) + _ids(tokenizer, after)


def _names_class(tokenizer_config: Path) -> bool:
    """Whether a ``tokenizer_config.json`` names its tokenizer class."""
    try:
        return bool(json.loads(tokenizer_config.read_text()).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(uri: str, field: str = "policy") -> Any:
    """The tokenizer of the checkpoint folder at ``uri`` (any store URI or local path),
    reading its tokenizer and config files only; a folder without a readable tokenizer
    is a UserError naming ``field`` and the URI."""
    from components.core import checkpoint, hfimport

    hfimport.lean()
    from transformers import AutoTokenizer

    from components.core.storage import Store, normalize_uri

    uri = normalize_uri(uri, field)
    store = Store(uri, field)
    names = [n for n in store.listdir("") if not n.endswith(WEIGHT_SUFFIXES) and "." in n]
    if "config.json" not in names:
        raise checkpoint.no_checkpoint(field, uri)
    with tempfile.TemporaryDirectory(prefix="posttrain-tokenizer-") as tmp:
        for name in names:
            if name not in MODEL_FILES:
                limit = checkpoint.READ_LIMITS.get(name, checkpoint.MAX_TOKENIZER_BYTES)
                if (size := store.size(name)) > limit:  # read whole below: a 400 MB file took gigabytes
                    raise UserError(field, uri, f"{name} is larger than {limit >> 20} MiB ({size} bytes; a model's "
                                    "is far smaller)", checkpoint.FIX)
                (Path(tmp) / name).write_bytes(store.read_bytes(name))
        if not _names_class(Path(tmp) / "tokenizer_config.json"):
            (Path(tmp) / "config.json").write_bytes(store.read_bytes("config.json"))
        try:
            return AutoTokenizer.from_pretrained(tmp)
        except Exception as exc:
            raise UserError(field, uri, f"the checkpoint's tokenizer is unreadable ({type(exc).__name__})",
                            "re-run the stage that wrote it, or point at another checkpoint") from None
