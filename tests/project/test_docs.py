"""The docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/*.md names a file
that exists (and a heading that exists, where it names one), the README stays a quick start, and it names
the test command CI runs."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# Words about how the docs came to be, which a user cannot know: a working session, an issue number, an issue's
# "Done when", the borrowed benchmark machine, and "the seeds" (in-house for the manual recipe the product replaces).
IN_HOUSE = re.compile(r"\b(?:this|that|these|last|next|earlier|previous|each|every|one|the) sessions?\b"
                      r"|(?<!SSH )\bsessions\b(?! fixtures)|\bissues? #?\d+|\bdone when\b"
                      r"|\bdevice machine\b|\bthe seeds\b|\bseeds'", re.IGNORECASE)


def in_house_words(text: str) -> list[str]:
    return [m.group(0) for m in IN_HOUSE.finditer(text)]


def test_in_house_words_are_found():
    assert in_house_words("as measured this session (issue 52, item 3; Done when) on the device machine, "
                          "against the seeds' recipe; the last session") == \
        ["this session", "issue 52", "Done when", "device machine", "the seeds", "last session"]
    assert in_house_words("over its SSH session (its SSH sessions); pytest's session fixtures; mpirun in a session of its own; an SSO "
                          "session expires; the manual recipe") == []
    assert in_house_words("figures differ between sessions; the session before") == ["sessions", "the session"]


def test_docs_speak_to_users_only():
    found = [f"{doc.relative_to(ROOT)}:{n}: {', '.join(words)}"
             for doc in DOCS for n, line in enumerate(doc.read_text().splitlines(), 1)
             if (words := in_house_words(line))]
    assert not found, "words about how the docs were written, not about the product:\n" + "\n".join(found)


def test_ops_names_every_profile_a_stack_can_take():
    """docs/ops.md's `profile` row lists what node_setup/profiles.toml offers real nodes (the `test` profile is
    the local cluster's own); it once listed two of three."""
    import tomllib

    profiles = tomllib.loads((ROOT / "node_setup" / "profiles.toml").read_text())["profiles"]
    row = next(line for line in (ROOT / "docs" / "ops.md").read_text().splitlines() if line.startswith("| `profile` |"))
    missing = [name for name in profiles if name != "test" and f"`{name}`" not in row]
    assert not missing, f"docs/ops.md's profile row leaves out {missing}"


# ---- every `fab` command a doc shows exists, with every flag it shows ---------------------------------------

CORE_OPTIONS = {"-l", "--list", "-h", "--help", "-V", "--version"}
INLINE = re.compile(r"`([^`\n]+)`")
# `fab` where a command starts: a line or code span, after a prompt, a quote, `&&`, `;`, `(` or VAR=value
FAB = re.compile(r"(?:^\s*|\$\s+|['\"(]|&&\s*|;\s*|(?:^|\s)[A-Z_][A-Z0-9_]*=\S*\s+)fab((?:\s+\S+)+)")
COMMENT = re.compile(r"\s#\s.*$")
_ENDS = {"&&", ";", "||", "--", ">", "2>&1"}


def _code_segments(path: Path) -> list[str]:
    """Inline code spans of the prose, and every line of indented or fenced code blocks (without comments)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "|", "*")):
            out.append(COMMENT.sub("", line))
        else:
            out.extend(INLINE.findall(line.replace("\\|", "|")))
    return out


def fab_commands(path: Path) -> list[tuple[str, list[str], str]]:
    """(task or "", flags, the text shown) for each `fab ...` a doc shows; job flags after a bare `--` and
    whatever follows another shell command, or the quote that ends a command inside a message, are not fab's."""
    found = []
    for segment in _code_segments(path):
        for m in FAB.finditer(segment):
            task, flags = "", []
            for raw in m.group(1).split():
                if raw in _ENDS:
                    break
                tok = raw.strip("[]()`,.:'\"")
                if not task and tok.startswith("-"):
                    if tok not in CORE_OPTIONS:
                        flags.append(tok.split("=", 1)[0])
                elif not task:
                    if not re.fullmatch(r"[a-z][a-z-]*", tok):
                        break  # a placeholder such as TASK
                    task = tok
                elif re.fullmatch(r"--?[a-z][a-z-]*(=\S*)?", tok):
                    flags.append(tok.split("=", 1)[0])
                end = raw.rstrip(",.;:")
                if end.endswith(("'", '"')) or (end.endswith(")") and end.count(")") > end.count("(")):
                    break  # the end of a command quoted in a message
            if task or flags:
                found.append((task, flags, segment.strip()))
    return found


@pytest.fixture(scope="module")
def fab_flags() -> dict[str, set[str]]:
    """Every task of the fabfile and every flag its parser accepts (long and short), as `fab --help TASK` shows."""
    import sys

    from invoke import Collection
    from invoke.parser import ParserContext

    sys.path.insert(0, str(ROOT))
    import fabfile

    tasks = Collection.from_module(fabfile)
    return {name: set(ParserContext(name=name, args=tasks[name].get_arguments()).flag_names())
            for name in tasks.task_names}


def test_fab_commands_are_read_as_a_reader_would(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `fab train --nodes 2 --detach -- --lr 3` or `fab --help keys`.\n\n"
                   "    $ fab logs RUN -f   # follows --it\n"
                   "    AWS_REGION=x fab sweep --cluster aws:dev && pulumi stack rm --yes\n\n"
                   "    error: ...; end it with 'fab stop R', or pass --concurrent\n"
                   "the fab tasks, `fab`'s own, `fab --bogus`\n")
    assert fab_commands(doc) == [
        ("train", ["--nodes", "--detach"], "fab train --nodes 2 --detach -- --lr 3"),
        ("keys", [], "fab --help keys"),
        ("logs", ["-f"], "$ fab logs RUN -f"),
        ("sweep", ["--cluster"], "AWS_REGION=x fab sweep --cluster aws:dev && pulumi stack rm --yes"),
        ("stop", [], "error: ...; end it with 'fab stop R', or pass --concurrent"),
        ("", ["--bogus"], "fab --bogus"),
    ]


def test_docs_show_fab_commands():
    shown = [c for doc in DOCS for c in fab_commands(doc)]
    assert len(shown) >= 50 and any(task == "train" and "--detach" in flags for task, flags, _ in shown)
    assert fab_commands.__doc__  # the extractor is what the next test trusts


def test_every_fab_command_and_flag_a_doc_shows_exists(fab_flags):
    wrong = []
    for doc in DOCS:
        for task, flags, text in fab_commands(doc):
            where = f"{doc.relative_to(ROOT)}: `{text}`"
            if not task:
                wrong.append(f"{where}: {' '.join(flags)} without a task")
            elif task not in fab_flags:
                wrong.append(f"{where}: no task {task!r} (fab -l)")
            else:
                wrong += [f"{where}: fab {task} has no {flag}" for flag in flags
                          if flag not in fab_flags[task] and flag not in CORE_OPTIONS]
    assert not wrong, "\n".join(wrong)


def synopses(path: Path) -> dict[str, set[str]]:
    """The long flags each task's synopsis lines show (code lines that start with `fab TASK`; a wrapped synopsis
    continues on the indented lines below it), and a positional NAME as --name."""
    shown: dict[str, set[str]] = {}
    task = None
    for line in _code_segments(path):
        m = re.match(r"^\s*fab ([a-z][a-z-]*)\b(.*)$", line)
        if m:
            task, rest = m.group(1), m.group(2)
            shown.setdefault(task, set())
        elif task and line.startswith("           ") and line.strip().startswith("["):
            rest = line
        else:
            task = None
            continue
        body = rest.split(" -- ")[0]
        shown[task] |= set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", body))
        if m and (first := body.split()[:1]) and re.fullmatch(r"[A-Z]+", first[0]):
            shown[task].add(f"--{first[0].lower()}")  # fab logs RUN: the positional argument
    return shown


def test_commands_md_synopses_are_each_tasks_flags(fab_flags):
    """docs/commands.md lists every task with exactly the long flags its parser has."""
    shown = synopses(ROOT / "docs" / "commands.md")
    wrong = []
    for task, flags in fab_flags.items():
        real = {f for f in flags if f.startswith("--")} - CORE_OPTIONS
        if task not in shown:
            wrong.append(f"fab {task}: no synopsis")
            continue
        if missing := real - shown[task]:
            wrong.append(f"fab {task}: the synopsis leaves out {sorted(missing)}")
        if extra := shown[task] - real:
            wrong.append(f"fab {task}: the synopsis shows {sorted(extra)}, which it does not take")
    assert not wrong, "docs/commands.md:\n" + "\n".join(wrong)


def test_synopses_are_read_as_a_reader_would(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("    fab logs RUN [--follow] [--cluster C]\n"
                   "    fab train [--nodes N] [--job glue|qa]\n"
                   "              [--detach] [-- job flags]\n\ntext\n")
    assert synopses(doc) == {"logs": {"--run", "--follow", "--cluster"}, "train": {"--nodes", "--job", "--detach"}}


# ---- no reference to a file the project does not have -------------------------------------------------------

TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {"runs", "store"}
PATHLIKE = re.compile(r"^[A-Za-z0-9_./-]+$")


def file_references(path: Path) -> list[str]:
    """Paths in the project's own folders that a doc names in code (`training/jobs/glue.py`, `docs/x.md`), and bare
    `NAME.md` files; paths with placeholders (<id>, *), on nodes or under runs/ are not the project's files."""
    refs = []
    for segment in _code_segments(path):
        for word in re.split(r"[\s,;()\[\]'\"`=]+", segment):
            word = word.rstrip(".:").split("#", 1)[0]
            word = re.sub(r":\d+(-\d+)?$", "", word)  # file.py:12
            if not word or not PATHLIKE.match(word) or "//" in word:
                continue
            first = word.split("/", 1)[0]
            if ("/" in word and first in TOP and "." in word.rsplit("/", 1)[-1]) or re.fullmatch(r"[A-Z][A-Za-z_-]*\.md", word):
                refs.append(word)
    return refs


def _ignored(ref: str) -> bool:
    """A path git ignores is something a command writes (bench/results/...), not a file the project ships."""
    import subprocess

    return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", ref], check=False).returncode == 0


def test_docs_reference_only_files_that_exist():
    missing = []
    for doc in DOCS:
        for ref in file_references(doc):
            if not ((ROOT / ref).exists() or (doc.parent / ref).exists() or (ROOT / "docs" / ref).exists()
                    or _ignored(ref)):
                missing.append(f"{doc.relative_to(ROOT)}: {ref}")
    assert not missing, "these files do not exist:\n" + "\n".join(missing)
    assert any("training/" in r for doc in DOCS for r in file_references(doc))  # the scan finds something


# Pages that still name DESIGN.md, each to lose the reference in its owner's next change (then leave this list).
DESIGN_MD_PENDING: set[str] = set()


def test_no_doc_refers_to_design_notes_the_project_does_not_ship():
    """DESIGN.md is the team's working notes, outside the repository: a user cannot follow a reference to it."""
    assert not (ROOT / "DESIGN.md").exists()
    named = {str(doc.relative_to(ROOT)) for doc in DOCS if "DESIGN.md" in doc.read_text()}
    assert named <= DESIGN_MD_PENDING, f"{sorted(named - DESIGN_MD_PENDING)} refer to DESIGN.md, which the project does not ship"
    fixed = DESIGN_MD_PENDING - named
    assert not fixed, f"{sorted(fixed)} no longer name DESIGN.md: take them out of DESIGN_MD_PENDING"


# ---- the docs a newcomer needs, and facts that must not drift -----------------------------------------------

def test_readme_links_the_newcomer_docs():
    readme = (ROOT / "README.md").read_text()
    for doc in ("docs/aws-quickstart.md", "docs/troubleshooting.md", "docs/scripts.md"):
        assert f"]({doc}" in readme, f"README.md does not link {doc}"


def test_ops_config_defaults_are_pulumi_yamls():
    """docs/ops.md's config table shows the default Pulumi.yaml declares for every key (the profile row once
    said oneccl while the tested stack was another)."""
    import yaml

    config = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["config"]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", (ROOT / "docs" / "ops.md").read_text(), re.MULTILINE)}
    assert set(config) <= set(rows), f"docs/ops.md has no row for {sorted(set(config) - set(rows))}"
    wrong = []
    for key, entry in config.items():
        shown, default = rows[key].strip(), entry.get("default")
        if default in ("", None):
            ok = shown == '`""`' or not re.fullmatch(r"`[^`<]+`", shown)  # "(required)", "stack name", `<region>a`
        else:
            ok = shown == f"`{str(default).lower() if isinstance(default, bool) else default}`"
        if not ok:
            wrong.append(f"{key}: docs/ops.md shows {shown}, Pulumi.yaml's default is {default!r}")
    assert not wrong, "\n".join(wrong)


def test_teardown_is_described_as_keeping_the_store():
    """pulumi destroy keeps the store bucket on purpose: no doc may promise that nothing is left."""
    for doc in DOCS:
        text = doc.read_text().lower()
        assert "nothing left behind" not in text and "no pulumi cli needed" not in text, doc.relative_to(ROOT)
        assert "every 15 s" not in text, f"{doc.relative_to(ROOT)}: checkpoints are in the store, not copied home"


def test_pulumi_policy_covers_every_service_the_program_uses():
    """docs/iam-policy-pulumi.json (what `pulumi up`/`destroy` need) names, for every kind of AWS resource the
    program creates, that service's create actions: a new kind (e.g. an SSM parameter) must be added there."""
    import json

    resources = set()
    for path in [ROOT / "__main__.py", *sorted((ROOT / "infra").glob("*.py"))]:
        resources |= set(re.findall(r"\baws\.([a-z0-9_]+)\.([A-Z][A-Za-z]+)\(", path.read_text()))
    assert ("autoscaling", "Group") in resources  # the scan sees the program
    policy = json.loads((ROOT / "docs" / "iam-policy-pulumi.json").read_text())
    actions = {a for st in policy["Statement"] for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    service = {("cloudwatch", "LogGroup"): "logs"}
    missing = []
    for module, kind in sorted(resources):
        prefix = service.get((module, kind), module)
        if not any(a.startswith(f"{prefix}:") and re.match(r"(Create|Put|Import|Run)", a.split(":", 1)[1])
                   for a in actions):
            missing.append(f"aws.{module}.{kind} ({prefix}:Create*/Put*)")
    assert not missing, f"docs/iam-policy-pulumi.json lacks what these resources need: {missing}"


# ---- checkpoint names and costs: what the code says ---------------------------------------------------------

CHECKPOINT_REF = re.compile(r"\b(?:checkpoints|resume)/([a-z]+-(?:N|\d+|<\w+>))")


def test_checkpoint_names_in_docs_are_the_codes():
    """A checkpoint's folder is training.runtime.paths.Checkpoints.name(step) (`checkpoint-N`, the Trainer's); the docs once
    named it `step-N` after the code had changed."""
    from training.runtime.paths import Checkpoints

    prefix = Checkpoints.name(7).removesuffix("7")
    named, wrong = [], []
    for doc in DOCS:
        text = doc.read_text()
        for m in CHECKPOINT_REF.finditer(text):
            named.append(m.group(1))
            if not m.group(1).startswith(prefix):
                wrong.append(f"{doc.relative_to(ROOT)}: {m.group(0)}")
        wrong += [f"{doc.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(r"\bstep-(?:N|<\w+>)(?=[/`\s])", text)]
    assert not wrong, f"checkpoints are named {prefix}N (training/runtime/paths.py):\n" + "\n".join(wrong)
    assert len(named) >= 3  # the scan sees store.md's and train.md's layouts


def test_the_costs_the_docs_quote_are_infra_costs():
    """The README and the quick start quote what `pulumi up` costs before anyone runs it: the defaults (Pulumi.yaml)
    and the cheapest cluster across nodes, on demand, with and without the head, as infra/cost.py estimates them."""
    import yaml

    from infra.cost import estimate

    config = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["config"]
    default = {k: config[k]["default"] for k in ("instanceType", "nodeCount", "rootVolumeGib", "headInstanceType")}

    def usd_h(instance_type: str, count: int, head: bool = False) -> str:
        e = estimate(instance_type, count, availability_zone="us-east-1a", spot=False,
                     root_volume_gib=default["rootVolumeGib"],
                     head_instance_type=default["headInstanceType"] if head else None)
        return f"${e.total_usd_h:.2f}/h"

    defaults = f"{default['nodeCount']} x {default['instanceType']}"
    cheapest = "2 x c6i.2xlarge"
    # (the cluster, a figure quoted for it within a sentence after its name)
    quoted = [(defaults, usd_h(default["instanceType"], default["nodeCount"])), (cheapest, usd_h("c6i.2xlarge", 2)),
              (cheapest, usd_h("c6i.2xlarge", 2, head=True))]
    for doc in (ROOT / "README.md", ROOT / "docs" / "aws-quickstart.md"):
        text = " ".join(doc.read_text().split())
        missing = [f"{what}: {figure}" for what, figure in quoted
                   if not re.search(re.escape(what) + r".{0,100}?" + re.escape(figure), text)]
        assert not missing, f"{doc.relative_to(ROOT)} does not quote {missing} (infra/cost.py, us-east-1 list prices)"
        assert "pulumi preview" in text and "estimated cost" in text  # where the live spot estimate is printed
    row = r"^\| 2 x c6i\.2xlarge .*\| " + re.escape(usd_h("c6i.2xlarge", 2)[1:-2]) + r" \|$"
    assert re.search(row, (ROOT / "docs" / "ops.md").read_text(), re.MULTILINE), "docs/ops.md's cost table"


def test_fab_train_help_reads_in_one_screen_and_docs_train_has_each_flag_in_full():
    """Issue 55: one line per flag at 80 columns, the details in docs/train.md#flags."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "fabric", "train", "--help"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "80"}, timeout=120, check=True)
    options = [line for line in res.stdout.splitlines() if line.startswith("  --")]
    assert len(res.stdout.splitlines()) <= 40 and len(options) >= 20, res.stdout
    wrapped = [line for line in res.stdout.splitlines() if line.startswith(" " * 10)]
    assert not wrapped, f"help lines wrap at 80 columns: {wrapped}"
    flags_section = (ROOT / "docs" / "train.md").read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    missing = [o.split()[0].split("=")[0] for o in options if f"`{o.split()[0].split('=')[0]}" not in flags_section]
    assert not missing, f"docs/train.md#flags leaves out {missing}"
