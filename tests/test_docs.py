"""The documentation stays true and navigable: the README is short, every relative link lands on a file and a
heading that exist, and what the pages show (the demo's output, the rendered sbatch lines, the messages quoted,
the README's headline figures) is what the code and its tests produce. Fast: no processes.
"""

from __future__ import annotations

import os
import re

import pytest
from test_examples import DEMO_SUMMARY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = ["README.md", "DEVELOPERS.md", "examples/cli.md"] + sorted(
    f"docs/{name}" for name in os.listdir(DOCS) if name.endswith(".md"))
README_MAX_LINES = 200


def _read(relpath: str, root: str = ROOT) -> str:
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        return f.read()


def _prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.S | re.M)
    return re.sub(r"(`+).*?\1", "", text, flags=re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a page, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M),
                              flags=re.M):
        base = _anchor(heading)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def relative_links(markdown: str) -> list[str]:
    targets = re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(markdown))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto:


def broken_links(relpath: str, root: str = ROOT) -> list[str]:
    """'target: why' for every relative link of ``relpath`` that does not resolve."""
    broken = []
    for target in relative_links(_read(relpath, root)):
        path, _, fragment = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(relpath), path)) if path else relpath
        full = os.path.join(root, resolved)
        if not os.path.exists(full):
            broken.append(f"{target}: no file {resolved}")
        elif fragment and (not resolved.endswith(".md") or fragment not in anchors(_read(resolved, root))):
            broken.append(f"{target}: no heading #{fragment} in {resolved}")
    return broken


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_lands_on_a_file_and_heading(page):
    assert broken_links(page) == []


def test_the_link_checker_catches_a_missing_file_and_a_missing_heading(tmp_path):
    """The check above can fail: a page with one good and two bad links reports exactly the two."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# What is A?\n\n## Why `B`'s C, and D?\n\nText.\n")
    (tmp_path / "docs" / "b.md").write_text(
        "[ok](a.md#why-bs-c-and-d) [file](c.md) [heading](a.md#nowhere) [web](https://example.com/x.md)\n"
        "`[code](missing.md)`\n```\n[block](missing.md)\n```\n")
    assert broken_links("docs/b.md", str(tmp_path)) == [
        "c.md: no file docs/c.md", "a.md#nowhere: no heading #nowhere in docs/a.md"]


@pytest.mark.parametrize("page", PAGES)
def test_every_table_has_its_header_row(page):
    """A table row right after prose, without a separator row below it, is a table cut off when text moved."""
    lines = re.sub(r"^```.*?^```", "", _read(page), flags=re.S | re.M).splitlines()
    headless = [line for before, line, after in zip([""] + lines, lines, lines[1:] + [""])
                if line.startswith("|") and not before.startswith("|") and not re.fullmatch(r"\|[-|: ]+\|", after)]
    assert headless == []


def test_every_docs_page_is_linked_from_the_readme_and_starts_from_a_question():
    readme_links = {t.partition("#")[0] for t in relative_links(_read("README.md"))}
    for name in os.listdir(DOCS):
        if name.endswith(".md") and name != "README.md":
            assert f"docs/{name}" in readme_links, f"docs/{name} is not linked from README.md"
            first = _read(f"docs/{name}").splitlines()[0]
            assert first.startswith("# ") and first.endswith("?"), f"docs/{name} starts with {first!r}"


def test_readme_is_a_page_a_newcomer_reads_in_five_minutes():
    lines = _read("README.md").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_shows_the_demo_output_the_demo_test_asserts():
    """test_examples.py::test_make_demo_survives_a_killed_rank_with_zero_lost_steps asserts DEMO_SUMMARY."""
    readme = _read("README.md")
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", readme, flags=re.S | re.M)  # (language, text), in order
    shown = next(text for _, text in blocks if text.startswith("steps:"))
    assert shown.splitlines() == DEMO_SUMMARY


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with their ``\\`` continuations joined (a page may wrap a long rendered line)."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        out.append(pending + (line.strip() if pending else line))
        pending = ""
    return out


def _golden_blocks(page: str) -> list[tuple[str, list[str]]]:
    """(golden file, shown lines) for every ```bash block whose lead-in names a tests/golden/ file."""
    text = _read(page)
    out = []
    for match in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
        lead_in = text[:match.start()].rstrip().rsplit("\n\n", 1)[-1]
        golden = re.findall(r"tests/golden/[\w.]+\.sh", lead_in)
        if golden:
            out.append((golden[-1], _joined(match.group(1).splitlines())))
    return out


@pytest.mark.parametrize("page", ["docs/plugins.md", "docs/job-level.md"])
def test_rendered_sbatch_lines_shown_are_in_the_golden_files(page):
    """Every shown line without ``...`` (abridged) is a line of the golden sbatch script the page names,
    with or without a comment the page adds after two spaces."""
    blocks = _golden_blocks(page)
    assert blocks, f"{page} shows no golden sbatch lines"
    for golden, shown in blocks:
        lines = {line.rstrip() for line in _joined(_read(golden).splitlines())}
        checked = [line for line in shown if "..." not in line]
        assert len(checked) >= 5, f"{page}: too few lines of {golden} shown to check"
        missing = [line for line in checked
                   if line.rstrip() not in lines and re.split(r"\s{2,}#", line)[0].rstrip() not in lines]
        assert missing == [], f"{page}: lines not in {golden}"


def test_messages_quoted_in_the_readme_are_the_ones_the_config_raises():
    """The README's examples of bad values (typed against gpt_126m on 2 nodes) fail with exactly these lines."""
    from megatron_resilience.config import ConfigError
    from megatron_resilience.config.overrides import config_from_overrides
    from megatron_resilience.recipes import gpt_126m, to_config

    readme = _read("README.md")
    base = to_config(gpt_126m(dir="/lustre/me/runs", num_nodes=2))
    for override in ("rerun.rerun_mode=always", "parallel.tensor_model_parallel_size=8"):
        with pytest.raises(ConfigError) as raised:
            config_from_overrides([override], base)
        assert f"`{raised.value}`" in readme


def _readme_figures(section: str, pattern: str) -> list[str]:
    readme = _read("README.md")
    start = readme.index(f"## {section}")
    return re.findall(pattern, readme[start:readme.index("\n## ", start + 1)])


def test_readme_goodput_figures_are_the_ones_on_the_goodput_page():
    """The README's chaos-run figures are copied from docs/goodput.md, where the runs are described in full."""
    figures = _readme_figures("Goodput", r"\d+\.\d+%?|\d+e-\d+|\d+ \+ \d+ absorbed")
    assert len(figures) >= 15
    assert [f for f in figures if f not in _read("docs/goodput.md")] == []


def test_readme_speed_figures_are_the_ones_on_the_speed_page():
    """The README's headline figures are copied from docs/speed.md, where each is stated with how it was measured."""
    figures = _readme_figures("Speed", r"\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)? ?(?:ms|s|x|%)(?![\w])")
    assert len(figures) >= 10
    assert [f for f in figures if f not in _read("docs/speed.md")] == []
