"""Where the regenerated data's prompts come from (``data.regen_sources``): the shipped corpus as
before, or also the documented functions of installed packages, in four kinds of request."""

from __future__ import annotations

import pytest

from training.config import ConfigError, load_config
from training.data.regen import package_sources, shipped_prompts


@pytest.mark.slow
def test_stdlib_alone_is_the_corpus_prompts_alternating_write_and_explain() -> None:
    prompts = shipped_prompts(6)
    assert prompts == shipped_prompts(6, "stdlib")
    assert [p.split()[0] for p in prompts] == ["Write", "Explain"] * 3


@pytest.mark.slow
def test_packages_add_their_functions_in_four_kinds_of_request() -> None:
    """A real installed distribution (pytest's own sources) as the package source."""
    sources = package_sources(("pytest",))
    assert sources and all(path.startswith("pytest/") for path, _ in sources)
    assert not [path for path, _ in sources if "/tests/" in path or path.split("/")[-1].startswith("test_")]
    mixed = shipped_prompts(400, "stdlib,packages", ("pytest",))
    assert len(mixed) == 400 and mixed == shipped_prompts(400, "stdlib,packages", ("pytest",))
    stdlib = set(shipped_prompts(5000))
    extra = [p for p in mixed if p not in stdlib]
    assert extra, "no prompt came from the package"
    kinds = {p.split()[0] for p in extra}
    assert kinds == {"Write", "Explain", "Rewrite"}, kinds  # "Write a Python function" / "Write pytest tests"
    assert any(p.startswith("Write pytest tests") for p in extra)


def test_bad_sources_eval_split_and_eval_sets_are_one_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data.regen_sources: 'stdlib,web'"):
        load_config("smol-cpu", ["--data.regen_sources=stdlib,web"])
    with pytest.raises(ConfigError, match=r"eval.split: 'test'"):
        load_config("smol-cpu", ["--eval.split=test"])
    for sets, cause in [
        ("held_out,test", r"eval.sets: 'test' is neither one of held_out, train, general nor a path"),
        ("", r"eval.sets: empty"),
        ("general,held_out,general", r"eval.sets: general, held_out, general names a set twice"),
    ]:
        with pytest.raises(ConfigError, match=cause):
            load_config("smol-cpu", [f"--eval.sets={sets}"])
    assert load_config("smol-cpu").eval.active_sets == ("held_out", "general")
    mine = load_config("smol-cpu", ["--eval.sets=general,/d/mine.jsonl"]).eval
    assert mine.active_sets == ("general", "/d/mine.jsonl")
    assert load_config("smol-cpu", ["--eval.split=train"]).eval.active_sets == ("train",)  # the older form
    assert load_config("smol-h200", ["--data.regen_sources=stdlib,packages"]).data.regen_sources
