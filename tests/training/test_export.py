"""The exported drafter is the trained drafter: an independent forward over the folder matches.

``reference_logits`` below re-implements the reference drafter forward from the exported folder
alone (config.json + model.safetensors read with json/safetensors, nothing of ``training/``),
following z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel.forward``,
``Qwen3DFlashAttention``, ``_attention_mask``) and its decoding loop ``dflash_generate``: the
context is the fused target hidden states of positions ``0..a-1`` (``fc`` + ``hidden_norm``),
the block ``[x_a, MASK x (B-1)]`` is embedded by the target's table at positions ``a..a+B-1``,
every layer's keys/values are ``[context ; block]`` with per-head q/k RMSNorm and rotate-half
RoPE, a ``full_attention`` layer attends both ways and a ``sliding_attention`` layer causally
within ``query_pos - key_pos < sliding_window``; final ``norm``, then the target's lm_head.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(2)
REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the independent forward
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, heads, d] at integer positions pos [N] (rotate-half / neox layout)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_logits(
    folder: Path,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    hidden_states: tuple[torch.Tensor, ...],
    ids: list[int],
    anchor: int,
) -> torch.Tensor:
    """Logits [B, vocab] of the block anchored at ``anchor`` (``hidden_states``: the target's
    ``output_hidden_states`` of ``ids``, batch 1)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    dflash = cfg["dflash_config"]
    eps, theta, bs = cfg["rms_norm_eps"], cfg["rope_theta"], dflash["block_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    feats = torch.cat([hidden_states[i + 1][0] for i in dflash["target_layer_ids"]], -1)[:anchor]
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [a, H]
    block = [ids[anchor]] + [dflash["mask_token_id"]] * (bs - 1)
    h = embed[torch.tensor(block)]  # [B, H]
    q_pos = anchor + torch.arange(bs)
    k_pos = torch.cat([torch.arange(anchor), q_pos])
    for n, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{n}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, x])
        q = _rms(
            (x @ w[p + "self_attn.q_proj.weight"].T).view(bs, nh, hd), w[p + "self_attn.q_norm.weight"], eps
        )
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rotate(q, q_pos, theta), _rotate(k, k_pos, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if kind == "sliding_attention":
            visible = (k_pos[None, :] <= q_pos[:, None]) & (
                q_pos[:, None] - k_pos[None, :] < cfg["sliding_window"]
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        else:
            assert kind == "full_attention"
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(bs, nh * hd)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps) @ lm_head.T


# ------------------------------------------------------------------ a run dir with a checkpoint
OVERRIDES = ["--drafter.sliding_window=10", "--drafter.block_size=8", "--eval.num_prompts=2"]


@pytest.fixture(scope="module")
def run_with_checkpoint(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """A tiny-cpu run dir whose checkpoint holds random (non-initial) drafter weights."""
    from training.config import load_config, write_config
    from training.data.buckets import Position
    from training.model.target import build_target
    from training.run import core
    from training.run.checkpoint import save_checkpoint

    run_dir = tmp_path_factory.mktemp("export") / "run"
    config = load_config("tiny-cpu", OVERRIDES)
    loaded = build_target(config)
    drafter = core.build_drafter(config, loaded.model, torch.device("cpu"), loaded.tokenizer)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.08 * torch.randn(p.shape, generator=g))
    optimizer, scheduler = core.build_optimizer(config, drafter)
    write_config(config, run_dir)
    state = core.checkpoint_state(drafter, optimizer, scheduler, position=Position(), tau=1.0, config=config)
    save_checkpoint(run_dir, 5, state, keep=2)
    return run_dir, loaded, drafter


def test_the_exported_folder_matches_an_independent_reference_forward(
    run_with_checkpoint, tmp_path: Path
) -> None:
    from training.export import export_run
    from training.model.drafter import target_context

    run_dir, loaded, drafter = run_with_checkpoint
    done = export_run(run_dir, tmp_path / "drafter", dtype="float32")
    folder = done.path
    files = {p.name for p in folder.iterdir()}
    assert (
        done.step == 5
        and {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["layer_types"] == [
        "sliding_attention",
        "full_attention",
    ]
    assert cfg["dflash_config"]["mask_token_id"] == loaded.tokenizer.mask_token_id
    names = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) or "mask" in n for n in names)

    target = loaded.model
    ids = torch.randint(10, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        anchors = torch.tensor([[0, 5, 21, 26, 39]])  # at the start, overlapping, at the end
        th = target_context(out.hidden_states, drafter.target_layer_ids)
        trained = drafter.eval().block_hidden(ids, th, anchors).view(1, 5, 8, -1)
        trained_logits = target.get_output_embeddings()(trained)[0]
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        for k, a in enumerate(anchors[0].tolist()):
            ref = reference_logits(folder, embed, head, out.hidden_states, ids[0].tolist(), a)
            torch.testing.assert_close(trained_logits[k], ref, rtol=1e-4, atol=1e-4)
            assert torch.equal(trained_logits[k].argmax(-1), ref.argmax(-1))


def test_z_labs_own_model_reads_the_export_as_the_drafter_it_was(run_with_checkpoint, tmp_path: Path) -> None:
    """The method's authors' code on the folder: the ``dflash`` package (PyPI, z-lab/dflash)
    loads it with its ``DFlashDraftModel.from_pretrained`` and its forward gives the trained
    drafter's block logits; its decoding loop ``dflash_generate`` then accepts what fleet's eval
    accepts, round for round (but a prompt's last, which z-lab cuts at the length limit)."""
    import importlib.util
    import sys

    import dflash.model as zlab

    from training.export import export_run
    from training.model.drafter import target_context
    from training.run.eval import evaluate_acceptance

    run_dir, loaded, drafter = run_with_checkpoint
    folder = export_run(run_dir, tmp_path / "drafter", dtype="float32").path
    theirs = zlab.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert theirs.block_size == drafter.cfg.block_size and theirs.target_layer_ids == drafter.target_layer_ids
    assert theirs.mask_token_id == loaded.tokenizer.mask_token_id
    target = loaded.model
    ids = torch.randint(10, 300, (1, 40), generator=torch.Generator().manual_seed(5))
    bs = drafter.cfg.block_size
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        th = target_context(out.hidden_states, drafter.target_layer_ids)
        anchors = torch.tensor([[7, 30]])
        ours = target.get_output_embeddings()(
            drafter.eval().block_hidden(ids, th, anchors).view(1, 2, bs, -1)
        )
        for k, a in enumerate(anchors[0].tolist()):
            block = torch.tensor([[ids[0, a].item()] + [theirs.mask_token_id] * (bs - 1)])
            hidden = theirs(
                position_ids=torch.arange(a + bs)[None],
                noise_embedding=target.get_input_embeddings()(block),
                target_hidden=zlab.extract_context_feature(out.hidden_states, theirs.target_layer_ids)[:, :a],
            )
            logits = theirs.compute_logits(hidden, zlab._output_head(target))[0]
            torch.testing.assert_close(logits, ours[0, k], rtol=1e-4, atol=1e-4)

    spec = importlib.util.spec_from_file_location("zlab_eval", REPO / "benchmarks" / "zlab_eval.py")
    assert spec is not None and spec.loader is not None
    zlab_eval = sys.modules["zlab_eval"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab_eval)
    prompts = [ids[0, :12].tolist(), ids[0, 20:26].tolist()]
    lengths = zlab_eval.zlab_lengths(folder, target, prompts, 24, None)
    fleet = evaluate_acceptance(target, drafter, prompts, drafter.target_layer_ids, 24)
    assert [len(rounds) for rounds in lengths] == [len(rounds) for rounds in fleet.taus]
    for zlab_rounds, fleet_rounds in zip(lengths, fleet.taus, strict=True):
        assert zlab_rounds[:-1] == list(fleet_rounds[:-1]) and zlab_rounds[-1] <= fleet_rounds[-1]


def test_a_bf16_export_holds_the_same_weights_rounded(run_with_checkpoint, tmp_path: Path) -> None:
    from training.export import export_run

    run_dir, _, drafter = run_with_checkpoint
    folder = export_run(run_dir, tmp_path / "bf16").path
    weights = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    own = drafter.state_dict()
    assert set(weights) == set(own)
    for name, t in weights.items():
        assert torch.equal(t, own[name].to(torch.bfloat16)), name
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (folder / "ddtree.json").exists()  # the run measured no tree
    # exporting again replaces the folder whole
    again = export_run(run_dir, folder).path
    assert again == folder and not list(folder.parent.glob(".bf16.*"))


def _tree_eval(step: int, tau_64: float, split: str = "held_out") -> dict:
    tree = [
        {
            "budget": b,
            "tau_mean": t,
            "tau_prompt_mean": t,
            "hist": [1],
            "rounds": 4,
            "tree_size_mean": b - 1.0,
        }
        for b, t in ((16, tau_64 - 0.3), (64, tau_64))
    ]
    cost = {"device": "NVIDIA H200", "context": 112, "speedup": {"0": 1.4, "16": 1.7, "64": 1.6},
            "best_budget": 16, "best_speedup": 1.7}  # fmt: skip
    return {"v": 1, "ts": 1.0 + step, "event": "eval", "rank": 0, "role": "single", "step": step,
            "split": split, "tau_mean": 2.0, "tau_hist": [1], "tau_estimate": 2.1, "tree": tree,
            "tree_cost": cost}  # fmt: skip


def test_an_export_carries_the_runs_ddtree_settings(run_with_checkpoint, tmp_path: Path) -> None:
    import shutil

    from training.config import ConfigError
    from training.export import export_run

    run_dir = tmp_path / "run"
    shutil.copytree(run_with_checkpoint[0], run_dir)
    evals = [_tree_eval(5, 2.9), _tree_eval(5, 9.0, split="train"), _tree_eval(7, 3.5)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    fitted = {
        "temperatures": [1.0, 1.5, 2.0],
        "step": 5,
        "taus": {"raw": {"64": 2.9}, "calibrated": {"64": 3.1}},
    }
    (run_dir / "tree-calibration.json").write_text(json.dumps(fitted))
    done = export_run(run_dir, tmp_path / "out")
    settings = json.loads((done.path / "ddtree.json").read_text())
    assert done.ddtree and (done.path / "config.json").is_file()
    assert settings["checkpoint_step"] == settings["eval_step"] == 5  # the checkpoint's own eval, held out
    assert settings["budgets"] == [
        {"budget": 16, "tau_mean": 2.6, "tree_size_mean": 15.0, "modelled_speedup": 1.7},
        {"budget": 64, "tau_mean": 2.9, "tree_size_mean": 63.0, "modelled_speedup": 1.6},
    ]
    assert (settings["chain_tau"], settings["best_budget"], settings["best_speedup_modelled"]) == (
        2.0,
        16,
        1.7,
    )
    assert (settings["device"], settings["context"]) == ("NVIDIA H200", 112)
    assert settings["temperatures"] == [1.0, 1.5, 2.0]
    assert (settings["temperatures_step"], settings["temperatures_taus"]) == (5, {"64": 3.1})
    (run_dir / "tree-calibration.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"tree-calibration\.json: not a calibration file") as info:
        export_run(run_dir, tmp_path / "bad")
    assert "\n" not in str(info.value)


def test_export_refuses_old_checkpoints_and_missing_steps(run_with_checkpoint, tmp_path: Path) -> None:
    from training.config import ConfigError
    from training.export import export_run, load_export_into

    run_dir, _, drafter = run_with_checkpoint
    with pytest.raises(ConfigError, match=r"no checkpoint of step 9 .*have: 5"):
        export_run(run_dir, tmp_path / "x", step=9)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((run_dir / "config.json").read_text())
    (old / "checkpoints").mkdir()
    state = torch.load(run_dir / "checkpoints" / "step-00000005.pt", weights_only=False)
    state["drafter"]["mask_embedding"] = torch.zeros(128)
    torch.save(state, old / "checkpoints" / "step-00000005.pt")
    with pytest.raises(ConfigError, match="learned MASK vector"):
        export_run(old, tmp_path / "y")
    # an export of another recipe is refused by eval --export, one line naming the difference
    folder = export_run(run_dir, tmp_path / "z", dtype="float32").path
    body = json.loads((folder / "config.json").read_text())
    body["dflash_config"]["mask_token_id"] = 7
    (folder / "config.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="mask_token_id 7"):
        load_export_into(drafter, folder)
    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="not an exported drafter"):
        load_export_into(drafter, tmp_path)


def test_init_from_a_drafter_folder_starts_from_its_weights(run_with_checkpoint, tmp_path: Path) -> None:
    from training.config import ConfigError, load_config
    from training.export import export_run
    from training.run import core

    run_dir, loaded, drafter = run_with_checkpoint
    folder = export_run(run_dir, tmp_path / "published", dtype="float32").path
    config = load_config("tiny-cpu", [*OVERRIDES, f"--drafter.init_from={folder}"])
    started = core.build_drafter(config, loaded.model, torch.device("cpu"), loaded.tokenizer)
    own = drafter.state_dict()
    assert all(torch.equal(t, own[name]) for name, t in started.state_dict().items())
    other = load_config("tiny-cpu", [*OVERRIDES, "--drafter.head_dim=16", f"--drafter.init_from={folder}"])
    with pytest.raises(ConfigError, match=r"another drafter: head_dim 32 \(run: 16\)"):
        core.build_drafter(other, loaded.model, torch.device("cpu"), loaded.tokenizer)
