"""The documentation: README.md and docs/*.md (length, links), and the man pages (installed by
docs/man/install.sh, rendered by man(1), one for every function chm.h declares)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAN = DOCS / "man"
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code spans, where links are links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def generated_result(target: Path) -> bool:
    """A result file a bench writes (bench/results/<bench>.json or .md, by bench.result_files), which
    exists once the bench has run."""
    bench = ROOT / "bench" / f"{target.stem}.py"
    return (target.parent == ROOT / "bench" / "results" and target.suffix in (".json", ".md") and bench.exists()
            and f'result_files.write("{target.stem}"' in bench.read_text())


def render(*args: str, env: dict | None = None) -> str:
    """man's text of a page, formatting stripped, at a fixed width and in the C locale."""
    assert shutil.which("man"), "man(1) is not installed: `make setup` installs Debian's man-db (APT_PACKAGES)"
    run_env = {**os.environ, "MANWIDTH": "100", "MANPAGER": "cat", "PAGER": "cat", "LC_ALL": "C", **(env or {})}
    out = subprocess.run(["man", *args], capture_output=True, text=True, env=run_env, timeout=60)
    assert out.returncode == 0, out.stderr
    return re.sub(r".\x08", "", out.stdout)


def declarations() -> dict[str, str]:
    """Each function chm.h declares: its prototype, whitespace collapsed."""
    header = (ROOT / "libchm" / "include" / "chm.h").read_text()
    code = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    found = re.finditer(r"^(?!typedef|struct|#)[\w \t]*?[\s*](chm_\w+)\s*\([^;]*\);", code, re.M)
    return {m.group(1): re.sub(r"\s+", " ", m.group(0)).replace("( ", "(") for m in found}


def declared_functions() -> list[str]:
    return list(declarations())


def synopsis_prototypes(roff: str) -> dict[str, str]:
    """The prototypes of a page's SYNOPSIS (.BI lines: quoted type parts, bare parameter names)."""
    protos = {}
    for line in re.findall(r"^\.BI (.*)$", roff.split(".SH SYNOPSIS", 1)[1].split(".SH ", 1)[0], re.M):
        text = re.sub(r"\s+", " ", "".join(quoted or bare for quoted, bare in re.findall(r'"([^"]*)"|(\S+)', line)))
        protos[re.search(r"(chm_\w+)\(", text).group(1)] = text
    return protos


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("prefix")
    subprocess.run([str(MAN / "install.sh"), str(prefix)], check=True, timeout=60)
    return prefix / "share" / "man"


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not (file.exists() or generated_result(file)):
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and file.exists() and anchor not in anchors(file):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_chm_h_declares_the_functions_this_test_reads():
    assert {"chm_open", "chm_read", "chm_reap", "chm_mapping_put"} <= set(declared_functions())


@pytest.mark.parametrize("function", declared_functions())
def test_every_function_of_chm_h_has_a_man_page(function):
    page = MAN / "man3" / f"{function}.3"
    assert page.exists(), f"no man page for {function}: docs/man/man3/{function}.3"
    text = page.read_text()
    link = re.fullmatch(r"\.so (man3/\w+\.3)\n", text)
    if link:
        text = (MAN / link.group(1)).read_text()
    name_line = text.split(".SH NAME\n", 1)[1].split("\n", 1)[0]
    assert re.search(rf"\b{function}\b", name_line), f"{page.name}'s NAME does not list {function}"
    want = re.sub(r"\s*\*\s*", " *", declarations()[function])
    got = synopsis_prototypes(text).get(function)
    assert got is not None and re.sub(r"\s*\*\s*", " *", got) == want, f"{page.name}: {got!r}, chm.h: {want!r}"


def test_chm_read_renders_with_man_l(installed):
    text = render("-l", str(installed / "man3" / "chm_read.3"))
    assert "chm_read - read from a device" in text
    synopsis = text.split("SYNOPSIS", 1)[1].split("DESCRIPTION", 1)[0]
    assert "#include <chm.h>" in synopsis
    assert "ssize_t chm_read(chm_dev *dev, chm_addr addr, void *buf, size_t len);" in synopsis


def test_chm_serve_renders_with_man_l(installed):
    text = render("-l", str(installed / "man1" / "chm-serve.1"))
    assert "chm-serve - run a CXL-HM device" in text
    synopsis = " ".join(text.split("SYNOPSIS", 1)[1].split("DESCRIPTION", 1)[0].split())
    assert synopsis.startswith("chm serve [--profile PROFILE]") and "[--no-native-hits]" in synopsis


def test_a_linked_page_is_found_through_manpath(installed):
    text = render("3", "chm_prefetch_wait", env={"MANPATH": str(installed)})
    assert "chm_prefetch_wait" in text.split("SYNOPSIS", 1)[1]


def test_chm_serve_documents_every_option_of_its_help():
    helped = subprocess.run([str(Path(sys.executable).parent / "chm"), "serve", "--help"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", helped))
    page = (MAN / "man1" / "chm-serve.1").read_text().replace("\\-", "-")
    assert options and not {o for o in options if o not in page}
