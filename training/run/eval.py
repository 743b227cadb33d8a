"""Real acceptance length: draft with the drafter, verify greedily with the target.

Training accuracy overstates acceptance (each training block sees the true context);
this measures what speculative decoding would get. Per prompt:

1. Prefill: the target runs on the prompt ``x_0..x_{L-1}`` (``output_hidden_states``);
   its greedy next token ``x_L`` is the first anchor. ``x_L`` has no hidden state yet.
2. Round: the drafter proposes ``d_1..d_{B-1}`` for positions ``L+1..L+B-1`` from the
   target's chosen hidden states of positions ``0..L-1`` and the anchor token ``x_L``
   (``DFlashDrafter.propose``). The target runs on ``prompt + accepted + [x_L, d_1..d_{B-1}]``
   and gives its greedy tokens ``g_1..g_B`` for positions ``L+1..L+B``.
   ``n`` = the longest prefix with ``d_i == g_i`` (0..B-1). The round's acceptance length
   is ``tau = n + 1``: the ``n`` accepted drafts plus the target's bonus token ``g_{n+1}``
   (as in speculative decoding: the verify pass always yields one token). So 1 <= tau <= B.
   ``x_L, d_1..d_n`` join the verified prefix (their hidden states come from this verify
   pass, valid because attention is causal); ``g_{n+1}`` becomes the next anchor.
3. Repeat until ``max_new_tokens`` tokens were produced for the prompt (each round adds
   ``tau``), or the target emits ``eos_token_id`` (an accepted draft or the bonus token;
   a prompt whose prefill token is EOS has no round).

``tau_mean`` is the mean of ``tau`` over all rounds of all prompts (per round);
``tau_prompt_mean`` is each prompt's mean ``tau`` averaged over prompts, as z-lab/dflash's
benchmark reports it (``dflash_generate`` returns a prompt's ``acceptance_lengths``; the figure
is their mean per prompt, then over prompts), so a long generation does not outweigh short
ones. ``hist[i]`` counts the rounds with ``tau == i + 1`` (length B).

The target's KV cache: a target whose every layer is full attention keeps the keys and values of
the verified prefix between rounds and runs only the round's block (``B`` tokens) with them; the
rejected drafts' entries are cut off after the round (``Cache.crop``), as SGLang's and vLLM's
verify step frees them. A hybrid target (Qwen3.5/3.6 Gated DeltaNet layers) or one with sliding
windows is re-run on the whole sequence each round instead: a linear-attention state cannot be
rolled back to the accepted prefix. Either way the chosen hidden states of a verified position come
from the pass that verified it (valid because attention is causal), and the tokens produced are the
target's own greedy continuation (``generated``), which tests/training/run/test_eval.py checks
against ``generate``.

DDTree (``training.run.tree``; Ringel & Romano, arXiv 2604.12989, ``liranringel/ddtree``
``ddtree.py``): ``budgets`` adds, per budget ``B``, the same figures for rounds that verify a tree
of ``B`` drafted nodes instead of the chain (``TreeAcceptance``: tau per round and per prompt, the
histogram, the mean tree size). The chain is budget 0 and stays the figures above. Two ways to the
same figure (``tree_method``):

- ``verify``: each round the drafter's logits of the ``B-1`` positions after the anchor
  (``DFlashDrafter.propose_logits``) give the tree (``draft_topk``, ``build_tree``); the target
  runs ONE forward on root + tree through its KV cache with the ancestor-only 4D mask at positions
  ``start + depth`` (``compile_ddtree_tree``), follows its own greedy tokens down the tree
  (``follow_verified_tree``), keeps the accepted path's keys and values and drops the rest
  (``compact_dynamic_cache``: ``compact_cache``); the path's hidden states extend the drafter's
  context and the bonus token is the next root. transformers hands a 4D mask to SDPA unchanged
  (``masking_utils._preprocess_mask_arguments``: "If the mask is already 4D, simply return as-is";
  read in the dev venv's 5.24, the same early return is in 4.5x releases; the train env's 5.8.1
  not read), but a Gated DeltaNet or sliding-window layer would mix siblings, and FlashAttention
  takes no such mask: only SDPA/eager targets whose every layer is full attention.
- ``replay`` (the default, every target, the Qwen3.5/3.6 hybrid included): at temperature 0 the
  committed tokens are the target's greedy continuation whatever the tree, so a round anchored at
  generated position ``p`` accepts the longest prefix of ``y[p+1:]`` that is a path of its tree
  (``accepted_along``). One teacher-forced target pass over prompt + ``y`` gives every anchor's
  context, one drafter pass over every anchor (``DFlashDrafter.draft_hidden``, the lm_head in
  chunks) its top-``K`` (``K`` = the largest budget), and the rounds are replayed on the host
  for every budget (``replay_acceptance``; ``verify_acceptance`` is the other way). ``y`` is the
  chain's ``generated``, extended by the target's greedy tokens where a budget's last round reads
  further.

On a full-attention target both give the same taus (tests/training/run/test_eval.py), and replay at
budget 0 gives the chain's. Both stop a prompt as the chain does (``max_new_tokens``, EOS). In bf16
(GPU) the replay's one teacher-forced pass gives hidden states a few ulps off the rounds' own, so a
drafter near-tie can flip: replay at budget 0 may then differ from the chain in a few rounds.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from training.config import TREE_METHODS
from training.model.drafter import DFlashDrafter, target_context
from training.run.tree import (
    accepted_along,
    build_tree,
    draft_topk,
    follow_tree,
    tree_attention_mask,
    tree_position_ids,
)

# Elements (float32) of one chunk of the replay's drafter attention scores or lm_head logits: about
# 1 GiB, whatever the vocabulary (Qwen3.6: 248k), the prompt or the number of anchors.
CHUNK_ELEMENTS = 1 << 28
# The target attention implementations a tree's 4D additive mask reaches unchanged (FlashAttention
# cannot express it: DDTree's App. B runs the target on SDPA).
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class AcceptanceResult:
    """Measured acceptance over a set of prompts (definitions in the module docstring)."""

    tau_mean: float  # per round
    hist: tuple[int, ...]  # hist[i] = rounds with tau == i + 1; len == block size
    rounds: int
    prompts: int
    new_tokens: int
    tau_per_prompt: tuple[float, ...] = ()  # each evaluated prompt's mean tau
    tau_prompt_mean: float = 0.0  # mean of tau_per_prompt
    taus: tuple[tuple[int, ...], ...] = ()  # each evaluated prompt's tau of every round, in order
    generated: tuple[tuple[int, ...], ...] = ()  # each evaluated prompt's verified new tokens
    trees: tuple[TreeAcceptance, ...] = ()  # one per DDTree budget asked for, in order


@dataclass(frozen=True)
class TreeAcceptance:
    """Acceptance of DDTree rounds of one budget (the chain's definitions, per round and prompt)."""

    budget: int  # drafted nodes per tree (the root excluded); 0 = the chain
    tau_mean: float  # per round
    tau_prompt_mean: float  # mean of tau_per_prompt
    hist: tuple[int, ...]  # hist[i] = rounds with tau == i + 1; len == block size
    rounds: int
    tree_size_mean: float  # drafted nodes per round (below the budget where the tree runs out)
    tau_per_prompt: tuple[float, ...] = ()
    taus: tuple[tuple[int, ...], ...] = ()  # each evaluated prompt's tau of every round, in order
    generated: tuple[tuple[int, ...], ...] = ()  # each evaluated prompt's verified new tokens


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def keeps_kv_cache(target: Any) -> bool:
    """Whether rounds reuse the target's KV cache: every layer full attention, no sliding window."""
    cfg = getattr(target.config, "text_config", None) or target.config
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return all(kind == "full_attention" for kind in kinds)
    return getattr(cfg, "sliding_window", None) is None


def _cache_arg(target: Any) -> str:
    """The forward's name of the KV cache: ``cache`` from transformers 5.24 (``past_key_values``
    deprecated there), ``past_key_values`` before (the train env pins 5.8)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _target_pass(
    target: Any, ids: Tensor, layer_ids: Sequence[int], cache: Any = None, *, prefill: bool = False
) -> tuple[Tensor, Tensor, Any]:
    """Greedy tokens [T], chosen hidden states [1, T, n*H] of ``ids`` and the KV cache after them.

    ``cache``: the cache of the tokens before ``ids`` (None: ``ids`` is the whole sequence);
    ``prefill``: start a cache (``ids`` is the whole sequence)."""
    use_cache = prefill or cache is not None
    kwargs = {_cache_arg(target): cache} if cache is not None else {}
    out = target(input_ids=ids[None], output_hidden_states=True, use_cache=use_cache, **kwargs)
    greedy = out.logits[0].argmax(dim=-1)
    kept = (out.get("cache") or out.get("past_key_values")) if use_cache else None
    return greedy, target_context(out.hidden_states, layer_ids), kept


@torch.no_grad()
def verify_round(
    target: Any,
    drafter: DFlashDrafter,
    prefix: Tensor,
    hidden: Tensor,
    anchor: Tensor,
    layer_ids: Sequence[int],
    cache: Any = None,
) -> tuple[int, Tensor, Tensor, Tensor]:
    """One draft-and-verify round.

    prefix [L] verified tokens, hidden [1, L, n*H] their chosen hidden states, anchor: the
    token at position L; ``cache``: the target's KV cache of ``prefix`` (None: the target runs
    on the whole sequence), cut back to the new prefix afterwards. Returns (tau, new prefix, its
    hidden states, next anchor).
    """
    bs = drafter.cfg.block_size
    draft_dev = _device_of(drafter)
    draft = drafter.propose(hidden.to(draft_dev), anchor.view(1).to(draft_dev))[0].to(prefix.device)
    block = torch.cat([anchor.view(1), draft])  # positions L..L+B-1
    L = prefix.shape[0]
    if cache is None:
        greedy, seq_hidden, _ = _target_pass(target, torch.cat([prefix, block]), layer_ids)
        greedy, block_hidden = greedy[L:], seq_hidden[:, L:]
    else:
        greedy, block_hidden, _ = _target_pass(target, block, layer_ids, cache)
    g = greedy[:bs]  # g[i] = the target's token for position L+1+i
    match = (draft == g[: bs - 1]).long()
    n = int(match.cumprod(dim=0).sum().item())
    if cache is not None and n + 1 < bs:
        cache.crop(-(bs - n - 1))  # negative: entries to drop (the one form every transformers 5 takes)
    new_prefix = torch.cat([prefix, block[: n + 1]])
    return n + 1, new_prefix, torch.cat([hidden, block_hidden[:, : n + 1]], dim=1), g[n]


def tree_method_problem(target: Any, method: str) -> str | None:
    """Why ``method`` cannot measure DDTree on ``target`` (one line naming the fix), or None."""
    if method not in TREE_METHODS:
        return f"eval.tree_method={method!r}: one of {', '.join(TREE_METHODS)}"
    if method == "verify" and not keeps_kv_cache(target):
        return (
            "eval.tree_method='verify' needs a target whose every layer is full attention (a Gated "
            "DeltaNet state or a sliding window cannot branch into a tree); set eval.tree_method=replay"
        )
    kernel = getattr(target.config, "_attn_implementation", None) or "sdpa"
    if method == "verify" and kernel not in MASKED_ATTENTION:
        return (
            f"eval.tree_method='verify' needs the target's attention to take a 4D mask (sdpa or eager); "
            f"it runs {kernel}; set eval.tree_method=replay"
        )
    return None


def compact_cache(cache: Any, past: int, keep: Sequence[int]) -> None:
    """Keep the verified ``past`` entries and, of the entries after them, those at ``keep``
    (ascending, relative to ``past``), moved to the front in that order; drop the rest.
    ``compact_dynamic_cache`` of the reference, on transformers 5's ``cache.layers[i].keys/values``."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"compact_cache: {type(cache).__name__} has no per-layer keys/values (transformers 5)"
        )
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        index = torch.tensor(list(keep), dtype=torch.long, device=layer.keys.device)
        for name in ("keys", "values"):
            full = getattr(layer, name)
            kept = full.narrow(-2, past, full.shape[-2] - past).index_select(-2, index)
            full.narrow(-2, past, len(keep)).copy_(kept)
            setattr(layer, name, full[..., : past + len(keep), :])


@torch.no_grad()
def tree_round(
    target: Any,
    drafter: DFlashDrafter,
    prefix: Tensor,
    hidden: Tensor,
    anchor: Tensor,
    layer_ids: Sequence[int],
    cache: Any,
    budget: int,
    temperatures: Sequence[float] | None = None,
) -> tuple[int, Tensor, Tensor, Tensor, int]:
    """One DDTree round (``ddtree_generate``'s loop body, greedy): ``verify_round``'s arguments
    (``cache``: the target's KV cache of ``prefix``, required) and the tree's ``budget`` (0 = the
    chain). Returns (tau, new prefix, its hidden states, next anchor, tree size)."""
    start = prefix.shape[0]
    draft_dev, dev = _device_of(drafter), prefix.device
    logits = drafter.propose_logits(hidden.to(draft_dev), anchor.view(1).to(draft_dev))[0]
    tree = build_tree(*draft_topk(logits, max(budget, 1), temperatures), budget)
    ids = torch.cat([anchor.view(1), tree.tokens.to(dev)])
    out = target(
        input_ids=ids[None],
        attention_mask=tree_attention_mask(tree, start, target.dtype, dev),
        position_ids=tree_position_ids(tree, start).to(dev),
        output_hidden_states=True,
        use_cache=True,
        **{_cache_arg(target): cache},
    )
    path, bonus = follow_tree(tree, out.logits[0].argmax(dim=-1))
    compact_cache(cache, start, path)
    keep = torch.tensor(path, dtype=torch.long, device=dev)
    accepted = target_context(out.hidden_states, layer_ids).index_select(1, keep)
    new_prefix = torch.cat([prefix, ids.index_select(0, keep)])
    return (
        len(path),
        new_prefix,
        torch.cat([hidden, accepted], dim=1),
        torch.tensor(bonus, device=dev),
        tree.size,
    )


# One prompt's decoding: (its taus, its tree sizes, its generated tokens), as ``_decode`` returns it.
Decoded = tuple[list[int], list[int], list[int]]


# One round: (tau, the tokens it emits = the accepted drafts and the bonus token, drafted nodes).
Round = Callable[[], tuple[int, list[int], int]]


def _decode(
    first: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    next_round: Round,
    progress: Callable[[int], None] = lambda _produced: None,
) -> Decoded | None:
    """One prompt's rounds until ``max_new_tokens`` were produced or EOS was emitted (the module
    docstring): (taus, tree sizes, generated tokens from the prefill's ``first`` on); None when
    ``first`` is EOS (no round). ``progress(produced)`` after every round."""
    if eos_token_id is not None and first == eos_token_id:
        return None
    taus: list[int] = []
    sizes: list[int] = []
    generated = [first]
    while len(generated) - 1 < max_new_tokens:
        tau, emitted, size = next_round()
        taus.append(tau)
        sizes.append(size)
        generated.extend(emitted)
        progress(min(len(generated) - 1, max_new_tokens))
        if eos_token_id is not None and eos_token_id in emitted:
            break
    return taus, sizes, generated


class _Decoding:
    """One prompt being decoded against the target: the verified prefix, its chosen hidden states,
    the anchor and the target's KV cache (None: re-run on the whole sequence every round)."""

    def __init__(
        self, target: Any, drafter: DFlashDrafter, prompt: list[int], layer_ids: Sequence[int], cached: bool
    ) -> None:
        self.target, self.drafter, self.layer_ids = target, drafter, layer_ids
        self.prefix = torch.tensor(prompt, dtype=torch.long, device=_device_of(target))
        greedy, self.hidden, self.cache = _target_pass(target, self.prefix, layer_ids, prefill=cached)
        self.anchor = greedy[-1]

    def _emitted(self, tau: int) -> list[int]:
        return [*self.prefix[self.prefix.shape[0] - (tau - 1) :].tolist(), int(self.anchor.item())]

    def chain(self) -> tuple[int, list[int], int]:
        tau, self.prefix, self.hidden, self.anchor = verify_round(
            self.target, self.drafter, self.prefix, self.hidden, self.anchor, self.layer_ids, self.cache
        )
        return tau, self._emitted(tau), self.drafter.cfg.block_size - 1

    def tree(self, budget: int, temperatures: Sequence[float] | None) -> tuple[int, list[int], int]:
        tau, self.prefix, self.hidden, self.anchor, size = tree_round(
            self.target,
            self.drafter,
            self.prefix,
            self.hidden,
            self.anchor,
            self.layer_ids,
            self.cache,
            budget,
            temperatures,
        )
        return tau, self._emitted(tau), size


def _summarise(budget: int, runs: Sequence[Decoded], block_size: int) -> TreeAcceptance:
    """The figures of the prompts' ``_decode`` results (the prompts without a round left out)."""
    hist = [0] * block_size
    for taus, _, _ in runs:
        for tau in taus:
            hist[tau - 1] += 1
    rounds = sum(hist)
    per_prompt = tuple(sum(taus) / len(taus) for taus, _, _ in runs)
    return TreeAcceptance(
        budget=budget,
        tau_mean=sum((i + 1) * c for i, c in enumerate(hist)) / max(rounds, 1),
        tau_prompt_mean=sum(per_prompt) / max(len(per_prompt), 1),
        hist=tuple(hist),
        rounds=rounds,
        tree_size_mean=sum(sum(sizes) for _, sizes, _ in runs) / max(rounds, 1),
        tau_per_prompt=per_prompt,
        taus=tuple(tuple(taus) for taus, _, _ in runs),
        generated=tuple(tuple(generated) for _, _, generated in runs),
    )


def _teacher_forced(
    target: Any, prompt: list[int], continuation: list[int], anchors: int, need: int, layer_ids: Sequence[int]
) -> tuple[list[int], Tensor]:
    """The continuation extended by the target's greedy tokens to ``need`` tokens, and the chosen
    hidden states [1, len(prompt) + anchors, n*H] of prompt + continuation from one pass."""
    ids = torch.tensor([*prompt, *continuation], dtype=torch.long, device=_device_of(target))
    context = len(prompt) + anchors
    if len(continuation) >= need:
        _, hidden, _ = _target_pass(target, ids[:context], layer_ids)
        return continuation, hidden
    greedy, hidden, cache = _target_pass(target, ids, layer_ids, prefill=True)
    extended = [*continuation, int(greedy[-1].item())]
    while len(extended) < need:  # a few greedy steps through the cache (any target: no rollback)
        greedy, _, cache = _target_pass(target, greedy[-1:], layer_ids, cache)
        extended.append(int(greedy[-1].item()))
    return extended, hidden[:, :context]


@torch.no_grad()
def anchor_topk(
    drafter: DFlashDrafter,
    hidden: Tensor,
    tokens: Sequence[int],
    start: int,
    k: int,
    temperatures: Sequence[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Every anchor's top-``k`` drafts at once: anchor ``p`` is the token ``tokens[p]`` at position
    ``start + p``, its context the target's chosen hidden states ``hidden[:, :start + p]``
    ([1, >= start + len(tokens) - 1, n*H]). Returns ``draft_topk`` of the drafter's logits of
    every anchor, [len(tokens), B-1, min(k, V)] float32 and long, on the CPU. Chunked: the
    attention scores of a chunk of anchors and the lm_head logits of a chunk of blocks stay
    within ``CHUNK_ELEMENTS``."""
    dev = _device_of(drafter)
    bs = drafter.cfg.block_size
    vocab = int(drafter.lm_head.weight.shape[0])
    heads = max(layer.self_attn.heads for layer in drafter.layers)
    total = start + len(tokens)
    per_pass = max(1, CHUNK_ELEMENTS // (bs * (total + bs) * heads))
    per_head = max(1, CHUNK_ELEMENTS // ((bs - 1) * vocab))
    top_lp: list[Tensor] = []
    top_tok: list[Tensor] = []
    for lo in range(0, len(tokens), per_pass):
        hi = min(lo + per_pass, len(tokens))
        anchors = torch.arange(start + lo, start + hi, device=dev)[None]
        firsts = torch.tensor(list(tokens[lo:hi]), dtype=torch.long, device=dev)[None]
        context = hidden[:, : start + hi - 1].to(dev)
        blocks = drafter.draft_hidden(context, firsts, anchors)[0]  # [anchors, B-1, H]
        for sub in range(0, blocks.shape[0], per_head):
            logits = drafter.lm_head(blocks[sub : sub + per_head].to(drafter.lm_head.weight.dtype))
            lp, tok = draft_topk(logits, k, temperatures)
            top_lp.append(lp.cpu())
            top_tok.append(tok.cpu())
    return torch.cat(top_lp), torch.cat(top_tok)


@torch.no_grad()
def replay_acceptance(
    target: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[list[int]],
    generated: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    budgets: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    temperatures: Sequence[float] | None = None,
) -> tuple[TreeAcceptance, ...]:
    """DDTree acceptance of every budget by greedy replay (the module docstring), one
    ``TreeAcceptance`` per budget (0 = the chain). ``generated[i]``: prompt ``i``'s greedy
    continuation from the prefill's token on (``_decode``'s, e.g. the chain's; at least that
    token; extended here where a round reads past it)."""
    if len(generated) != len(prompts) or any(len(g) == 0 for g in generated):
        raise ValueError("replay_acceptance: one non-empty continuation per prompt")
    depth = drafter.cfg.block_size - 1
    k = max([1, *budgets])
    runs: dict[int, list[Decoded]] = {b: [] for b in budgets}
    was_training = drafter.training
    drafter.eval()
    try:
        for prompt, given in zip(prompts, generated, strict=True):
            continuation = list(given)
            if eos_token_id is not None and continuation[0] == eos_token_id:
                continue
            stop = continuation.index(eos_token_id) if eos_token_id in continuation else None
            anchors = max_new_tokens if stop is None else min(stop, max_new_tokens)
            y, hidden = _teacher_forced(target, prompt, continuation, anchors, anchors + depth + 1, layer_ids)
            top_lp, top_tok = anchor_topk(drafter, hidden, y[:anchors], len(prompt), k, temperatures)
            for budget in budgets:
                runs[budget].append(_replay(top_lp, top_tok, y, budget, max_new_tokens, eos_token_id))
    finally:
        drafter.train(was_training)
    return tuple(_summarise(b, runs[b], depth + 1) for b in budgets)


def _replay(
    top_lp: Tensor, top_tok: Tensor, y: list[int], budget: int, max_new_tokens: int, eos_token_id: int | None
) -> Decoded:
    """One prompt's rounds of one budget on the host: the round anchored at ``y[p]`` accepts the
    longest path of its tree that ``y[p+1:]`` follows, plus the bonus token."""
    depth = top_tok.shape[1]
    cursor = [0]

    def next_round() -> tuple[int, list[int], int]:
        p = cursor[0]
        tree = build_tree(top_lp[p], top_tok[p], budget)
        tau = accepted_along(tree, y[p + 1 : p + 1 + depth]) + 1
        cursor[0] = p + tau
        return tau, y[p + 1 : p + 1 + tau], tree.size

    decoded = _decode(y[0], max_new_tokens, eos_token_id, next_round)
    assert decoded is not None  # the caller skips a prompt whose first token is EOS
    return decoded


@torch.no_grad()
def evaluate_acceptance(
    target: Any,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    target_layer_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    progress: Callable[[int], None] = lambda _done: None,
    kv_cache: bool | None = None,
    budgets: Sequence[int] = (),
    tree_method: str = "replay",
    temperatures: Sequence[float] | None = None,
) -> AcceptanceResult:
    """Mean real acceptance length of ``drafter`` against the greedy ``target`` (module docstring).

    ``target``: a transformers causal LM (``output_hidden_states`` supported), in eval mode.
    ``target_layer_ids``: the layers the drafter was trained on (``drafter.target_layer_ids``).
    ``progress(units)``: after every round of the chain, cumulative, each prompt counting
    ``max_new_tokens`` units (one that ends early at EOS completes its share), of
    ``len(prompts) * max_new_tokens``; the trees come after it.
    ``kv_cache``: keep the target's KV cache between rounds (None: where ``keeps_kv_cache``).
    ``budgets``: DDTree budgets (>= 0) measured besides the chain (``trees``), by ``tree_method``
    (``replay`` or ``verify``); ``temperatures``: per depth, divide the drafter's logits before its
    tree is built (``draft_topk``).
    """
    if max_new_tokens < 1:
        raise ValueError(f"evaluate_acceptance: max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("evaluate_acceptance: prompts must be a non-empty list of non-empty token lists")
    if any(b < 0 for b in budgets):
        raise ValueError(f"evaluate_acceptance: budgets {list(budgets)} must be >= 0")
    if budgets and (problem := tree_method_problem(target, tree_method)):
        raise ValueError(problem)
    bs = drafter.cfg.block_size
    cached = keeps_kv_cache(target) if kv_cache is None else kv_cache
    runs: list[Decoded] = []
    continuations: list[list[int]] = []  # every prompt's, for the replay
    was_training = drafter.training
    drafter.eval()
    try:
        for index, prompt in enumerate(prompts):
            progress(index * max_new_tokens)
            state = _Decoding(target, drafter, prompt, target_layer_ids, cached)

            def done(produced: int, offset: int = index * max_new_tokens) -> None:
                progress(offset + produced)

            decoded = _decode(int(state.anchor.item()), max_new_tokens, eos_token_id, state.chain, done)
            continuations.append(decoded[2] if decoded else [int(state.anchor.item())])
            if decoded is not None:
                runs.append(decoded)
        progress(len(prompts) * max_new_tokens)
        trees: tuple[TreeAcceptance, ...] = ()
        if budgets and tree_method == "replay":
            trees = replay_acceptance(
                target,
                drafter,
                prompts,
                continuations,
                target_layer_ids,
                budgets,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                temperatures=temperatures,
            )
        elif budgets:
            trees = verify_acceptance(
                target,
                drafter,
                prompts,
                target_layer_ids,
                budgets,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                temperatures=temperatures,
            )
    finally:
        drafter.train(was_training)
    chain = _summarise(0, runs, bs)
    return AcceptanceResult(
        tau_mean=chain.tau_mean,
        hist=chain.hist,
        rounds=chain.rounds,
        prompts=len(prompts),
        new_tokens=sum(len(generated) - 1 for _, _, generated in runs),
        tau_per_prompt=chain.tau_per_prompt,
        tau_prompt_mean=chain.tau_prompt_mean,
        taus=chain.taus,
        generated=chain.generated,
        trees=trees,
    )


@torch.no_grad()
def verify_acceptance(
    target: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[list[int]],
    layer_ids: Sequence[int],
    budgets: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    temperatures: Sequence[float] | None = None,
) -> tuple[TreeAcceptance, ...]:
    """DDTree acceptance of every budget by tree verification through the target's KV cache (the
    module docstring): one decode of every prompt per budget (0 = the chain as a tree). ``target``:
    one ``tree_method_problem`` accepts for ``verify``."""
    if problem := tree_method_problem(target, "verify"):
        raise ValueError(problem)
    was_training = drafter.training
    drafter.eval()
    try:
        results = []
        for budget in budgets:
            runs = []
            for prompt in prompts:
                state = _Decoding(target, drafter, prompt, layer_ids, cached=True)
                decoded = _decode(
                    int(state.anchor.item()),
                    max_new_tokens,
                    eos_token_id,
                    lambda state=state, budget=budget: state.tree(budget, temperatures),
                )
                if decoded is not None:
                    runs.append(decoded)
            results.append(_summarise(budget, runs, drafter.cfg.block_size))
    finally:
        drafter.train(was_training)
    return tuple(results)


def tree_records(result: AcceptanceResult) -> list[dict[str, Any]]:
    """The eval event's ``tree``: one object per budget (training/contract.py ``TREE_FIELDS``)."""
    return [
        {
            "budget": t.budget,
            "tau_mean": t.tau_mean,
            "tau_prompt_mean": t.tau_prompt_mean,
            "hist": list(t.hist),
            "rounds": t.rounds,
            "tree_size_mean": t.tree_size_mean,
        }
        for t in result.trees
    ]


def tree_summary(result: AcceptanceResult) -> str:
    """``tree tau 16:3.59 64:4.15`` (per round) for the eval line; "" without budgets."""
    if not result.trees:
        return ""
    return "tree tau " + " ".join(f"{t.budget}:{t.tau_mean:.2f}" for t in result.trees)


def tree_table(result: AcceptanceResult) -> str:
    """Per budget: tau per round and per prompt, its ratio to the chain's, the mean tree size."""
    rows = [("budget", "tau", "tau/prompt", "x chain", "tree size")]
    rows.append(("chain", f"{result.tau_mean:.3f}", f"{result.tau_prompt_mean:.3f}", "1.000", ""))
    for t in result.trees:
        ratio = t.tau_mean / result.tau_mean if result.tau_mean else 0.0
        rows.append(
            (
                str(t.budget),
                f"{t.tau_mean:.3f}",
                f"{t.tau_prompt_mean:.3f}",
                f"{ratio:.3f}",
                f"{t.tree_size_mean:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
