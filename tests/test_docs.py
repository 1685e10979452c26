"""The top-level documents against the checkout: links resolve, the README's commands are the ones
CI runs, every engine setting is documented, docs/bench holds only what the documents link to,
and the README's Python examples run."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flagcx_mc.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "CHANGELOG.md")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _read(name: str) -> str:
    path = ROOT / name
    if not path.exists():  # an unpacked sdist may leave out some documents
        pytest.skip(f"{name} is not in this tree")
    return path.read_text()


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    body = FENCE.sub("", text)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", body, re.M)}


def _links(text: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", text))]


def _blocks(text: str, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) == lang]


def test_slug_matches_github():
    assert _slug("The `kv` toolkit") == "the-kv-toolkit"
    assert _slug("GPU memory over TCP (H200)") == "gpu-memory-over-tcp-h200"
    assert _slug("Cancellation and unregister (TCP): why a failed call leaves your memory alone") == (
        "cancellation-and-unregister-tcp-why-a-failed-call-leaves-your-memory-alone")


@pytest.mark.parametrize("name", DOCS)
def test_relative_links_resolve(name):
    text = _read(name)
    broken = []
    for target in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / name).parent / path if path else ROOT / name
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{name}: {broken}"


def test_docs_bench_holds_only_linked_files():
    bench = ROOT / "docs" / "bench"
    if not bench.is_dir():
        pytest.skip("docs/bench is not in this tree")
    linked = set()
    for name in DOCS:
        if (ROOT / name).exists():
            linked |= {(ROOT / t.partition("#")[0]).resolve() for t in _links((ROOT / name).read_text())}
    files = {p.resolve() for p in bench.rglob("*") if p.is_file()}
    assert files, "docs/bench is empty"
    assert files <= linked, f"not linked from any document: {sorted(str(p.relative_to(ROOT)) for p in files - linked)}"
    # The bench reads the project's targets from there.
    assert (bench / "targets.json").exists()


def test_readme_commands_are_the_ones_ci_runs():
    readme = _read("README.md")
    ci = _read(".ci/run")
    ci_tests = [line for line in ci.splitlines() if line.startswith("python3 -m venv .venv") and "pytest" in line]
    assert len(ci_tests) == 1, ci_tests
    commands = [line for block in _blocks(readme, "sh") for line in block.splitlines()]
    assert ci_tests[0] in commands, "the README's test command differs from .ci/run's"
    install = ci_tests[0].split(" && .venv/bin/ruff")[0]
    assert f"{install} && .venv/bin/flagcx-mc demo" in commands, "the README's demo command"


def test_every_engine_setting_is_documented():
    readme = _read("README.md")
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f"`{f.name}=" not in readme]
    assert not missing, f"settings missing from the README's configuration table: {missing}"
    config_source = (ROOT / "flagcx_mc" / "config.py").read_text()
    variables = set(re.findall(r"\"((?:MC|FLAGCX_MC)_[A-Z_]+)\"", config_source))
    assert "FLAGCX_MC_STREAMS" in variables and "MC_TRANSFER_TIMEOUT" in variables  # the pattern finds them
    undocumented = sorted(v for v in variables if f"`{v}`" not in readme)
    assert not undocumented, f"variables read by config.py but missing from the README: {undocumented}"


def _runnable(block: str) -> bool:
    """A block meant to run as it stands: it starts with its imports and elides nothing."""
    code = re.sub(r"#.*", "", block)
    return code.lstrip().startswith(("import ", "from ")) and "..." not in code


def test_readme_python_examples_run():
    blocks = [b for b in _blocks(_read("README.md"), "python") if _runnable(b)]
    assert len(blocks) >= 4, "the README's runnable examples went missing"
    for block in blocks:
        # Run outside the source tree so the installed package (with its compiled core) is imported.
        out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=90,
                             cwd=ROOT / "examples")
        assert out.returncode == 0, f"{block}\n{out.stdout}{out.stderr}"
