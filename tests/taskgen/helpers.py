"""Starting-policy checkpoints for taskgen tests: taskgen reads their tokenizer only."""

from __future__ import annotations

from components.core.policy import save_policy
from components.core.storage import Store
from tests.rollout.helpers import tiny_policy


def starting_checkpoint(store: Store, tokenizer=None, rel: str = "start-ckpt") -> str:
    """The URI of a tiny checkpoint under ``store`` (the demo's tokenizer unless one is given)."""
    tiny = tiny_policy()
    save_policy(tiny.model, tokenizer if tokenizer is not None else tiny.tokenizer, store, rel)
    return store.url(rel)


def word_tokenizer(texts: list[str]):
    """A byte-pair tokenizer trained on ``texts``: most tokens span several characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
