"""The README stays a ten-minute read, its links lead somewhere, and every command in it still runs
as written (composed with `--cfg job`, which validates without training)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 300


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


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; detail belongs in a guide under docs/"


def test_every_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links no guide"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_the_readme_names_what_runs_its_commands():
    words = commands(README.read_text())
    makefile = (REPO / "Makefile").read_text()
    for w in words:
        if w[0] == "make":
            assert re.search(rf"^{w[1]}:", makefile, re.M), f"no Makefile target {w[1]}"
        elif w[0] == "bash":
            assert (REPO / w[1]).is_file(), w
        else:
            assert w[0] in ("python", "cp"), f"a README command this test cannot check: {w}"
    assert len(gptlab_commands()) >= 15  # the extraction found the commands


@pytest.mark.slow
@pytest.mark.parametrize("words", gptlab_commands(), ids=lambda w: " ".join(w[2:])[:60])
def test_every_readme_command_composes_as_written(words, tmp_path):
    head, args = words[1:3], words[3:]  # -m gptlab.<command>, then its arguments
    if "-m" in args:  # a sweep: its first job (Hydra prints no config of a whole multirun)
        args = [a.partition("=")[0] + "=" + a.partition("=")[2].split(",")[0] if "=" in a else a
                for a in args if a != "-m"]  # fmt: skip
    args = head + args
    r = subprocess.run([sys.executable, *args, "--cfg", "job"], cwd=tmp_path, env=cli_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, f"{' '.join(words)}: {r.stderr[-1500:]}"
    assert not list(tmp_path.iterdir()), "printing the config wrote files"
