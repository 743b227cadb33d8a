"""Per-depth temperature calibration: the fit recovers a known temperature, and the depth logits
and labels on rows are the drafter's proposal and the target's greedy tokens (independent paths)."""

from __future__ import annotations

import pytest
import torch
from testkit import tiny_qwen3

from training.model.drafter import DFlashDrafter, DrafterConfig, target_context
from training.run.tree_calibration import depth_logits, fit_depth_temperatures, fit_temperature, mean_nll

torch.set_num_threads(1)


def _sampled(temperature: float, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, 40] and labels drawn from softmax(logits / temperature)."""
    logits = 3.0 * torch.randn(n, 40, generator=generator)
    labels = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
    return logits, labels


def test_the_fit_recovers_a_known_temperature_per_depth() -> None:
    g = torch.Generator().manual_seed(0)
    truth = (0.6, 1.0, 2.5)
    parts = [_sampled(t, 6000, g) for t in truth]
    logits = torch.stack([p[0] for p in parts], dim=1)  # [N, 3, V]
    labels = torch.stack([p[1] for p in parts], dim=1)
    valid = torch.ones_like(labels, dtype=torch.bool)
    valid[::2, 2] = False  # depths past a row's end do not count
    fitted = fit_depth_temperatures(logits, labels, valid)
    assert fitted == pytest.approx(truth, rel=0.06)
    # the minimum is the NLL's: a grid around it is no lower
    t = fit_temperature(parts[2][0], parts[2][1])
    best = mean_nll(parts[2][0], parts[2][1], 1 / t)
    assert all(
        best <= mean_nll(parts[2][0], parts[2][1], 1 / (t * f)) + 1e-9 for f in (0.8, 0.95, 1.05, 1.25)
    )
    assert fit_temperature(logits[:0, 0], labels[:0, 0]) == 1.0
    with pytest.raises(ValueError, match=r"must be \[N, L, V\]"):
        fit_depth_temperatures(logits[:, 0], labels, valid)


@torch.no_grad()
def test_depth_logits_are_the_proposal_and_labels_the_targets_greedy_tokens() -> None:
    target = tiny_qwen3()
    cfg = DrafterConfig(
        num_layers=1, block_size=4, full_attention_layers=(0,), num_target_layers=2, mask_token_id=255
    )
    drafter = DFlashDrafter(cfg, target.config, target.get_input_embeddings(), target.get_output_embeddings())
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones_like(ids)
    loss_mask[1, 11] = 0  # the second row's last token is not trained on
    anchors = torch.tensor([[2, 6], [9, -1]])
    logits, labels, valid = depth_logits(target, drafter, [(ids, loss_mask, anchors)], max_anchors=10)
    assert logits.shape == (3, 3, 256) and labels.shape == valid.shape == (3, 3)
    hidden_states = target(input_ids=ids, output_hidden_states=True).hidden_states
    for row, (b, a) in enumerate(((0, 2), (0, 6), (1, 9))):
        context = target_context(hidden_states, drafter.target_layer_ids)[b : b + 1, :a]
        proposal = drafter.propose_logits(context, ids[b, a].view(1))[0]
        torch.testing.assert_close(logits[row], proposal, rtol=1e-4, atol=1e-4)
        for d in range(1, 4):
            if a + d < 12:
                greedy = target(input_ids=ids[b : b + 1, : a + d]).logits[0, -1].argmax()
                assert labels[row, d - 1] == greedy
    # depth d counts where position a + d is in the row and in its loss mask
    assert valid.tolist() == [[True] * 3, [True] * 3, [True, False, False]]
