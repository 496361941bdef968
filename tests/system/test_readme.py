"""The README stays a ten-minute read, its links (and the guides') lead somewhere, and every command
in it still runs as written (composed with `--cfg job`, which validates without training)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 300
# the guides and measurements this test keeps linked (ARCHITECTURE.md is the design test's)
GUIDES = sorted({*(REPO / "docs").glob("*.md"), *(REPO / "docs" / "measurements").glob("*.md")}
                - {REPO / "docs" / "ARCHITECTURE.md"})  # fmt: skip


def code_blocks(text: str):
    """(language, body) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def commands(text: str):
    """Each shell command of the README's code blocks (bash blocks, `$ ` lines of text blocks), with
    `\\` continuations joined and comments and the `$ ` prompt dropped."""
    found = []
    for lang, body in code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            if lang == "text":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif lang != "bash":
                continue
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def gptlab_commands():
    return [w for w in commands(README.read_text()) if w[:2] == ["python", "-m"]]


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_links(page: Path):
    """The relative links of a Markdown page whose file, or heading, does not exist."""
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target}#{anchor}" if anchor else target)
        elif anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(f"{target}#{anchor}")
    return broken


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; detail belongs in a guide under docs/"


def test_every_link_of_the_readme_resolves():
    links = re.findall(r"\]\((docs/[^)#\s]*)", README.read_text())
    assert len(links) >= 10, "the README links its guides"
    assert not broken_links(README), broken_links(README)


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_every_link_of_the_guides_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_a_broken_link_is_found(tmp_path):
    page = "# A title\n[ok](a.md#a-title) [no](b.md) [no anchor](a.md#nope)\n"
    (tmp_path / "a.md").write_text(page)
    assert broken_links(tmp_path / "a.md") == ["b.md", "a.md#nope"]


def test_the_readme_names_what_runs_its_commands():
    words = commands(README.read_text())
    makefile = (REPO / "Makefile").read_text()
    for w in words:
        while w and re.match(r"^[A-Z_]+=", w[0]):  # an environment setting before the command
            w = w[1:]
        if w[0] == "make":
            assert re.search(rf"^{re.escape(w[1])}:", makefile, re.M), f"no Makefile target {w[1]}"
        elif w[0] == "bash":
            assert (REPO / w[1]).is_file(), w
        elif w[0] == "mlflow":  # MLflow's own CLI: the subcommands gptlab's guides use
            assert w[1:3] == ["models", "serve"], w
            assert "--env-manager" in w and "local" in w, "serve from the installed environment"
        elif w[0] == "curl":  # a request to a server the README started on this machine
            assert any(a.startswith("http://127.0.0.1:") for a in w), w
        else:
            assert w[0] in ("python", "cp"), f"a README command this test cannot check: {w}"
    assert {"train", "test"} <= {w[1] for w in words if w[0] == "make"}  # the two commands
    assert len(gptlab_commands()) >= 15  # the extraction found the commands


def first_job(args):
    """A sweep's arguments without -m, each swept key at its first value (Hydra prints no config of
    a whole multirun); the whole sweep's syntax is parsed by Hydra first."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in args if a != "-m" and "=" in a]
    OverridesParser.create().parse_overrides(overrides)  # a malformed sweep raises here
    first = []
    for a in args:
        if a == "-m":
            continue
        key, eq, value = a.partition("=")
        first.append(f"{key}={value.split(',')[0]}" if eq else a)
    return first


@pytest.mark.slow
@pytest.mark.parametrize("words", gptlab_commands(), ids=lambda w: " ".join(w[2:])[:60])
def test_every_readme_command_composes_as_written(words, tmp_path):
    head, args = words[1:3], words[3:]  # -m gptlab.<command>, then its arguments
    if "-m" in args:
        args = first_job(args)
    r = subprocess.run([sys.executable, *head, *args, "--cfg", "job"], cwd=tmp_path, env=cli_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, f"{' '.join(words)}: {r.stderr[-1500:]}"
    assert not list(tmp_path.iterdir()), "printing the config wrote files"
