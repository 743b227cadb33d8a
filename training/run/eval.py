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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from training.model.drafter import DFlashDrafter, target_context


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
) -> AcceptanceResult:
    """Mean real acceptance length of ``drafter`` against the greedy ``target`` (module docstring).

    ``target``: a transformers causal LM (``output_hidden_states`` supported), in eval mode.
    ``target_layer_ids``: the layers the drafter was trained on (``drafter.target_layer_ids``).
    ``progress(units)``: after every round, cumulative, each prompt counting ``max_new_tokens``
    units (one that ends early at EOS completes its share), of ``len(prompts) * max_new_tokens``.
    ``kv_cache``: keep the target's KV cache between rounds (None: where ``keeps_kv_cache``).
    """
    if max_new_tokens < 1:
        raise ValueError(f"evaluate_acceptance: max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("evaluate_acceptance: prompts must be a non-empty list of non-empty token lists")
    bs = drafter.cfg.block_size
    hist = [0] * bs
    new_tokens = 0
    per_prompt: list[float] = []
    every_round: list[tuple[int, ...]] = []
    generated: list[tuple[int, ...]] = []
    cached = keeps_kv_cache(target) if kv_cache is None else kv_cache
    was_training = drafter.training
    drafter.eval()
    try:
        dev = _device_of(target)
        for index, prompt in enumerate(prompts):
            progress(index * max_new_tokens)
            prefix = torch.tensor(prompt, dtype=torch.long, device=dev)
            greedy, hidden, cache = _target_pass(target, prefix, target_layer_ids, prefill=cached)
            anchor = greedy[-1]
            produced = 0
            taus: list[int] = []
            if eos_token_id is not None and int(anchor.item()) == eos_token_id:
                continue
            while produced < max_new_tokens:
                tau, prefix, hidden, anchor = verify_round(
                    target, drafter, prefix, hidden, anchor, target_layer_ids, cache
                )
                hist[tau - 1] += 1
                taus.append(tau)
                produced += tau
                progress(index * max_new_tokens + min(produced, max_new_tokens))
                emitted = prefix[-(tau - 1) :] if tau > 1 else prefix[:0]
                if eos_token_id is not None and (
                    int(anchor.item()) == eos_token_id or bool((emitted == eos_token_id).any())
                ):
                    break
            new_tokens += produced
            per_prompt.append(sum(taus) / len(taus))
            every_round.append(tuple(taus))
            generated.append((*prefix[len(prompt) :].tolist(), int(anchor.item())))
        progress(len(prompts) * max_new_tokens)
    finally:
        drafter.train(was_training)
    rounds = sum(hist)
    tau_mean = sum((i + 1) * c for i, c in enumerate(hist)) / max(rounds, 1)
    return AcceptanceResult(
        tau_mean=tau_mean,
        hist=tuple(hist),
        rounds=rounds,
        prompts=len(prompts),
        new_tokens=new_tokens,
        tau_per_prompt=tuple(per_prompt),
        tau_prompt_mean=sum(per_prompt) / max(len(per_prompt), 1),
        taus=tuple(every_round),
        generated=tuple(generated),
    )
