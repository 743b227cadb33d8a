"""The docs: the generated reference equals what the code gives, every link and anchor resolves,
every error class is in the troubleshooting page, and the front pages stay short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from testkit import script_module

from fleet import inventory

docs = script_module("docs/generate.py", "docs_generate")

REPO = docs.REPO
PAGES = sorted(
    {
        REPO / "README.md",
        REPO / "benchmarks" / "RESULTS.md",
        *(REPO / "docs").rglob("*.md"),
        *(REPO / "benchmarks" / "results").glob("*.md"),
    }
)


def test_the_generated_reference_is_what_the_code_gives() -> None:
    stale = [str(path.relative_to(REPO)) for path in docs.stale_pages()]
    assert not stale, f"{', '.join(stale)} differ from the code: run `{docs.REGENERATE}` and commit them"


def test_check_names_a_stale_page_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pages = {tmp_path / "settings.md": "old text\n", tmp_path / "tasks.md": docs.tasks_page()}
    for path, text in pages.items():
        path.write_text(text)
    monkeypatch.setattr(docs, "pages", lambda: {path: docs.tasks_page() for path in pages})
    assert docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "settings.md is stale" in err and docs.REGENERATE in err, err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0


def _task_sections(text: str) -> dict[str, list[str]]:
    """``fab NAME`` heading -> the option cells of its table, as the committed page has them."""
    sections: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith("## fab "):
            name = line.removeprefix("## fab ").strip()
            sections[name] = []
        elif line.startswith("## "):  # the exit codes after the tasks
            name = ""
        elif name and line.startswith("| `"):
            sections[name].append(line.split(" | ")[0].removeprefix("| `").removesuffix("`"))
    return sections


def test_each_tasks_options_are_invokes_own_help() -> None:
    """The committed tasks page against invoke's parser for each task (what `fab --help TASK`
    prints), and every task in the README's table and the tasks guide."""
    import tasks

    committed = _task_sections((docs.REFERENCE / "tasks.md").read_text())
    contexts = {context.name: context for context in tasks.ns.to_contexts()}
    assert set(committed) == set(contexts)
    for name, context in contexts.items():
        assert committed[name] == [flags for flags, _ in context.help_tuples()], name
    readme = (REPO / "README.md").read_text()
    guide = (REPO / "docs" / "tasks.md").read_text()
    for name in contexts:
        assert f"| `{name}` |" in readme, f"README's task table lacks {name}"
        assert re.search(rf"^\| `{re.escape(name)}[ `]", guide, re.MULTILINE), f"docs/tasks.md lacks {name}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        # anchors github.com gave these headings (the links written against it before the move)
        ("fab status latency — 2026-11-30 02:17 UTC", "fab-status-latency--2026-11-30-0217-utc"),
        ("pinned envs (issue 5) — 2026-11-30 02:18 UTC", "pinned-envs-issue-5--2026-11-30-0218-utc"),
        (
            "`fab plan --gpus 8` for the Qwen3.6-27B hybrid shape on one H200 — 2026-12-01 04:37 UTC",
            "fab-plan---gpus-8-for-the-qwen36-27b-hybrid-shape-on-one-h200--2026-12-01-0437-utc",
        ),
        (
            "The README's test command in a fresh Debian 12 container (`fresh_tests.py`, issue 32)",
            "the-readmes-test-command-in-a-fresh-debian-12-container-fresh_testspy-issue-32",
        ),
        ("Runs and recovery: resume, restart, notify, disk", "runs-and-recovery-resume-restart-notify-disk"),
    ],
)
def test_anchors_follow_githubs_rule(heading: str, anchor: str) -> None:
    assert docs.github_anchor(heading) == anchor


def test_a_repeated_heading_is_numbered_and_code_blocks_are_not_headings() -> None:
    text = "# A\n## Setup\n```\n# Setup\n```\n## Setup\n### Setup!\n"
    assert docs.heading_anchors(text) == ["a", "setup", "setup-1", "setup-2"]


def test_a_broken_link_or_anchor_is_named(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Here it is\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#here-it-is) [self](#page) [web](https://example.com)\n"
        "[gone](missing.md) and [no anchor](other.md#not-here) `[code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n![plot](missing.png)\n"
    )
    problems = docs.broken_links(page)
    assert len(problems) == 3, problems
    assert "page.md:4: missing.md: no such file" in problems[0]
    assert "other.md#not-here: no heading" in problems[1]
    assert "missing.png: no such file" in problems[2]


def test_every_link_and_anchor_resolves() -> None:
    assert len(PAGES) > 20
    problems = [problem for page in PAGES for problem in docs.broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_front_pages_stay_short_and_the_summary_cells_too() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    assert len((REPO / "docs" / "DESIGN.md").read_text().splitlines()) <= 400
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 10
    long = [cell[:60] for row in rows for cell in row.strip("|").split(" | ") if len(cell) > 250]
    assert not long, long


def test_the_example_inventory_loads_and_sets_every_key() -> None:
    loaded = inventory.load_inventory(docs.EXAMPLE_INVENTORY)
    assert set(loaded.targets) == {"pve", "pve1", "pve2"} and set(loaded.runs) == {"wide"}
    examples = docs._examples(docs.EXAMPLE_INVENTORY)
    for heading, keys_name, _ in docs.INVENTORY_TABLES:
        keys = getattr(inventory, keys_name) if keys_name else ("type", "id", "name")
        missing = set(keys) - set(examples.get(heading, {}))
        assert not missing, f"{heading}: the example inventory lacks {sorted(missing)}"


def _error_classes(package: str, root: str) -> dict[str, int]:
    """Class name -> exit code of every class under ``package`` deriving from ``root`` (read from the
    source, so no module of the trainer is imported: torch stays out)."""
    bases: dict[str, list[str]] = {}
    codes: dict[str, int] = {}
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                key = (
                    node.name
                    if node.name != "ConfigError" or package == "fleet"
                    else "ConfigError (training)"
                )
                bases[key] = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                for item in node.body:
                    if isinstance(item, ast.Assign) and getattr(item.targets[0], "id", "") == "exit_code":
                        codes[key] = item.value.value  # type: ignore[attr-defined]
    if package == "training":  # the trainer's ConfigError is its own class, not fleet's
        bases = {
            k: ["ConfigError (training)" if b == "ConfigError" else b for b in v] for k, v in bases.items()
        }

    def code(name: str) -> int | None:
        if name in codes:
            return codes[name]
        return next((c for b in bases.get(name, []) if (c := code(b)) is not None), None)

    def derives(name: str) -> bool:
        return name == root or any(derives(b) for b in bases.get(name, []) if b in bases)

    return {name: code(name) for name in bases if derives(name)}  # type: ignore[misc]


@pytest.mark.parametrize(
    ("package", "root", "section"),
    [("fleet", "FleetError", "## fleet's errors"), ("training", "TrainingError", "## The trainer's errors")],
)
def test_every_error_class_is_in_troubleshooting_with_its_exit_code(
    package: str, root: str, section: str
) -> None:
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    start = text.index(section)
    part = text[start : text.find("\n## ", start + 1)]
    documented = dict(re.findall(r"^### (.+)\n\nExit (\d+)\.", part, re.MULTILINE))
    classes = _error_classes(package, root)
    assert len(classes) >= 7, classes
    for name, exit_code in classes.items():
        assert name in documented, f"docs/troubleshooting.md, {section}: no `### {name}`"
        assert int(documented[name]) == exit_code, (
            f"{name}: documented exit {documented[name]}, raises {exit_code}"
        )
