"""The docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/*.md names a file
that exists (and a heading that exists, where it names one), the README stays a quick start, and it names
the test command CI runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(path: Path) -> str:
    """The file without fenced code blocks (a link-like text in code is not a link)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            found.add(slug(m.group(1)))
    return found


def links() -> list[tuple[Path, str]]:
    return [(doc, target) for doc in DOCS if doc.exists() for target in LINK.findall(_prose(doc))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours to check


def test_slug_matches_githubs_rule():
    assert slug("Without AMX: oneDNN capped at AVX512-BF16 (`--onednn-max-isa`)") == \
        "without-amx-onednn-capped-at-avx512-bf16---onednn-max-isa"
    assert slug("`fab keys`") == "fab-keys"


def test_docs_have_links_to_check():
    assert len(links()) >= 20  # a broken regex would otherwise pass every file


@pytest.mark.parametrize("doc,target", links(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v)
def test_relative_link_resolves(doc: Path, target: str):
    file_part, _, anchor = target.partition("#")
    dest = (doc.parent / file_part).resolve() if file_part else doc
    assert dest.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{doc.relative_to(ROOT)} links to {target}: no such heading in {dest.name}"


def test_readme_is_a_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference text into docs/"


def test_readme_names_the_test_command_ci_runs():
    assert "make test" in (ROOT / "README.md").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_ops_names_every_profile_a_stack_can_take():
    """docs/ops.md's `profile` row lists what node_setup/profiles.toml offers real nodes (the `test` profile is
    the local cluster's own); it once listed two of three."""
    import tomllib

    profiles = tomllib.loads((ROOT / "node_setup" / "profiles.toml").read_text())["profiles"]
    row = next(line for line in (ROOT / "docs" / "ops.md").read_text().splitlines() if line.startswith("| `profile` |"))
    missing = [name for name in profiles if name != "test" and f"`{name}`" not in row]
    assert not missing, f"docs/ops.md's profile row leaves out {missing}"
