"""The tiny default target: a small Qwen3 (or Qwen3.5/3.6 hybrid) model and a BPE tokenizer, built here.

Both are saved with ``save_pretrained`` into a cache folder and then loaded back by
``training.model.target.load_target`` exactly as a real model folder would be: the tiny run
exercises the same loading code as the user's 27B job. Nothing is downloaded: the tokenizer
is trained with ``tokenizers`` on the default corpus, the model is randomly initialised.
The folder is built under a temporary name and renamed into place, so a killed build never
leaves a half-written model behind.

``model.architecture = "qwen3_5"`` builds transformers' ``qwen3_5`` family (Gated DeltaNet
layers with a full-attention layer every ``full_attention_interval`` layers), saved either as
``Qwen3_5ForCausalLM`` (``checkpoint_layout = "text"``: ``model.layers.*``) or as the published
Qwen3.6 checkpoints are, ``Qwen3_5ForConditionalGeneration`` (``"multimodal"``:
``model.language_model.*`` plus a vision tower, here a one-block one). Its tokenizer carries
``<think>``/``</think>`` and a Qwen3.5-style chat template (``QWEN3_5_CHAT_TEMPLATE``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from training.config import DataSection, ModelSection
from training.contract import HF_CONFIG_FILE
from training.data.corpus import CORPUS_SHA256, build_default_corpus, iter_texts

# The tokenizer a ``random`` target without one borrows is the default tiny model's, trained on
# this many default-corpus files: fixed, so such runs keep their token ids whatever data.* says.
STAND_IN_TOKENIZER_FILES = 200
_CORPUS = DataSection()  # the default corpus's chunking (data.corpus_chunk_lines / _prompt_lines)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
# The drafter's MASK token (DFlash embeds it with the target's embedding; never in the data).
MASK_TOKEN = "<|mask|>"

# ChatML, as Qwen models use it; every rendering of messages[:i] is a prefix of messages[:i+1].
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The rules of the Qwen3.5/3.6 chat template (the tokenizer_config.json of those checkpoints) that
# decide what the loss sees, written out for a tokenizer of our own:
#   - the generation prompt opens the thinking block: ``<|im_start|>assistant\n<think>\n``
#     (``enable_thinking=false``: an empty block ``<think>\n\n</think>\n\n``);
#   - an assistant turn after the last user message is rendered with its reasoning,
#     ``<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>\n`` (the reasoning from
#     ``reasoning_content`` or from a ``<think>...</think>`` inside ``content``); the last turn always,
#     an earlier one of a multi-step tool exchange when it has reasoning;
#   - an assistant turn before the last user message loses its reasoning: ``{answer}<|im_end|>\n``;
#   - a ``tool`` message is a user turn wrapping ``<tool_response>``.
QWEN3_5_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set reasoning = m['reasoning_content'] if m['reasoning_content'] is string else '' -%}"
    "{%- if m['reasoning_content'] is not string and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def tiny_key(model: ModelSection, corpus_files: int) -> str:
    """A short hash of everything that determines the tiny model folder's contents."""
    values: tuple[object, ...] = (
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
        "v3",  # v3: the tokenizer reserves MASK_TOKEN
    )
    if model.architecture != "qwen3":
        values += (
            model.architecture,
            model.checkpoint_layout,
            model.full_attention_interval,
            model.linear_num_key_heads,
            model.linear_num_value_heads,
            model.linear_key_head_dim,
            model.linear_value_head_dim,
            model.linear_conv_kernel_dim,
        )
    return hashlib.sha256("|".join(str(v) for v in values).encode()).hexdigest()[:12]


def train_tokenizer(texts: list[str], vocab_size: int, *, thinking: bool = False) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` with ChatML special tokens and template
    and a reserved ``mask_token`` (the drafter's MASK); ``thinking``: also ``<think>``/``</think>``
    and the Qwen3.5-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, *(THINK_TOKENS if thinking else ())]
    trained = [*specials, MASK_TOKEN]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=trained,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        mask_token=MASK_TOKEN,
    )
    fast.chat_template = QWEN3_5_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE
    return fast


def qwen3_config(model: ModelSection, vocab_size: int, eos_token_id: int | None = None):
    """A transformers ``Qwen3Config`` with the shape of ``model`` (and the given vocabulary)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(model, vocab_size, eos_token_id))


def _common(model: ModelSection, vocab_size: int, eos_token_id: int | None) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": False,
        "initializer_range": model.initializer_range,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "bos_token_id": None,
    }


def qwen3_5_layer_types(num_layers: int, interval: int) -> list[str]:
    """transformers' default ``layer_types`` of ``Qwen3_5TextConfig`` (Qwen3.5/3.6 use it):
    layer ``i`` is full attention when ``(i + 1) % interval == 0``, else Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def qwen3_5_text_config(model: ModelSection, vocab_size: int, eos_token_id: int | None = None):
    """A transformers ``Qwen3_5TextConfig`` (``model_type`` ``qwen3_5_text``) of ``model``'s shape."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen3_5_text_fields(model, vocab_size, eos_token_id))


def _qwen3_5_text_fields(model: ModelSection, vocab_size: int, eos_token_id: int | None) -> dict[str, Any]:
    return {
        **_common(model, vocab_size, eos_token_id),
        "layer_types": qwen3_5_layer_types(model.num_hidden_layers, model.full_attention_interval),
        "full_attention_interval": model.full_attention_interval,
        "linear_num_key_heads": model.linear_num_key_heads,
        "linear_num_value_heads": model.linear_num_value_heads,
        "linear_key_head_dim": model.linear_key_head_dim,
        "linear_value_head_dim": model.linear_value_head_dim,
        "linear_conv_kernel_dim": model.linear_conv_kernel_dim,
    }


def qwen3_5_multimodal_config(model: ModelSection, vocab_size: int, eos_token_id: int | None = None):
    """A ``Qwen3_5Config`` (``model_type`` ``qwen3_5``, the published checkpoints' layout): the text
    config of ``model`` nested under ``text_config`` and a one-block vision tower."""
    from transformers import Qwen3_5Config

    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": model.hidden_size,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
    }
    return Qwen3_5Config(
        text_config=_qwen3_5_text_fields(model, vocab_size, eos_token_id),
        vision_config=vision,
        tie_word_embeddings=False,
    )


def target_text_config(model: ModelSection, vocab_size: int, eos_token_id: int | None = None):
    """The transformers text config of a ``tiny``/``random`` target (``model.architecture``)."""
    if model.architecture == "qwen3_5":
        return qwen3_5_text_config(model, vocab_size, eos_token_id)
    return qwen3_config(model, vocab_size, eos_token_id)


def _tiny_network(model: ModelSection, vocab_size: int, eos_token_id: int | None):
    """The tiny model itself, in the class its checkpoint layout is saved from."""
    from transformers import AutoModelForCausalLM

    if model.checkpoint_layout == "multimodal":
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration(qwen3_5_multimodal_config(model, vocab_size, eos_token_id))
    return AutoModelForCausalLM.from_config(target_text_config(model, vocab_size, eos_token_id))


def build_tiny_model(model: ModelSection, cache_dir: Path, corpus_files: int) -> Path:
    """Build (once) the tiny model + tokenizer folder and return its path."""
    name = "tiny-qwen3"
    if model.architecture != "qwen3":
        name = f"tiny-{model.architecture}-{model.checkpoint_layout}"
    folder = cache_dir / f"{name}-{tiny_key(model, corpus_files)}"
    if (folder / HF_CONFIG_FILE).is_file():
        return folder
    import torch

    corpus = build_default_corpus(
        cache_dir,
        corpus_files,
        chunk_lines=_CORPUS.corpus_chunk_lines,
        prompt_lines=_CORPUS.corpus_prompt_lines,
    )
    tokenizer = train_tokenizer(
        iter_texts(corpus), model.vocab_size, thinking=model.architecture == "qwen3_5"
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(model.seed)
    try:
        net = _tiny_network(model, len(tokenizer), tokenizer.eos_token_id)
    finally:
        torch.random.set_rng_state(generator_state)
    return save_model_folder(folder, net, tokenizer)


def save_model_folder(folder: Path, model: Any, tokenizer: Any) -> Path:
    """Save a model and its tokenizer as ``folder`` atomically (a temp dir renamed into place): a
    reader sees a whole folder or none; another process that built the same folder first wins."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:  # a stop or an error while saving leaves no temp dir
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / HF_CONFIG_FILE).is_file():  # not a concurrent builder winning the race
            raise
        shutil.rmtree(tmp)
    return folder
