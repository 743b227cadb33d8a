"""What a DDTree budget costs on the target's own device, and which budget pays (a model).

DDTree's speedup is tau(B) target tokens per round against what a round costs. With the
target's one-token decode step ``t_step`` (what plain decoding pays per token), the drafter's
proposal ``t_draft`` and the verify forward ``t_verify(B)`` of the root plus ``B`` tree nodes,
the modelled speedup over decoding with the target alone is

    speedup(B) = tau(B) * t_step / (t_draft + t_verify(B))

(the paper's Fig. 3 trade-off: tau rises with B, the verify's cost too; arXiv 2604.12989 and
``liranringel/ddtree`` ``ddtree.py`` ``ddtree_generate``; CaDDTree's ``profile_verify_latency.py``
times the verify the same way: a cached forward of n tokens). It is labelled modelled everywhere:
no engine ran the tree, the times come from transformers' eager forward, batch 1.

``measure_tree_cost`` times, after ``warmup`` untimed calls, the median of ``repeats`` (CUDA
events and a synchronize on a GPU, ``perf_counter`` on the CPU), over a KV cache of ``context``
random tokens (the eval's context: ``eval_context``):

- ``t_step``: one token with the cache (the target's decode step);
- ``t_draft``: the drafter's proposal for one round: its block forward over the ``context``
  positions' target hidden states (re-fused every round: this drafter keeps no KV cache of its
  own, so on long contexts an engine's cached drafter pays less) + lm_head + top-K
  (``training.run.tree.draft_topk``, K = the largest budget) brought to the host, under the
  device's autocast (bf16 on a GPU, as the drafter trains). The tree's heap (a CPU loop, C++
  in engines) is not timed;
- ``t_verify(B)``, B > 0: one forward of ``1 + B`` tokens, the root and the nodes of a tree built
  by ``build_tree`` from the drafter's own top-K at this context (the representative shape: a
  trained drafter's tree is deeper, an untrained one's wider; the mask's cost does not depend on
  the shape), with the ancestor-only 4D mask (``tree_attention_mask``) at positions
  ``start + depth`` (``tree_position_ids``), as ``compile_ddtree_tree`` feeds the reference's
  SDPA target;
- ``t_verify(0)``: the chain, DFlash's verify: one causal forward of ``block_size`` tokens (the
  anchor and its ``block_size - 1`` drafts), no 4D mask. Budget 0 is the chain in every table.

Hybrid targets (Qwen3.5/3.6: ``layer_types`` with ``linear_attention``): transformers' forward
cannot run a tree through the Gated DeltaNet layers (their recurrent state would mix siblings;
an engine needs a tree-aware GDN kernel: per-node conv windows from the ancestors and the state
from the parent). The verify is modelled as the forward an engine would run: the 4D tree mask
on the full-attention layers (passed as the model's per-layer-type mask mapping, the
linear-attention entry None, which is what ``create_recurrent_attention_mask`` gives a 4D mask)
and the linear-attention layers over the ``1 + B`` tokens in order, the token count a tree-aware
kernel processes, its state not branched. The logits are wrong, the time is the point; and it is
a lower bound: a chain-shaped proxy underestimates the GDN tree kernel (its per-node state
gathers and the engine's state snapshot/replay on commit are not in it).

The cache is copied before each timed call (untimed) so every call sees ``context`` tokens:
a hybrid's linear-attention state cannot be cropped back.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from training.config import EvalSection
from training.model.drafter import DFlashDrafter, target_context
from training.model.target import layer_types
from training.run.core import autocast_dtype
from training.run.eval import _cache_arg, _device_of
from training.run.tree import build_tree, draft_topk, tree_attention_mask, tree_position_ids

CHAIN = 0  # the budget that means DFlash's chain (block_size tokens, causal)
TREE_COST_BUDGETS = EvalSection().tree_cost_budgets


def eval_context(cfg: EvalSection) -> int:
    """The KV cache a tree is verified over in the eval: the prompt plus half of the generation
    (the mean context of its rounds)."""
    return cfg.prompt_tokens + cfg.max_new_tokens // 2


@dataclass(frozen=True)
class TreeCost:
    """The measured costs of one round (seconds) on ``device`` at ``context`` tokens of cache."""

    device: str
    context: int
    t_step_s: float
    t_draft_s: float
    t_verify_s: Mapping[int, float]  # budget -> seconds; 0 = the chain (block_size tokens)
    block_size: int
    method: str = ""
    tree_sizes: Mapping[int, int] = field(default_factory=dict)  # budget -> nodes of the timed tree

    def round_s(self, budget: int) -> float:
        """One round at ``budget``: the proposal and the verify."""
        return self.t_draft_s + self.t_verify_s[budget]

    def speedups(self, taus: Mapping[int, float]) -> dict[int, float]:
        """Modelled speedup over the target alone at every budget both measured and in ``taus``
        (tau per round, the chain's at 0): tau * t_step / (t_draft + t_verify)."""
        return {
            budget: taus[budget] * self.t_step_s / self.round_s(budget)
            for budget in sorted(self.t_verify_s)
            if budget in taus
        }

    def best(self, taus: Mapping[int, float]) -> tuple[int, float] | None:
        """(budget, speedup) of the highest modelled speedup; a tie goes to the smaller budget
        (the cheaper tree); None when no budget has a tau."""
        ranked = sorted(self.speedups(taus).items(), key=lambda item: (-item[1], item[0]))
        return ranked[0] if ranked else None

    def break_even(self) -> dict[int, float]:
        """Per budget, the tau at which its modelled speedup is 1: below it the tree is slower
        than the target alone."""
        return {budget: self.round_s(budget) / self.t_step_s for budget in sorted(self.t_verify_s)}

    def to_json(self, taus: Mapping[int, float] | None = None) -> dict[str, Any]:
        """The ``eval`` event's ``tree_cost`` (training/EVENTS.md): budgets as string keys."""
        data: dict[str, Any] = {
            "device": self.device,
            "context": self.context,
            "block_size": self.block_size,
            "t_step_s": self.t_step_s,
            "t_draft_s": self.t_draft_s,
            "t_verify_s": {str(b): s for b, s in sorted(self.t_verify_s.items())},
            "break_even_tau": {str(b): t for b, t in self.break_even().items()},
            "model": self.method,
        }
        if taus is not None:
            best = self.best(taus)
            data["speedup"] = {str(b): x for b, x in self.speedups(taus).items()}
            data["best_budget"] = best[0] if best else None
            data["best_speedup"] = best[1] if best else None
        return data

    def table(self, taus: Mapping[int, float] | None = None, sizes: Mapping[int, float] | None = None) -> str:
        """The text table: budget, tau, x chain, tree size, t_verify ms, modelled speedup; the best
        budget marked. ``sizes``: each budget's mean tree size (default: the measured tree's)."""
        taus = taus or {}
        sizes = {**self.tree_sizes, **(sizes or {})}
        speed = self.speedups(taus)
        best = self.best(taus)
        chain = taus.get(CHAIN)
        head = (
            f"DDTree cost on {self.device}, context {self.context}: t_step {1e3 * self.t_step_s:.2f} ms, "
            f"t_draft {1e3 * self.t_draft_s:.2f} ms (modelled speedup = tau x t_step / (t_draft + t_verify))"
        )
        rows = [head, f"{'budget':>8} {'tau':>7} {'x chain':>8} {'tree':>6} {'verify ms':>10} {'speedup':>8}"]
        for budget in sorted({*self.t_verify_s, *taus}):  # measured or evaluated
            tau = taus.get(budget)
            verify = self.t_verify_s.get(budget)
            ratio = f"{tau / chain:.2f}x" if tau is not None and chain else "-"
            size = sizes.get(budget)
            mark = "  <- best" if best is not None and best[0] == budget else ""
            rows.append(
                f"{'chain' if budget == CHAIN else budget:>8} {_fmt(tau, '.3f'):>7} {ratio:>8} "
                f"{_fmt(size, '.0f'):>6} {_fmt(None if verify is None else 1e3 * verify, '.2f'):>10} "
                f"{_fmt(speed.get(budget), '.2f', 'x'):>8}{mark}"
            )
        return "\n".join(rows)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def tree_cost_enabled(setting: str, device: torch.device) -> bool:
    """``eval.tree_cost``: "auto" measures on a GPU only (on the CPU the times say nothing of a
    serving GPU and cost the eval minutes), "on" everywhere, "off" nowhere."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def is_hybrid(target: nn.Module) -> bool:
    """Whether the target has linear-attention (Gated DeltaNet) layers: Qwen3.5/3.6."""
    return "linear_attention" in layer_types(target)


def method_note(target: nn.Module, repeats: int, warmup: int) -> str:
    """How the figures were made, in one line (the event's ``model``)."""
    note = (
        f"modelled: transformers eager forward, batch 1, median of {repeats} after {warmup} warm-up; "
        "verify(B) = 1+B tokens with the ancestor-only 4D mask at positions start+depth; "
        "verify(0) = the chain's block_size causal tokens; draft = block forward over the context "
        "(no drafter cache) + lm_head + top-K"
    )
    if is_hybrid(target):
        note += (
            "; hybrid: tree mask on the full-attention layers, linear-attention layers over the "
            "1+B tokens in order (state not branched): a lower bound of a tree-aware GDN kernel"
        )
    return note


def _timer(
    device: torch.device, repeats: int, warmup: int
) -> Callable[[Callable[[], Any], Callable[[Any], Any]], float]:
    """``time(prepare, run)``: the median seconds of ``run(prepare())`` (``prepare`` untimed)."""

    def measure(prepare: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        seconds: list[float] = []
        for i in range(warmup + repeats):
            arg = prepare()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                start.record()
                run(arg)
                end.record()
                end.synchronize()
                took = start.elapsed_time(end) / 1e3
            else:
                started = time.perf_counter()
                run(arg)
                took = time.perf_counter() - started
            if i >= warmup:
                seconds.append(took)
        return statistics.median(seconds)

    return measure


def _mask_arg(target: nn.Module, mask: Tensor) -> Tensor | dict[str, Tensor | None]:
    """The verify's ``attention_mask``: the 4D tree mask; a hybrid gets the per-layer-type mapping
    with the tree mask on its full-attention layers and none on its linear-attention layers."""
    if is_hybrid(target):
        return {"full_attention": mask, "linear_attention": None}
    return mask


@torch.no_grad()
def measure_tree_cost(
    target: nn.Module,
    drafter: DFlashDrafter,
    context: int,
    budgets: Sequence[int] = TREE_COST_BUDGETS,
    *,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    progress: Callable[[int], None] = lambda _budgets: None,
) -> TreeCost:
    """Time a DDTree round's parts on the target's device (module docstring); ``budgets``
    include 0 for the chain. ``context`` >= 1 random tokens of the target's vocabulary.
    ``progress(n)``: after each budget's verify, the budgets timed so far."""
    if context < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"measure_tree_cost: context={context}, repeats={repeats}, warmup={warmup}")
    if not budgets or any(b < 0 for b in budgets):
        raise ValueError(f"measure_tree_cost: budgets {tuple(budgets)} must be >= 0 (0 = the chain)")
    device = _device_of(target)
    draft_dev = _device_of(drafter)
    dtype = target.get_input_embeddings().weight.dtype
    vocab = int(target.get_input_embeddings().weight.shape[0])
    cache_arg = _cache_arg(target)
    timed = _timer(device, repeats, warmup)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, context + 1), generator=generator).to(device)
    prompt, anchor = ids[:, :context], ids[:, context]
    was_training = drafter.training
    drafter.eval()
    try:
        out = target(input_ids=prompt, output_hidden_states=True, use_cache=True)
        cache = out.get("cache") or out.get("past_key_values")
        hidden = target_context(out.hidden_states, drafter.target_layer_ids).to(draft_dev)
        del out

        def fresh() -> Any:
            return copy.deepcopy(cache)

        def forward(tokens: Tensor, **kwargs: Any) -> Callable[[Any], Any]:
            return lambda c: target(input_ids=tokens, use_cache=True, **{cache_arg: c}, **kwargs)

        t_step = timed(fresh, forward(anchor.view(1, 1)))

        k = max(max(budgets), 1)
        amp = autocast_dtype(draft_dev)
        last = anchor.to(draft_dev)

        def propose(_: Any) -> tuple[Tensor, Tensor]:
            with torch.autocast(draft_dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                logits = drafter.propose_logits(hidden, last)[0]
            top, tokens = draft_topk(logits, k)
            return top.cpu(), tokens.cpu()

        t_draft = timed(lambda: None, propose)
        top, tokens = propose(None)

        verify: dict[int, float] = {}
        sizes: dict[int, int] = {}
        for budget in sorted(set(budgets)):
            tree = build_tree(top, tokens, budget)
            block = torch.cat([anchor.view(1).cpu(), tree.tokens]).view(1, -1).to(device)
            sizes[budget] = tree.size
            if budget == CHAIN:
                run = forward(block)
            else:
                mask = tree_attention_mask(tree, context, dtype, device)
                positions = tree_position_ids(tree, context).to(device)
                run = forward(block, attention_mask=_mask_arg(target, mask), position_ids=positions)
            verify[budget] = timed(fresh, run)
            progress(len(verify))
    finally:
        drafter.train(was_training)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return TreeCost(
        device=name,
        context=context,
        t_step_s=t_step,
        t_draft_s=t_draft,
        t_verify_s=verify,
        block_size=drafter.cfg.block_size,
        method=method_note(target, repeats, warmup),
        tree_sizes=sizes,
    )
