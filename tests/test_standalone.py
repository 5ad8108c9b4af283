"""The repository stands alone: no file names the specification that used to live outside it, and
every citation of docs/algorithms.md (as in "docs/algorithms.md 1.4, 1.8", "2.3-2.5",
"1.13 A6" or "3.2 steps 1-5") names a section, item or step that the page has.

The files are those git knows of (tracked, plus untracked files that are not ignored), so a new
file is checked before it is committed; binary files are skipped.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "algorithms.md"
#: the old, external specification's file name, built so that this file does not contain it
FORBIDDEN = "ALGORITHMS" + ".md"

_NUM = r"\d+(?:\.\d+)*"
_REF = rf"{_NUM}(?:-{_NUM})?"
#: a citation: section numbers or ranges joined by commas or "and", then an optional item of the
#: first section (an ambiguity such as A6, or "step 2", "steps 1-12", "item 1")
CITATION = re.compile(
    r"docs/algorithms\.md\s+"
    rf"(?P<refs>{_REF}(?:(?:,\s*|\s+and\s+){_REF})*)"
    r"(?:\s+(?:(?P<ambiguity>A\d+)\b|(?:steps?|items?)\s+(?P<first>\d+)(?:-(?P<last>\d+))?))?")
HEADING = re.compile(rf"^#{{2,4}} (?P<number>{_NUM})\.? ", re.M)


def repository_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in sorted(set(out.stdout.decode().split("\0"))) if name]


def text_files() -> dict[str, str]:
    """Each text file's path (relative to the root) and its contents."""
    texts = {}
    for path in repository_files():
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        texts[str(path.relative_to(ROOT))] = data.decode("utf-8", errors="replace")
    return texts


def sections() -> dict[str, str]:
    """docs/algorithms.md's numbered sections: the number (``"1.13"``) and the section's text up
    to the next heading."""
    text = SPEC.read_text()
    found = list(HEADING.finditer(text))
    nexts = [m.start() for m in re.finditer(r"^#+ ", text, re.M)] + [len(text)]
    return {m["number"]: text[m.end():min(n for n in nexts if n > m.start())] for m in found}


def _numbers(ref: str) -> list[str]:
    return ref.split("-")


def problems(path: str, text: str, known: dict[str, str]) -> list[str]:
    found = []
    for m in CITATION.finditer(text):
        where = f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m[0].split())!r}"
        refs = re.split(r",\s*|\s+and\s+", m["refs"])
        for number in (n for ref in refs for n in _numbers(ref)):
            if number not in known:
                found.append(f"{where}: no section {number}")
        first = _numbers(refs[0])[0]
        body = known.get(first, "")
        if m["ambiguity"] and not re.search(rf"^\| {m['ambiguity']} \|", body, re.M):
            found.append(f"{where}: section {first} has no item {m['ambiguity']}")
        if m["first"]:
            steps = {int(s) for s in re.findall(r"^(\d+)\. ", body, re.M)}
            for step in filter(None, (m["first"], m["last"])):
                if int(step) not in steps:
                    found.append(f"{where}: section {first} has no numbered step {step}")
    return found


def test_the_specification_has_its_sections():
    known = sections()
    for number in ("0", "1", "1.4", "1.6", "1.13", "2", "2.3", "2.5", "3.2", "3.3", "4.2", "4.3",
                   "6"):
        assert number in known, number
    assert re.search(r"^\| A6 \|", known["1.13"], re.M)
    assert {str(i) for i in range(1, 13)} <= set(re.findall(r"^(\d+)\. ", known["2.3"], re.M))


def test_no_file_names_the_external_specification():
    offenders = [path for path, text in text_files().items() if FORBIDDEN in text]
    assert not offenders, f"{FORBIDDEN} is named in {offenders}: cite docs/algorithms.md instead"


def test_every_citation_names_an_existing_section():
    known = sections()
    texts = text_files()
    cited = sum(len(CITATION.findall(text)) for text in texts.values())
    assert cited > 20  # the code, tests and docs do cite it
    found = [p for path, text in texts.items() for p in problems(path, text, known)]
    assert not found, "\n".join(found)


def test_the_citation_check_catches_a_missing_section():
    known = sections()
    cite = "docs/algorithms" + ".md"
    assert problems("x", f"({cite} 1.4, 1.8 and 2.3-2.5; {cite} 1.13 A6)", known) == []
    assert problems("x", f"({cite} 3.2 steps 1-5; {cite} 4.3 item 1)", known) == []
    assert problems("x", f"({cite} 1.99)", known)
    assert problems("x", f"({cite} 1.4, 7.1)", known)
    assert problems("x", f"({cite} 2.3-2.99)", known)
    assert problems("x", f"({cite} 1.13 A99)", known)
    assert problems("x", f"({cite} 3.2 steps 1-40)", known)
