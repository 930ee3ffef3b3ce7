"""Policy checkpoints: the demo tokenizer and model, and Hugging Face save/load via the store.

The demo policy is a Llama-architecture causal LM built from ``ModelConfig`` with a
character-level tokenizer made by the ``tokenizers`` library (every printable ASCII
character, tab and newline is one token). Checkpoints are plain Hugging Face folders
(``config.json``, ``model.safetensors``, tokenizer files), so transformers and vLLM load
them as they are. Any other Hugging Face causal LM folder also loads through
``load_policy``. ``pad_batch`` and ``token_logprobs`` score (prompt, completion) pairs
under a policy, for SFT (bootstrap), evaluation and the trainer's padded path;
``pack_levels``, ``pack_batch`` and ``packed_token_logprobs`` score them packed end to
end without padding, for the trainer.

A checkpoint a stage wrote is verified before it is loaded: ``load_policy`` finds the
producing stage's manifest in the folder above the checkpoint (``<stage prefix>/checkpoint``
beside ``<stage prefix>/_MANIFEST.json``; a registry version's source is that same URI),
and every file of it the manifest digests (the weights ``model.safetensors``, the config and
tokenizer files; not the trainer state beside them, which only the trainer reads, checked
the same way) must match its size and sha256 as it is copied down, else a UserError names the file and
the stage to re-run. A folder that no manifest describes (an external Hugging Face
checkpoint given as ``model.source``) has nothing to check against and loads as it is.

Not covered: sharded or quantised checkpoints, and tokenizers that need remote code.
"""

from __future__ import annotations

import json
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.core import checkpoint, hfimport
from components.core.errors import InfraError, UserError, exc_line, outage
from components.core.prompts import encode, resolve_format
from components.core.storage import Expected, Store, normalize_uri, s3_fix

if TYPE_CHECKING:
    from torch import Tensor

    from components.core.manifest import Manifest

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    from components.core.seeds import configure_torch

    configure_torch()
    hf_logging.disable_progress_bar()


def build_tokenizer():
    """A character-level fast tokenizer; deterministic, no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )


ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "out of memory")
"""Words of torch's error when it cannot allocate a tensor (``DefaultCPUAllocator: can't
allocate memory``, ``CUDA out of memory``)."""


def build_model(cfg, vocab_size: int):
    """A fresh Llama-architecture model from a ``ModelConfig`` (its parameters:
    ``ModelConfig.scratch_parameters``, bounded at recipe load). A model this machine has
    no memory for is a ``UserError`` naming the recipe's ``model`` section, not a traceback
    the orchestrator retries."""
    hfimport.lean()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    try:
        return LlamaForCausalLM(config)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not any(words in str(exc).lower() for words in ALLOCATION_FAILED):
            raise
        count = cfg.scratch_parameters(vocab_size)
        raise UserError("model", f"hidden_size: {cfg.hidden_size}, num_layers: {cfg.num_layers}, intermediate_size: "
                        f"{cfg.intermediate_size}", f"this machine has no memory for a model of {count:,} parameters "
                        f"({count * 4 / 1e9:.1f} GB of float32 weights; {exc_line(exc)[:240]})",
                        "make model.hidden_size, model.num_layers or model.intermediate_size smaller, or run on a "
                        "machine with more memory") from None


@dataclass
class Policy:
    """A model and its tokenizer, and how prompts are put to it: ``prompt_format`` is
    ``raw``, ``chat`` or ``auto`` (``components.core.prompts``; ``rollout.prompt_format``),
    resolved to ``raw`` or ``chat`` on construction (``chat`` without a chat template is a
    UserError)."""

    model: Any
    tokenizer: Any
    uri: str
    version: str = ""
    prompt_format: str = "raw"

    def __post_init__(self) -> None:
        self.prompt_format = resolve_format(self.tokenizer, self.prompt_format)

    def encode_prompt(self, prompt: str) -> list[int]:
        """The ids the policy generates from for a task prompt, under its prompt format."""
        return encode(self.tokenizer, prompt, self.prompt_format)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)


def save_policy(model, tokenizer, store: Store, rel: str) -> dict[str, str]:
    """Save a Hugging Face folder under ``rel`` in the store; returns file digests."""
    _quiet()
    with tempfile.TemporaryDirectory(prefix="posttrain-ckpt-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        return store.upload_dir(Path(tmp), rel)


TRAINER_STATE = "trainer_state.pt"
"""The optimizer state beside a checkpoint (``components/trainer/state.py``): a model load
neither downloads nor needs it."""


def checkpoint_expectations(uri: str) -> dict[str, Expected]:
    """{file in the checkpoint folder: what it must hold} from the manifest of the stage
    that wrote the checkpoint at ``uri`` (empty when no manifest describes it)."""
    from components.core.context import MAX_MANIFEST_BYTES, expected_output, read_manifest
    from components.core.manifest import MANIFEST, Manifest

    uri = uri.rstrip("/")
    parent = uri.rsplit("/", 1)[0]
    if parent == uri or "/" not in parent.split("://", 1)[-1]:
        return {}
    above = Store(parent, "policy")
    if not above.exists(MANIFEST):
        return {}
    try:
        found = Manifest.from_json(json.loads(above.read_small(MANIFEST, MAX_MANIFEST_BYTES)))
    except (ValueError, RecursionError, OSError) as exc:  # cut short, tampered with, or not a manifest at all
        if isinstance(exc, OSError) and (down := outage(exc)) is not None:  # a 503/500 s3fs raised as an OSError
            raise InfraError("store", above.uri, down) from None
        raise UserError("file", above.url(MANIFEST), f"manifest is unreadable ({type(exc).__name__})",
                        "delete it and re-run the stage that wrote this checkpoint") from None
    if not parent.endswith("/" + found.prefix):  # a stage's folder copied elsewhere, or a manifest edited by hand
        return _copied_expectations(found, uri, above.url(MANIFEST))
    root = Store(parent[: -len(found.prefix) - 1], "policy")
    manifest = read_manifest(root, found.prefix)  # registers its outputs' expectations too
    if manifest is None:
        return {}
    expected: dict[str, Expected] = {}
    for out in manifest.outputs.values():
        file_url = root.url(out.digested)
        if file_url.startswith(uri + "/"):
            expected[file_url[len(uri) + 1:]] = expected_output(root, manifest, out)
    return expected


def _copied_expectations(found: Manifest, uri: str, manifest_url: str) -> dict[str, Expected]:
    """What the checkpoint folder ``uri`` must hold by the manifest beside it, when that
    manifest is of another place (a trainer's folder copied out of its run root, or a
    manifest whose stage or iteration was edited): its files are still checked, by their
    names within the manifest's folder, so a changed byte cannot load unseen. Each is
    registered (``storage.expect``) as ``read_manifest`` registers a run root's outputs,
    so a later read of one through a Store in this process (the trainer's read of
    ``trainer_state.pt``) is checked too."""
    from components.core.manifest import MANIFEST
    from components.core.storage import expect, join

    folder, name = found.prefix + "/", uri.rsplit("/", 1)[1] + "/"
    remedy = f"copy the checkpoint again with its {MANIFEST}, or delete {manifest_url} if the files are what you want"
    expected = {}
    for out in found.outputs.values():
        inner = out.digested[len(folder):] if out.digested.startswith(folder) else ""
        if inner.startswith(name) and inner != name:
            rel = inner[len(name):]
            expected[rel] = Expected(sha256=out.sha256, size=out.size, stage=found.stage, remedy=remedy)
            expect(join(uri, rel), expected[rel])
    return expected


def load_policy(uri: str, version: str = "", field: str = "policy", prompt_format: str = "raw") -> Policy:
    """Load a checkpoint folder from any store URI (or a local path) onto the CPU, its
    prompts put to it in ``prompt_format`` (``rollout.prompt_format``; ``raw`` by default).

    A missing or unreadable checkpoint is a UserError naming the URI; a checkpoint whose
    files differ from the manifest that recorded them is a UserError naming the file and
    the stage to re-run, raised before anything is loaded.
    """
    import torch

    hfimport.lean()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _quiet()
    uri = normalize_uri(uri, field)
    store = Store(uri, field)
    with tempfile.TemporaryDirectory(prefix="posttrain-load-") as tmp:
        try:
            if not store.exists("config.json"):
                raise checkpoint.no_checkpoint(field, uri)
            # the optimizer state beside the weights is the trainer's alone (it reads and checks it itself)
            expected = {k: v for k, v in checkpoint_expectations(uri).items() if k != TRAINER_STATE}
            store.download_dir("", Path(tmp), expected=expected, skip=(TRAINER_STATE,), folders=checkpoint.LOADED_FOLDERS)
        except Exception as exc:  # an unreachable store is an outage wherever the policy loads (serve too)
            if isinstance(exc, (UserError, InfraError)):
                raise
            if (down := outage(exc)) is not None:
                raise InfraError(field, uri, down) from None
            if not uri.startswith("s3://"):
                if isinstance(exc, OSError):  # a link to /proc/self/mem, a device: EINVAL, EIO
                    raise UserError(field, uri, f"a file of the checkpoint cannot be read ({exc_line(exc)})",
                                    "make its files regular files, or point at another checkpoint") from None
                raise
            reason = exc_line(exc)[:200]
            raise UserError(field, uri, f"the store refused the checkpoint's files ({reason})", s3_fix(exc)) from None
        checkpoint.before_load(Path(tmp), field, uri)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report's table: after_load names what it found, in one line
        try:
            # trust_remote_code=False: a checkpoint's own Python (auto_map) is refused, never run or asked about
            tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
            # ignore_mismatched_sizes: a tensor of another shape is reported (after_load names it and both
            # shapes), not raised as "look at the above report" with the report hidden
            model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True,
                                                               trust_remote_code=False, ignore_mismatched_sizes=True)
        except Exception as exc:
            raise UserError(field, uri, f"checkpoint is unreadable ({exc_line(exc)[:200]})",
                            "re-run the stage that wrote it, or point at another checkpoint") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        checkpoint.after_load(model, tokenizer, info, field, uri)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, uri=uri, version=version, prompt_format=prompt_format)


def pad_batch(samples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (input_ids, attention_mask, completion_mask); the mask marks the
    positions of the logits (shifted by one) that predict completion tokens."""
    import torch

    width = max(len(p) + len(c) for p, c in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    comp = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for row, (p, c) in enumerate(samples):
        seq = p + c
        ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = 1
        comp[row, len(p) - 1 : len(seq) - 1] = 1.0
    return ids, attn, comp


def token_logprobs(model, ids: Tensor, attn: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(logprob of each next token, entropy) for positions 0..L-2, under softmax(logits/T)."""
    import torch

    # use_cache=False: scoring needs no KV cache (nor does training, whose saved config keeps its own setting)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@dataclass(frozen=True)
class PackedBatch:
    """Sequences laid end to end in rows of equal width, without padding between them.

    ``position_ids`` restart at 0 at each sequence, which is what makes transformers
    build a block-diagonal causal mask (each sequence attends only to its own earlier
    tokens) when no attention mask is passed. The tail of a row that no sequence fills
    is a filler segment of ``fill_id`` tokens with its own positions from 0: it attends
    only to itself and is never scored. ``targets`` are the flat indices (row * width +
    column) of the positions whose logits predict a completion token, in sample order,
    one per completion token; ``spans[k]`` is sample k's (offset, length) in ``targets``.
    """

    ids: Tensor
    position_ids: Tensor
    targets: Tensor
    spans: list[tuple[int, int]]
    placement: list[tuple[int, int]]  # per sample: (row, first column)


def pack_rows(lengths: list[int], width: int, max_per_row: int = 0) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``width`` tokens (first-fit decreasing;
    at most ``max_per_row`` sequences per row when > 0). A length over ``width`` is an
    error: the caller chooses a width at least the longest sequence."""
    too_long = [n for n in lengths if n > width]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens does not fit rows of width {width}; "
                         "use a width of at least the longest sequence")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        if not _fit(i, lengths[i], rows, free, max_per_row):
            rows.append([i])
            free.append(width - lengths[i])
    return rows


def _fit(i: int, length: int, rows: list[list[int]], free: list[int], max_per_row: int) -> bool:
    """Put sequence ``i`` into the first row with room (``free``: tokens left per row; at
    most ``max_per_row`` sequences per row when > 0); False when none has room."""
    for r, room in enumerate(free):
        if length <= room and (not max_per_row or len(rows[r]) < max_per_row):
            rows[r].append(i)
            free[r] -= length
            return True
    return False


def pack_levels(lengths: list[int], max_per_row: int = 0) -> list[tuple[int, list[list[int]]]]:
    """(width, rows) per level: rows as narrow as the sequences in them allow, since
    attention over a packed row costs its width squared however it is cut up.

    Level widths halve at least: sequences longest first, each goes into the first row of
    the current level with room (at most ``max_per_row`` sequences per row when > 0);
    one longer than half the level's width opens a new row, a shorter one that fits no
    row waits for the next level, whose width is the longest waiting sequence. So short
    sequences fill the gaps beside long ones first, and the rest share narrow rows."""
    levels: list[tuple[int, list[list[int]]]] = []
    waiting = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    while waiting:
        width = lengths[waiting[0]]
        rows: list[list[int]] = []
        free: list[int] = []
        later: list[int] = []
        for i in waiting:
            if _fit(i, lengths[i], rows, free, max_per_row):
                continue
            if 2 * lengths[i] > width or not later and not rows:
                rows.append([i])
                free.append(width - lengths[i])
            else:
                later.append(i)
        levels.append((width, rows))
        waiting = later
    return levels


def pack_batch(samples: list[tuple[list[int], list[int]]], rows: list[list[int]], fill_id: int) -> PackedBatch:
    """The ``PackedBatch`` of (prompt, completion) pairs laid out as ``rows`` (lists of
    sample indices, e.g. one level of ``pack_levels``); the width is the fullest row's length.
    Every sample must have a non-empty prompt (its last token's logits predict the first
    completion token) and appear in exactly one row."""
    import torch

    placed = sorted(i for row in rows for i in row)
    if placed != list(range(len(samples))):
        raise ValueError(f"rows place samples {placed}, not each of the {len(samples)} samples once; "
                         "pass rows from pack_rows over these samples")
    if any(not p for p, _ in samples):
        raise ValueError("a sample with an empty prompt has no position to predict its first token; "
                         "start every prompt with at least one token (the BOS)")
    width = max(sum(len(samples[i][0]) + len(samples[i][1]) for i in row) for row in rows)
    ids = torch.full((len(rows), width), fill_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    placement: list[tuple[int, int]] = [(0, 0)] * len(samples)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            seq = samples[i][0] + samples[i][1]
            ids[r, col : col + len(seq)] = torch.tensor(seq)
            pos[r, col : col + len(seq)] = torch.arange(len(seq))
            placement[i] = (r, col)
            col += len(seq)
        pos[r, col:] = torch.arange(width - col)  # the filler: a segment of its own
    targets: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, (p, c) in enumerate(samples):
        r, col = placement[i]
        first = r * width + col + len(p) - 1  # the logits at the prompt's last token predict completion token 0
        spans.append((len(targets), len(c)))
        targets.extend(range(first, first + len(c)))
    return PackedBatch(ids=ids, position_ids=pos, targets=torch.tensor(targets, dtype=torch.long), spans=spans,
                       placement=placement)


PACKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations whose masks transformers builds block-diagonally from packed
position ids (``tests/trainer/test_packing.py`` checks both)."""


def packed_token_logprobs(model, batch: PackedBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(logprob, entropy) of each completion token of a ``PackedBatch``, flat in the
    order of ``batch.targets``, under softmax(logits/T): the same values ``token_logprobs``
    gives at those positions of the padded batch.

    The forward pass gets ``position_ids`` and no attention mask, so transformers builds
    the block-diagonal causal mask from the restarting positions (sdpa and eager
    attention; any other implementation is a UserError naming trainer.packing). Only the scored positions go
    through the output layer, so a model whose config changes logits after it
    (soft-capping, logit scaling) is a UserError too: those are not covered."""
    import torch

    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in PACKED_ATTENTION:
        raise UserError("trainer.packing", True, f"packed scoring is verified for attention {PACKED_ATTENTION}, "
                        f"not the model's {attention!r}", "load the model with attn_implementation='sdpa' or set "
                        "trainer.packing: false")
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):  # applied after the output layer
        if getattr(model.config, key, None) not in (None, 1, 1.0):
            raise UserError("trainer.packing", True, f"packed scoring applies only the output embedding, but the "
                            f"model's config sets {key}={getattr(model.config, key)!r}",
                            "set trainer.packing: false for this model")
    # use_cache=False: with a cache, transformers ignores packed position ids and masks causally across sequences
    hidden = model.get_decoder()(input_ids=batch.ids, position_ids=batch.position_ids, use_cache=False).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.targets)
    logits = model.get_output_embeddings()(picked).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    next_ids = batch.ids.reshape(-1).index_select(0, batch.targets + 1)
    logp = logp_all.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
