"""Training data aligned with the target: shipped prompts, completions written by the target itself.

A drafter learns to predict what its target says next, so its data should be the target's own
outputs, not some other text: SpecForge regenerates its training set with the target
(``scripts/regenerate_train_data.py``: each conversation's user turns are sent to the target and
the assistant turns replaced by its replies). Here:

- Prompts come from the corpus shipped with the trainer (``assets/python-stdlib-3.11.7.tar.gz``,
  pinned by sha256, PSF license): every documented public function of those sources gives one
  chat request, alternately "write a function ``name(args)`` that <docstring's first line>" and
  "explain what this function does" with its first lines, so every machine gets the same prompts
  and nothing is downloaded. ``count`` of them are taken, spread evenly over the sorted list.
- Completions are the target's greedy continuation of each chat-templated prompt (its generation
  prompt included), batched with left padding through ``generate`` (KV cache), at most
  ``max_new_tokens`` tokens, ending at its EOS.
- ``sources`` "magpie" (alone, or mixed: ``magpie_share`` of the count): requests the target
  writes itself from its chat template's user-turn prefix (``training.data.magpie``), kept once
  under the cache root, then answered greedily like the others (after the shipped ones).
- The result, ``{"messages": [user, assistant]}`` records, is written once as JSONL under the
  trainer's cache root (atomically: a temp file renamed into place), keyed on the model folder,
  the prompts and the generation settings; the tokenizer renders it with the same chat template.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import textwrap
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from training.data.corpus import CORPUS_SHA256, shipped_sources
from training.data.magpie import (
    MagpieSettings,
    Sample,
    UserTurn,
    magpie_path,
    magpie_prompts,
    sample_from_servers,
    sample_in_process,
    sampled_how,
    user_turn,
)
from training.progress import Progress

_MAX_DOC = 160  # characters of a docstring's first line in a prompt
_MAX_LINES = 12  # lines of a function shown in an "explain" prompt


def _functions(path: str, text: str) -> list[tuple[str, str, str, str]]:
    """(path, name, args, docstring's first line, source head) of the documented public functions."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = (ast.get_docstring(node) or "").strip().splitlines()
        first = doc[0].strip() if doc else ""
        if len(first) < 12:
            continue
        args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
        end = min(node.end_lineno or node.lineno, node.lineno - 1 + _MAX_LINES)
        head = textwrap.dedent("\n".join(lines[node.lineno - 1 : end]))
        found.append((path, node.name, args, first[:_MAX_DOC], head))
    return found


# The "packages" source: libraries every training env installs (envs/*/uv.lock pins them), so the
# prompts need no download and are the same wherever the same lock is installed.
REGEN_PACKAGES = ("numpy", "torch", "transformers", "datasets")
_TEMPLATES = (
    "Write a Python function `{name}({args})`: {first}",
    "Explain what this Python function does:\n\n```python\n{head}\n```",
    "Write pytest tests for a Python function `{name}({args})` that does this: {first}",
    "Rewrite this Python function with type hints and a docstring:\n\n```python\n{head}\n```",
)


@cache
def package_sources(names: tuple[str, ...] = REGEN_PACKAGES) -> tuple[tuple[str, str], ...]:
    """(``dist/path``, text) of the installed distributions' Python files, tests left out, sorted;
    a distribution that is not installed gives none."""
    found = []
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in dist.files or ():
            parts = entry.parts
            if entry.suffix != ".py" or "tests" in parts or "test" in parts or entry.name.startswith("test_"):
                continue
            try:
                text = Path(str(dist.locate_file(entry))).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            found.append((f"{name}/{entry}", text))
    return tuple(sorted(found))


def _spread(items: list[Any], count: int) -> list[Any]:
    count = min(count, len(items))
    return [items[i * len(items) // count] for i in range(count)] if count > 0 else []


def shipped_prompts(
    count: int, sources: str = "stdlib", packages: tuple[str, ...] = REGEN_PACKAGES
) -> list[str]:
    """``count`` chat requests (module docstring), deterministic. ``sources`` "stdlib": from the
    shipped corpus, alternately "write" and "explain"; with "packages" the corpus' functions and
    those of ``REGEN_PACKAGES`` (four kinds of request) share the count in proportion."""

    def key(item: tuple[str, str, str, str, str]) -> tuple[str, str, str]:
        return (item[0], item[1], item[4])

    stdlib = sorted((item for path, text in shipped_sources() for item in _functions(path, text)), key=key)
    chosen = [part.strip() for part in sources.split(",")]
    if count <= 0 or not stdlib:
        return []
    if "packages" not in chosen:
        return [
            _TEMPLATES[i % 2].format(name=name, args=args, first=first, head=head)
            for i, (_path, name, args, first, head) in enumerate(_spread(stdlib, count))
        ]
    # One of each (name, args, docstring): model files repeat `forward` with the same words many times
    unique = {item[1:4]: item for path, text in package_sources(packages) for item in _functions(path, text)}
    extra = sorted(unique.values(), key=key)
    total = len(stdlib) + len(extra)
    picked = [("stdlib", item) for item in _spread(stdlib, round(count * len(stdlib) / total))]
    picked += [("packages", item) for item in _spread(extra, count - len(picked))]
    prompts = []
    for i, (source, (_path, name, args, first, head)) in enumerate(picked):
        template = _TEMPLATES[i % 2] if source == "stdlib" else _TEMPLATES[i % len(_TEMPLATES)]
        prompts.append(template.format(name=name, args=args, first=first, head=head))
    return prompts


def source_counts(count: int, sources: str, magpie_share: float) -> tuple[int, int]:
    """(shipped, Magpie) prompts of ``count``: Magpie alone writes them all, mixed with other
    sources ``magpie_share`` of them (rounded), none without it."""
    chosen = [part.strip() for part in sources.split(",")]
    if "magpie" not in chosen:
        return count, 0
    if chosen == ["magpie"]:
        return 0, count
    magpie = round(count * magpie_share)
    return count - magpie, magpie


def regen_key(model_id: str, prompts: list[str], max_new_tokens: int, batch_size: int, dtype: str) -> str:
    """The cache key of a regenerated set: model, prompts, generation settings."""
    digest = hashlib.sha256()
    for part in (model_id, CORPUS_SHA256, str(max_new_tokens), str(batch_size), dtype, "greedy-v1"):
        digest.update(part.encode() + b"\0")
    for prompt in prompts:
        digest.update(prompt.encode() + b"\0")
    return digest.hexdigest()[:12]


def regen_path(
    cache_dir: Path, model_id: str, prompts: list[str], max_new_tokens: int, batch_size: int, dtype: str
) -> Path:
    """Where the in-process regenerated set of these settings is (or will be) kept."""
    return (
        cache_dir / "regen" / f"regen-{regen_key(model_id, prompts, max_new_tokens, batch_size, dtype)}.jsonl"
    )


def server_regen_folder(cache_dir: Path, model_id: str, prompts: list[str], max_new_tokens: int) -> Path:
    """Where the set regenerated through servers is kept (``regen.jsonl`` as the replies came,
    ``complete`` when whole, ``SERVER_REGEN_FILE``: the replies in the prompts' order)."""
    return cache_dir / "regen" / f"server-{regen_key(model_id, prompts, max_new_tokens, 0, 'server')}"


MAGPIE_DEFAULTS = MagpieSettings()

# The replies in the prompts' order: servers answer concurrently, so ``regen.jsonl`` (append-only,
# for the resume) holds them in the order they came back. The trainer reads this one, in the same
# order as the in-process path writes, so a run's held-out prompts are the same whichever wrote it.
SERVER_REGEN_FILE = "regen-ordered.jsonl"


def _write_in_prompt_order(inputs: Path, replies: Path, dest: Path) -> None:
    lines = inputs.read_text(encoding="utf-8").splitlines()
    order = [json.loads(line)["id"] for line in lines if line.strip()]
    by_id = {}
    for line in replies.read_text(encoding="utf-8").splitlines():
        if line.strip():
            by_id[json.loads(line)["_regen_id"]] = line
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(by_id[rid] + "\n" for rid in order), encoding="utf-8")
    tmp.replace(dest)


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[int], None] = lambda _done: None,
) -> list[str]:
    """The target's greedy reply to each prompt (a user turn, rendered with its chat template).

    ``progress(units)``: called after every generated token, cumulative, each prompt counting
    ``max_new_tokens`` units (a reply that ends early at its EOS completes its share when its
    batch ends), so the total is ``len(prompts) * max_new_tokens`` before anything is generated."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Tokens(StoppingCriteria):
        """Never stops generation; reports the batch's generated tokens after each one."""

        def __init__(self, base: int, rows: int, prompt_len: int) -> None:
            self.base, self.rows, self.prompt_len = base, rows, prompt_len

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_kw: object) -> torch.Tensor:
            new = min(input_ids.shape[1] - self.prompt_len, max_new_tokens)
            progress(self.base + self.rows * new)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad_token is None:  # some transformers versions give the GGUF tokenizer none; padding needs one
        tokenizer.pad_token_id = pad
    replies: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts[start : start + batch_size]
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            counter = _Tokens(len(replies) * max_new_tokens, len(texts), enc["input_ids"].shape[1])
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    stopping_criteria=StoppingCriteriaList([counter]),
                )
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                if eos in row:
                    row = row[: row.index(eos)]
                replies.append(tokenizer.decode(row, skip_special_tokens=True))
            progress(len(replies) * max_new_tokens)
    finally:
        tokenizer.padding_side = side
        if pad_token is None:
            tokenizer.pad_token = None
    return replies


def regenerated_data(
    cache_dir: Path,
    model_id: str,
    load: Callable[[], tuple[Any, Any]],
    *,
    count: int,
    max_new_tokens: int,
    batch_size: int,
    dtype: str,
    sources: str = "stdlib",
    magpie: MagpieSettings = MAGPIE_DEFAULTS,
    magpie_share: float = 0.5,
    echo: Callable[[str], None] = print,
) -> Path:
    """The JSONL of the regenerated set (built once: ``load()`` gives (model, tokenizer)); its
    progress in tokens (``training.progress``)."""
    loaded: list[tuple[Any, Any]] = []

    def target() -> tuple[Any, Any]:
        if not loaded:
            with Progress("load_data", "loading the target to regenerate the data", 1, "models"):
                loaded.append(load())
        return loaded[0]

    shipped, written = source_counts(count, sources, magpie_share)
    prompts = shipped_prompts(shipped, sources)
    if written:
        where = magpie_path(cache_dir, model_id, written, magpie, sampled_how(batch_size, dtype, False))
        prompts += magpie_prompts(
            where,
            written,
            magpie,
            lambda: user_turn(target()[1]),
            lambda turn: (sample_in_process(*target(), turn, magpie, batch_size), batch_size),
            echo,
        )
    if not prompts:
        raise ValueError("data.regen_prompts: no prompts (must be >= 1)")
    path = regen_path(cache_dir, model_id, prompts, max_new_tokens, batch_size, dtype)
    if path.is_file():
        return path
    model, tokenizer = target()
    echo(f"Regenerating the data: {len(prompts)} prompts, greedy replies of <= {max_new_tokens} tokens")
    started = time.monotonic()
    what = f"regenerating the data ({len(prompts)} greedy replies)"
    with Progress("load_data", what, len(prompts) * max_new_tokens, "tokens", echo=echo) as progress:
        replies = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size, progress.update)
    echo(f"  generated in {time.monotonic() - started:.1f}s -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            for prompt, reply in zip(prompts, replies, strict=True):
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
                handle.write(json.dumps({"messages": messages}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    finally:  # a stop or an error while writing leaves no temp file
        tmp.unlink(missing_ok=True)
    return path


def server_regenerated_data(
    cache_dir: Path,
    model_id: str,
    *,
    count: int,
    max_new_tokens: int,
    servers: str,
    concurrency: int,
    sources: str = "stdlib",
    magpie: MagpieSettings = MAGPIE_DEFAULTS,
    magpie_share: float = 0.5,
    turn: Callable[[], UserTurn] | None = None,
    echo: Callable[[str], None] = print,
) -> Path:
    """The regenerated set written by OpenAI-compatible servers of the target
    (``training.data.engine_regen``): the same shipped prompts, greedy replies of at most
    ``max_new_tokens`` tokens, as SpecForge conversations. Kept under the cache root keyed on the
    model and the prompts; an interrupted or failed regeneration resumes with what is done, and the
    file is used once every prompt has a reply. Magpie's requests (``sources``) are sampled
    through the same servers, from the user-turn prefix ``turn()`` gives (the target's tokenizer)."""
    from training.data.engine_regen import RegenError, RegenSettings, answering, base_url, regenerate_file

    addresses = tuple(a.strip() for a in servers.replace(" ", ",").split(",") if a.strip())
    shipped, written = source_counts(count, sources, magpie_share)
    prompts = shipped_prompts(shipped, sources)
    if written:
        if turn is None:
            raise ValueError("data.regen_sources: 'magpie' through servers needs the target's tokenizer")

        def sampler(frame: UserTurn) -> tuple[Callable[[int, int], list[Sample]], int]:
            urls = answering([base_url(a) for a in addresses])
            if not urls:
                raise RegenError(
                    f"data.regen_servers: none of the servers answers ({', '.join(addresses)}); start "
                    "them, check the addresses (as this machine sees them), then run again"
                )
            return sample_from_servers(urls, frame, magpie, concurrency), concurrency * len(urls)

        where = magpie_path(cache_dir, model_id, written, magpie, sampled_how(0, "", True))
        prompts += magpie_prompts(where, written, magpie, turn, sampler, echo)
    if not prompts:
        raise ValueError("data.regen_prompts: no prompts (must be >= 1)")
    folder = server_regen_folder(cache_dir, model_id, prompts, max_new_tokens)
    output, complete, ordered = folder / "regen.jsonl", folder / "complete", folder / SERVER_REGEN_FILE
    if complete.is_file():
        if not ordered.is_file():
            _write_in_prompt_order(folder / "prompts.jsonl", output, ordered)
        return ordered
    folder.mkdir(parents=True, exist_ok=True)
    inputs = folder / "prompts.jsonl"
    if not inputs.is_file():
        tmp = folder / f".prompts.{os.getpid()}.tmp"
        tmp.write_text(
            "".join(
                json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": p}]}) + "\n"
                for i, p in enumerate(prompts)
            ),
            encoding="utf-8",
        )
        tmp.replace(inputs)
    where = ", ".join(addresses)
    echo(f"Regenerating the data through {where}: {len(prompts)} prompts, <= {max_new_tokens} tokens")
    settings = RegenSettings(
        servers=addresses,
        max_tokens=max_new_tokens,
        temperature=0.0,
        concurrency=concurrency,
        retries=3,
        retry_errors=True,
    )
    what = f"regenerating the data through {where} ({len(prompts)} replies)"
    with Progress("load_data", what, len(prompts), "replies", echo=echo) as progress:
        result = regenerate_file(inputs, output, settings, quiet=True, on_done=progress.update)
    echo(result.text())
    if result.error or result.skipped or not result.balanced:
        error_path = output.with_name("regen_error.jsonl")
        raise RegenError(
            f"data.regen_servers: {result.error} of {result.input_records} prompts failed "
            f"({', '.join(sorted(result.errors_by_kind)) or 'see the files'}; {error_path}); the "
            f"{result.success} replies are kept: fix the servers and start again (failed ones are retried)"
        )
    _write_in_prompt_order(inputs, output, ordered)
    complete.write_text(f"{result.success}\n", encoding="utf-8")
    return ordered
