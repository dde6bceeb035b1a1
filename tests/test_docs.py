"""The documentation's own checks: short README, every public name documented, every module on the architecture
page, every python block parses, and the snippet and figure runners fail on a broken block or a changed figure."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

import zjax

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load(name: str) -> types.ModuleType:
    if str(DOCS) not in sys.path:
        sys.path.insert(0, str(DOCS))  # the runners import their sibling _pages
    spec = importlib.util.spec_from_file_location(f"zjax_docs_{name}", DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


pages = _load("_pages")
installs = _load("_installs")
snippets = _load("snippets")
figures = _load("figures")


def test_readme_is_an_introduction():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines; the reference belongs in docs/"


def _public(module: types.ModuleType) -> dict[str, object]:
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in names}


def _documented_names() -> dict[str, object]:
    """Every public name of zjax and of its subpackages, with the dotted name the API page must use."""
    found: dict[str, object] = {}
    for name, obj in _public(zjax).items():
        if isinstance(obj, types.ModuleType):
            for sub, member in _public(obj).items():
                if isinstance(member, types.ModuleType) or getattr(zjax, sub, None) is member:
                    continue  # a module, or re-exported at the top level (documented there)
                found[f"zjax.{name}.{sub}"] = member
        else:
            found[f"zjax.{name}"] = obj
    return found


def test_every_public_name_has_a_docstring_and_an_api_entry():
    assert "Plan" in zjax.__all__ and "train" in zjax.__all__
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\.\. auto(?:class|function|data):: (\S+)", api, re.M))
    names = _documented_names()
    missing = sorted(n for n in names if n not in listed)
    assert not missing, f"public names missing from docs/api.md: {missing}"
    undocumented = sorted(
        n
        for n, obj in names.items()
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (inspect.getdoc(obj) or "").strip()
    )
    assert not undocumented, f"public names without a docstring: {undocumented}"
    stale = sorted(listed - set(names))
    assert not stale, f"docs/api.md lists names that are not public: {stale}"


def test_architecture_page_names_every_module():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    rows: dict[str, str] = {}
    current = None
    for line in text.split("\n"):
        m = re.match(r"^(zjax/\S*)\s", line)
        if m:
            current = m.group(1)
            rows[current] = ""
        if current:
            rows[current] += line
    missing = []
    for path in sorted((ROOT / "zjax").rglob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if path.stem == "__init__" and folder != "zjax/":
            continue
        if not re.search(rf"(?<![\w]){re.escape(path.stem)}(?![\w])", rows.get(folder, "")):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


def test_every_python_block_parses():
    for page in pages.pages():
        for block in pages.blocks(page):
            if block.lang == "python":
                compile(block.text, block.where, "exec")


def _page(tmp_path: Path, body: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(body, encoding="utf-8")
    return page


def test_a_broken_snippet_fails_the_run(tmp_path):
    good = "```python\nx = 2\n```\n\n```python\n# continues the block above\nassert x == 2\n```\n"
    assert snippets.main(["--here", str(_page(tmp_path, good))]) == 0
    fragment = "```python\nx = 2\n```\n\n```python\nassert x == 2  # needs the block above, and says nothing\n```\n"
    assert snippets.main(["--here", str(_page(tmp_path, fragment))]) == 1
    assert snippets.main(["--here", str(_page(tmp_path, "```bash\nfalse\n```\n"))]) == 1
    skipped = "```python\n# needs a GPU\nraise SystemExit(1)\n```\n"
    assert snippets.main(["--here", str(_page(tmp_path, skipped))]) == 0
    with pytest.raises(SyntaxError):  # a block CI cannot run still parses
        snippets.main(["--here", str(_page(tmp_path, "```python\n# needs a GPU\nfor\n```\n"))])


def test_each_block_runs_with_the_extras_its_page_has_named_by_then(tmp_path):
    page = _page(
        tmp_path,
        '```bash\n# run by .ci/run\npython3 -m venv .venv && . .venv/bin/activate && pip install -q -e ".[test]" '
        "&& pytest\n```\n\n"  # CI's command: installs nothing for the page
        "```python\nimport zjax\n```\n\n"
        '```bash\npip install -e ".[hf]"\n```\n\n'  # the page's install block
        "```python\nimport safetensors\n```\n\n"
        '```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -e ".[plot]" && zjax train\n```\n\n'
        "```bash\nzjax plan\n```\n",
    )
    assert list(installs.extras_by_line(page).values()) == [
        set(),
        set(),
        {"hf"},
        {"hf"},
        {"hf", "plot"},
        {"hf", "plot"},
    ]
    runs, commands, skipped = snippets.chains(page)
    assert [b.line for b in skipped] == [1, 10]  # CI's own command, and the install block (the environment)
    assert [b.line for b in commands] == [18, 22]
    with pytest.raises(SystemExit, match="unknown extras"):
        installs.Environments().prepare([frozenset({"hf"}), frozenset({"no-such-extra"})])


def test_an_edited_figure_fails_the_check(tmp_path):
    figure = "```bash\necho 'stage 3: 1.474 GB, compiled in 6.9s'\n```\n\n```text\n{}\n```\n"
    page = _page(tmp_path, figure.format("stage 3: 1.474 GB, compiled in  12.0s"))
    assert figures.main(["--check", "--here", str(page)]) == 0  # durations are wall-clock, not compared
    page = _page(tmp_path, figure.format("stage 3: 1.475 GB, compiled in 6.9s"))
    assert figures.main(["--check", "--here", str(page)]) == 1
    assert figures.main(["--write", "--here", str(page)]) == 0
    assert "1.474 GB" in page.read_text() and figures.main(["--check", "--here", str(page)]) == 0
    tolerant = "```bash\n# figures within 1% across CPUs\necho 'loss 2.000'\n```\n\n```text\nloss {}\n```\n"
    assert figures.main(["--check", "--here", str(_page(tmp_path, tolerant.format("2.010")))]) == 0
    assert figures.main(["--check", "--here", str(_page(tmp_path, tolerant.format("2.100")))]) == 1


def test_a_figure_repeated_on_two_pages_is_computed_once_and_checked_on_both(tmp_path):
    count = tmp_path / "count"
    figure = f"```bash\necho x >> {count} && echo 'loss 2.000'\n```\n\n```text\nloss {{}}\n```\n"
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text(figure.format("2.000"), encoding="utf-8")
    b.write_text(figure.format("2.000"), encoding="utf-8")
    assert figures.main(["--check", "--here", str(a), str(b)]) == 0
    assert count.read_text().count("x") == 1
    b.write_text(figure.format("2.001"), encoding="utf-8")
    assert figures.main(["--check", "--here", str(a), str(b)]) == 1


def test_a_measured_figure_must_say_when_where_and_at_which_commit(tmp_path):
    measured = "```bash\n# measured on {}\nexit 1\n```\n\n```text\n0.197 s per step\n```\n"
    ok = measured.format("2026-11-26, one NVIDIA H200, commit 0e6ee88")
    assert figures.main(["--check", "--here", str(_page(tmp_path, ok))]) == 0  # not recomputed
    assert figures.main(["--check", "--here", str(_page(tmp_path, measured.format("a GPU, some day")))]) == 1
