"""The tiny default target: a small Qwen3-architecture model and a BPE tokenizer, built locally.

Both are saved with ``save_pretrained`` into a cache folder and then loaded back by
``training.model.target.load_target`` exactly as a real model folder would be: the tiny run
exercises the same loading code as the user's 27B job. Nothing is downloaded: the tokenizer
is trained with ``tokenizers`` on the default corpus, the model is randomly initialised.
The folder is built under a temporary name and renamed into place, so a killed build never
leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from training.config import DataSection, ModelSection
from training.data.corpus import CORPUS_SHA256, build_default_corpus, iter_texts

# The tokenizer a ``random`` target without one borrows is the default tiny model's, trained on
# this many default-corpus files: fixed, so such runs keep their token ids whatever data.* says.
STAND_IN_TOKENIZER_FILES = 200
_CORPUS = DataSection()  # the default corpus's chunking (data.corpus_chunk_lines / _prompt_lines)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen models use it; every rendering of messages[:i] is a prefix of messages[:i+1].
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_key(model: ModelSection, corpus_files: int) -> str:
    """A short hash of everything that determines the tiny model folder's contents."""
    text = "|".join(
        str(v)
        for v in (
            model.hidden_size,
            model.num_hidden_layers,
            model.num_attention_heads,
            model.num_key_value_heads,
            model.head_dim,
            model.intermediate_size,
            model.vocab_size,
            model.max_position_embeddings,
            model.seed,
            model.initializer_range,
            corpus_files,
            CORPUS_SHA256,
            "v2",
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def train_tokenizer(texts: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained on ``texts`` with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen3_config(model: ModelSection, vocab_size: int, eos_token_id: int | None = None):
    """A transformers ``Qwen3Config`` with the shape of ``model`` (and the given vocabulary)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=False,
        initializer_range=model.initializer_range,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        bos_token_id=None,
    )


def build_tiny_model(model: ModelSection, cache_dir: Path, corpus_files: int) -> Path:
    """Build (once) the tiny model + tokenizer folder and return its path."""
    folder = cache_dir / f"tiny-qwen3-{tiny_key(model, corpus_files)}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import Qwen3ForCausalLM

    corpus = build_default_corpus(
        cache_dir,
        corpus_files,
        chunk_lines=_CORPUS.corpus_chunk_lines,
        prompt_lines=_CORPUS.corpus_prompt_lines,
    )
    tokenizer = train_tokenizer(iter_texts(corpus), model.vocab_size)
    config = qwen3_config(model, len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(model.seed)
    try:
        net = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    net.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a concurrent builder winning the race
            raise
        shutil.rmtree(tmp)
    return folder
