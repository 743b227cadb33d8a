"""Requests written by the target itself (Magpie): a data source for any chat target.

Magpie (Xu et al., "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing", arXiv 2406.08464; code ``magpie-align/magpie``) gives an aligned model its chat template
up to the start of a user turn and nothing else: what it samples there is a user request, drawn
from the requests it was aligned on. The rules here are those of ``exp/gen_ins.py``:

- The prefix is the template's rendering up to and including the user-turn header
  (``configs/model_configs.json`` ``pre_query_template``, e.g. Qwen's ``<|im_start|>user\\n``).
  Here it is derived from the target's own template, not written per model: a conversation of one
  user message (a sentinel) is rendered and cut at the sentinel, so a template that injects a
  default system prompt (SmolLM2's) keeps it, as the target saw it in training.
- Sampling: ``temperature`` and ``top_p`` as ``gen_ins.py`` takes them (its defaults 1.0 and 1.0;
  ``scripts/magpie.sh`` uses 1.1 / 0.99 for Llama-3, ``magpie-qwen2.5-7b.sh`` 0.7 / 1.0), no top-k
  (vLLM's default), at most ``max_new_tokens``; a request ends at the token that closes a user
  turn (``stop_token_ids``) or the EOS. ``gen_ins.py`` also stops at the first newline by default
  (one-line requests); here a request may span lines (code, lists), the length filter bounds it.
- Each sample ``i`` is drawn from its own seed (``seed`` and ``i``), so the same seed gives the
  same requests: in this process one ``torch`` seed per batch, through servers one ``seed`` per
  request (a server that batches requests may still not reproduce them bit for bit).

Filters (``data_sft/data_filter.ipynb`` keeps a request a judge rates good or excellent, with a
reward above -10, not ending in ":", and not the near-duplicate of another by embedding distance;
the judges need other models, so here rules that need none), in this order, each rejected request
counted under its first reason: ``empty``; ``unfinished`` (no end of turn within
``max_new_tokens``: cut off, or a loop; or ending in ":", the notebook's rule); ``too_short``; ``too_long``;
``assistant_leak`` (a special token of the template, or a line that is a role name such as
``assistant:``, inside the request: the model went on to write the reply, ``gen_ins.py``'s
``stop_tokens_assistant``); ``non_text`` (control characters, or fewer than half of the
non-space characters letters); ``repetition`` (the share of repeated word 3-grams above
``REPEAT_SHARE``: a degenerate loop); ``refusal`` (the model spoke as the assistant: "I'm sorry",
"As an AI"...). Then de-duplication, in sampling order: ``duplicate`` (the same text once
case, punctuation and spacing are normalised) and ``near_duplicate`` (word 3-gram Jaccard
similarity to a kept request of at least ``dedup_threshold``; every kept request sharing a 3-gram
is compared, so nothing is approximated).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import ConfigError, DataSection
from training.progress import Progress

SENTINEL = "MagpieSentinelRequest"  # letters only: templates that trim or escape content keep it
MIN_CHARS = 12
MAX_CHARS = 4000
REPEAT_SHARE = 0.3  # of a request's word 3-grams that repeat an earlier one
NGRAM = 3
OVERSAMPLE = 4  # at most this many samples per kept request before giving up on the count
REASONS = (
    "empty",
    "unfinished",
    "too_short",
    "too_long",
    "assistant_leak",
    "non_text",
    "repetition",
    "refusal",
    "duplicate",
    "near_duplicate",
)
_REFUSAL = re.compile(
    r"\b(i'?m sorry|i am sorry|i apologi[sz]e|as an ai\b|as a language model|i cannot (help|assist|"
    r"provide|fulfil)|i can'?t (help|assist|provide)|i'?m (just )?an ai|i am (just )?an ai)",
    re.IGNORECASE,
)
_ROLE_LINE = re.compile(r"^\s*(assistant|user|system|human|gpt)\s*:?\s*$|^\s*(assistant|ai)\s*:", re.I | re.M)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class UserTurn:
    """How the target's template opens and closes a user turn."""

    prefix: str  # the rendering up to and including the user-turn header
    end: str  # the first token after the user's text (``<|im_end|>``), "" if none
    stop_ids: tuple[int, ...]  # token ids that end a request: the turn's end and the EOS
    markers: tuple[str, ...]  # the tokenizer's special tokens (text that never belongs in a request)


def user_turn(tokenizer: Any) -> UserTurn:
    """The target's user-turn prefix and end, from its own chat template (module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.regen_sources 'magpie': the target's tokenizer has no chat template; Magpie needs a "
            "chat model (its template opens the user turn): use another source or a chat target"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ConfigError(
            "data.regen_sources 'magpie': the target's chat template does not render a user message "
            "as written, so the user-turn prefix cannot be cut from it: use another source"
        )
    prefix, after = text.split(SENTINEL)
    after_ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    stops = [after_ids[0]] if after_ids else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    end = tokenizer.decode(after_ids[:1]) if after_ids else ""
    markers = tuple(t for t in tokenizer.all_special_tokens if t)
    return UserTurn(prefix=prefix, end=end, stop_ids=tuple(stops), markers=markers)


@dataclass(frozen=True)
class MagpieSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    dedup_threshold: float = 0.7

    @classmethod
    def of(cls, data: DataSection) -> MagpieSettings:
        return cls(
            temperature=data.magpie_temperature,
            top_p=data.magpie_top_p,
            seed=data.magpie_seed,
            max_new_tokens=data.magpie_max_new_tokens,
            dedup_threshold=data.magpie_dedup_threshold,
        )

    def sample_seed(self, index: int) -> int:
        """The seed of sample (or batch) ``index``: distinct per (seed, index), within 32 bits."""
        return (self.seed * 1_000_003 + index) % 2**31


@dataclass(frozen=True)
class Sample:
    text: str
    finished: bool  # ended at the end of turn (not cut at max_new_tokens)


# ----------------------------------------------------------------------------------------- filters
def normalise(text: str) -> str:
    """Case, punctuation and spacing folded away: what exact de-duplication compares."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w\s]", " ", folded).split())


def shingles(text: str, n: int = NGRAM) -> frozenset[str]:
    """Word ``n``-grams of the normalised text (the whole text when it has fewer words)."""
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))


def repeated_share(text: str, n: int = NGRAM) -> float:
    """The share of the word ``n``-grams that repeat an earlier one (0 for a short text)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if len(grams) >= 2 * n else 0.0


def rejected(sample: Sample, markers: Sequence[str] = ()) -> str | None:
    """Why ``sample`` is no request (a reason of ``REASONS``), or None (module docstring)."""
    text = sample.text.strip()
    if not text:
        return "empty"
    if not sample.finished or text.endswith(":"):
        return "unfinished"
    if len(text) < MIN_CHARS:
        return "too_short"
    if len(text) > MAX_CHARS:
        return "too_long"
    if any(marker in text for marker in markers) or _ROLE_LINE.search(text):
        return "assistant_leak"
    visible = [c for c in text if not c.isspace()]
    if _CONTROL.search(text) or sum(c.isalpha() for c in visible) < len(visible) / 2:
        return "non_text"
    if repeated_share(text) > REPEAT_SHARE:
        return "repetition"
    if _REFUSAL.search(text):
        return "refusal"
    return None


class Dedup:
    """Exact (normalised) and near (word 3-gram Jaccard >= ``threshold``) duplicates of the kept."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._exact: set[str] = set()
        self._kept: list[frozenset[str]] = []
        self._index: dict[str, list[int]] = {}

    def add(self, text: str) -> str | None:
        """ "duplicate" | "near_duplicate" (not kept), or None (kept)."""
        key = normalise(text)
        if key in self._exact:
            return "duplicate"
        grams = shingles(text)
        candidates = {i for gram in grams for i in self._index.get(gram, ())}
        for i in candidates:
            other = self._kept[i]
            if len(grams & other) / len(grams | other) >= self.threshold:
                return "near_duplicate"
        self._exact.add(key)
        for gram in grams:
            self._index.setdefault(gram, []).append(len(self._kept))
        self._kept.append(grams)
        return None


# -------------------------------------------------------------------------------------- generation
@dataclass(frozen=True)
class MagpieResult:
    prompts: tuple[str, ...]
    wanted: int
    sampled: int
    seconds: float
    rejected: dict[str, int] = field(default_factory=dict)

    @property
    def filtered_share(self) -> float:
        return sum(self.rejected.values()) / self.sampled if self.sampled else 0.0

    def text(self) -> str:
        seconds = max(self.seconds, 1e-9)
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.rejected.items(), key=lambda kv: -kv[1]))
        return (
            f"magpie: {len(self.prompts)} requests kept of {self.sampled} sampled "
            f"({100 * self.filtered_share:.1f}% filtered{': ' + reasons if reasons else ''}) in "
            f"{self.seconds:.1f}s ({self.sampled / seconds:.2f} sampled/s, "
            f"{len(self.prompts) / seconds:.2f} kept/s)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "wanted": self.wanted,
            "kept": len(self.prompts),
            "sampled": self.sampled,
            "seconds": self.seconds,
            "filtered_share": self.filtered_share,
            "rejected": self.rejected,
        }


def collect(
    draw: Callable[[int, int], list[Sample]],
    count: int,
    settings: MagpieSettings,
    markers: Sequence[str],
    chunk: int,
    progress: Callable[[int], None] = lambda _kept: None,
    max_samples: int | None = None,
) -> MagpieResult:
    """``count`` requests that pass the filters, drawing ``draw(first_index, n)`` samples ``chunk``
    at a time, at most ``max_samples`` (``OVERSAMPLE * count``) of them (fewer kept then: the
    caller says so)."""
    started = time.monotonic()
    dedup = Dedup(settings.dedup_threshold)
    kept: list[str] = []
    reasons: Counter[str] = Counter()
    index = 0
    limit = OVERSAMPLE * count if max_samples is None else max_samples
    while len(kept) < count and index < limit:
        samples = draw(index, min(chunk, limit - index))
        index += len(samples)
        for sample in samples:
            why = rejected(sample, markers) or dedup.add(sample.text.strip())
            if why:
                reasons[why] += 1
            elif len(kept) < count:
                kept.append(sample.text.strip())
        progress(len(kept))
    return MagpieResult(tuple(kept), count, index, round(time.monotonic() - started, 3), dict(reasons))


def sample_in_process(
    model: Any, tokenizer: Any, turn: UserTurn, settings: MagpieSettings, batch_size: int
) -> Callable[[int, int], list[Sample]]:
    """``draw(first, n)`` of ``collect``: ``n`` samples from the target in this process, one
    ``generate`` call (all rows share the prefix: no padding), seeded per batch."""
    import torch

    device = next(model.parameters()).device
    prefix = tokenizer(turn.prefix, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else turn.stop_ids[-1]

    def draw(first: int, n: int) -> list[Sample]:
        ids = prefix.expand(n, -1)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(settings.sample_seed(first // batch_size))
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=0,
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=list(turn.stop_ids),
                pad_token_id=pad,
            )
        samples = []
        for row in out[:, ids.shape[1] :].tolist():
            ends = [i for i, token in enumerate(row) if token in turn.stop_ids]
            cut = row[: ends[0]] if ends else row
            samples.append(Sample(tokenizer.decode(cut, skip_special_tokens=False), bool(ends)))
        return samples

    return draw


def sample_from_servers(
    urls: Sequence[str], turn: UserTurn, settings: MagpieSettings, concurrency: int
) -> Callable[[int, int], list[Sample]]:
    """``draw(first, n)`` of ``collect``: one raw completion request per sample
    (``/v1/completions``, the prefix as the prompt: no chat endpoint, which would open an assistant
    turn), sent to the servers in turn with ``engine_regen``'s retries; its ``seed`` the sample's."""
    from concurrent.futures import ThreadPoolExecutor

    from training.data.engine_regen import Regenerator, RegenSettings

    regen = Regenerator(RegenSettings(servers=tuple(urls), concurrency=concurrency, retries=3))
    stop = [turn.end] if turn.end else []

    def one(index: int) -> Sample:
        body = {
            "model": "default",
            "prompt": turn.prefix,
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": -1,  # off, as vLLM's default (llama-server's own default is 40)
            "min_p": 0.0,  # off (llama-server's default is 0.05)
            "seed": settings.sample_seed(index),
            "stop": stop,
            "stream": False,
        }
        choice = regen.send("/v1/completions", body)["choices"][0]
        return Sample(str(choice.get("text") or ""), choice.get("finish_reason") == "stop")

    def draw(first: int, n: int) -> list[Sample]:
        with ThreadPoolExecutor(max_workers=max(1, concurrency * len(regen.urls))) as pool:
            return list(pool.map(one, range(first, first + n)))

    return draw


# --------------------------------------------------------------------------------------- the cache
def magpie_key(model_id: str, count: int, settings: MagpieSettings, how: str) -> str:
    """The cache key of a Magpie set: model, count, sampling and filters, and ``how`` it was
    sampled (in this process with its batch size and dtype, or through servers)."""
    digest = hashlib.sha256()
    parts = (model_id, str(count), json.dumps(settings.__dict__, sort_keys=True), how, "magpie-v1")
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:12]


def sampled_how(batch_size: int, dtype: str, server: bool) -> str:
    """How a set is sampled, for its key: through servers, or in this process (the batch size
    and the device-dtype decide the random draws)."""
    return "server" if server else f"batch{batch_size}-{dtype}"


def magpie_path(cache_dir: Path, model_id: str, count: int, settings: MagpieSettings, how: str) -> Path:
    """Where a Magpie set is kept: one request a line (JSON strings), its report beside it."""
    return cache_dir / "regen" / f"magpie-{magpie_key(model_id, count, settings, how)}.jsonl"


def cached_prompts(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def magpie_prompts(
    path: Path,
    count: int,
    settings: MagpieSettings,
    turn: Callable[[], UserTurn],
    sampler: Callable[[UserTurn], tuple[Callable[[int, int], list[Sample]], int]],
    echo: Callable[[str], None] = print,
) -> list[str]:
    """The ``count`` Magpie requests kept at ``path`` (written once, atomically, with its report
    ``*.report.json``); ``sampler(turn)`` gives the draw and its chunk size."""
    found = cached_prompts(path)
    if found is not None:
        return found
    frame = turn()
    draw, chunk = sampler(frame)
    echo(
        f"Writing {count} requests with the target (Magpie: temperature {settings.temperature}, "
        f"top_p {settings.top_p}, seed {settings.seed}, <= {settings.max_new_tokens} tokens)"
    )
    what = f"writing requests with the target (Magpie, {count})"
    with Progress("load_data", what, count, "prompts", echo=echo) as progress:
        result = collect(draw, count, settings, frame.markers, chunk, progress.update)
    echo(result.text())
    if not result.prompts:
        raise ConfigError(
            f"data.regen_sources 'magpie': none of {result.sampled} sampled requests passed the filters "
            f"({', '.join(sorted(result.rejected))}): check the target's chat template, or raise "
            "data.magpie_max_new_tokens / lower data.magpie_temperature"
        )
    if len(result.prompts) < count:
        echo(f"  only {len(result.prompts)} of {count} requests passed the filters; the set has that many")
    write_lines(path, [json.dumps(p) for p in result.prompts])
    write_lines(path.with_suffix(".report.json"), [json.dumps(result.to_json(), sort_keys=True)])
    return list(result.prompts)


def write_lines(path: Path, lines: Iterable[str]) -> None:
    """``lines`` to ``path`` atomically (a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
