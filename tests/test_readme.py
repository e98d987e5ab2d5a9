"""The README is for users: short, with the two quickstart commands CI runs, and every link it gives reaching a file
and, for `file.md#anchor`, a heading of that file (the tables it points to live in docs/results.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250


def slugs(markdown: str) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in markdown.splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def links(markdown: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", markdown) if not re.match(r"[a-z]+:", target)]


def test_readme_is_short_and_keeps_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines: tables go to docs/results.md"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("./")]
    quickstart = text.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in quickstart.splitlines()] == ["./scripts/demo", "./scripts/test"]
    assert ci and all(command in quickstart for command in ci)
    assert "\n|" not in text, "a table in README.md: move it to docs/results.md and link it"


def test_every_link_of_the_readme_reaches_its_file_and_heading():
    for target in links(README.read_text()):
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        assert file.exists(), f"README.md links {target}: no such file"
        if anchor:
            assert anchor in slugs(file.read_text()), f"README.md links {target}: no such heading in {path or 'README.md'}"


def test_slugs_follow_githubs_rule():
    text = "# Results\n## Gemma 3 270M, default settings\n### Set-up: the demo's first run\n## Runtimes: `--runtime P`\n## A\n## A\n"
    assert slugs(text) == {"results", "gemma-3-270m-default-settings", "set-up-the-demos-first-run", "runtimes---runtime-p",
                           "a", "a-1"}
