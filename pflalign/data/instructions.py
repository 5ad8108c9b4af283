"""Instruction data: ``dataset = jsonl:PATH_OR_DIR``, the setting of pFLAlign's public seed code
(the LoRA adapters of a causal language model tuned on instructions, Dolly's task categories as
clients).

A JSON Lines file holds one record a line, an object with

- ``instruction`` (a string), ``context`` (optional) and ``response``: Dolly's fields; Alpaca's
  ``instruction``, ``input`` and ``output`` are read as the same three;
- ``client`` (optional): the record's own client, for ``partition = natural``; else, for a
  folder of two or more ``*.jsonl`` files, each file is a client (named by its file); else
  Dolly's ``category`` is the client. A field names the clients only when every record has it.

Each record is one sample of ``sequence-length`` tokens (:func:`instruction_sample`): its prompt
(:data:`PROMPT`, or :data:`PROMPT_WITH_CONTEXT` when its context is not empty), its response and
the tokenizer's end-of-sequence token, tokenized by the model's own tokenizer (no other special
token), padded at the end. Its labels are the next token at every place of the response (its
end-of-sequence token included); the prompt's places and the padding are
:data:`~pflalign.data.datasets.IGNORE_INDEX`, so the loss, the correct counts and the test's
count are the response tokens' only, as supervised fine-tuning scores them. The records are in
no time order: a client's test split is a seeded random one.

What the file holds and which clients it names are read when the config is checked (once per
process and file version), so a bad file is one sentence before anything runs; a path that does
not exist is one when the data is read (a shipped config names data the user fetches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflalign.process.caches import cached
from pflalign.settings.options import ConfigError
from pflalign.settings.schema import CHARACTERS, IGNORE_INDEX, TOKENS

JSONL = "jsonl:"
#: a record's prompt; its response follows it, then the end-of-sequence token
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
#: the prompt of a record with a (non-empty) context
PROMPT_WITH_CONTEXT = ("### Instruction:\n{instruction}\n\n### Context:\n{context}\n\n"
                       "### Response:\n")
#: each field and the keys it is read from, in order (Dolly's, then Alpaca's)
FIELDS = {"instruction": ("instruction",), "context": ("context", "input"),
          "response": ("response", "output")}
#: how a file says to fetch Dolly, for messages
FETCH = ("for Dolly: `wget https://huggingface.co/datasets/databricks/databricks-dolly-15k/"
         "resolve/main/databricks-dolly-15k.jsonl`")


def jsonl_path(name: str) -> Path | None:
    """The file or folder of ``dataset = jsonl:PATH_OR_DIR``, or None for another dataset."""
    if not name.startswith(JSONL):
        return None
    text = name[len(JSONL):].strip()
    if not text:
        raise ConfigError("dataset = 'jsonl:' needs a path: dataset = 'jsonl:/path/to/data.jsonl'"
                          " (or a folder of .jsonl files, one per client).")
    return Path(text).expanduser()


def prompt_of(instruction: str, context: str = "") -> str:
    """A record's prompt: :data:`PROMPT`, or :data:`PROMPT_WITH_CONTEXT` with a context."""
    if context.strip():
        return PROMPT_WITH_CONTEXT.format(instruction=instruction, context=context)
    return PROMPT.format(instruction=instruction)


@dataclass(frozen=True)
class Records:
    """Every record of a ``jsonl:`` dataset, in file and line order, and its clients:
    ``groups[i]`` indexes record ``i``'s client in ``names`` (None: the data names none);
    ``by``: what named them (``client``, ``file``, ``category`` or ``""``)."""

    instructions: tuple[str, ...]
    contexts: tuple[str, ...]
    responses: tuple[str, ...]
    groups: np.ndarray | None
    names: tuple[str, ...]
    by: str


def _where(root: Path) -> str:
    return f"dataset = 'jsonl:{root}'"


def jsonl_files(root: Path) -> list[Path]:
    """The files of ``jsonl:PATH_OR_DIR``: the file, or the folder's ``*.jsonl`` files by name."""
    if not root.exists():
        raise ConfigError(f"{_where(root)}: the file or folder does not exist; give a JSON "
                          f"Lines file of instructions or a folder of them ({FETCH}).")
    if root.is_file():
        return [root]
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and p.suffix == ".jsonl" and not p.name.startswith("."))
    if not files:
        raise ConfigError(f"{_where(root)}: the folder has no .jsonl files; give one file of "
                          "records, or one file per client.")
    return files


def _field(record: dict, keys: tuple[str, ...], at: str) -> str | None:
    """The first of ``keys`` that ``record`` has, as a string (None when it has none, or null)."""
    for key in keys:
        if key in record and record[key] is not None:
            value = record[key]
            if not isinstance(value, str):
                raise ConfigError(f"{at} has a {key} that is a JSON {type(value).__name__}, "
                                  "not a string; give every field as text.")
            return value
    return None


def _client(record: dict, key: str, at: str) -> str | None:
    """A record's ``client`` or ``category`` (a string or an integer), None when it has none."""
    value = record.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{at} has a {key} that is a JSON {type(value).__name__}; give a "
                          "string or an integer.")
    return str(value)


def _parse(path: Path, root: Path) -> list[tuple[str, str, str, str | None, str | None, int]]:
    """Every record of one file: (instruction, context, response, client, category, line)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{_where(root)}: {path.name} cannot be read "
                          f"({err.strerror or err}).") from None
    out = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        at = f"{_where(root)}: {path.name}, line {number},"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{at} is not UTF-8 text ({err.reason} at byte {err.start} of the "
                              "line); convert the file with `iconv -t utf-8`.") from None
        try:
            record = json.loads(text.removeprefix("\ufeff") if number == 1 else text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{at} is not valid JSON ({err.msg} at column {err.colno}); write "
                              "one JSON object per line.") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{at} is a JSON {type(record).__name__}, not an object; write one "
                              "object per line, with instruction and response.")
        fields = {name: _field(record, keys, at) for name, keys in FIELDS.items()}
        for name in ("instruction", "response"):
            if fields[name] is None or not fields[name].strip():
                raise ConfigError(f"{at} has no {name}; every record needs instruction and "
                                  "response strings (Alpaca's output is read as the response).")
        out.append((fields["instruction"], fields["context"] or "", fields["response"],
                    _client(record, "client", at), _client(record, "category", at), number))
    return out


@cached(maxsize=4)
def _read(root: str, files: tuple[tuple[str, int, int], ...]) -> Records:
    """The records of ``root``'s ``files`` (path, size, modification time: a changed file is
    read again)."""
    folder = Path(root)
    parsed = []
    for name, _, _ in files:
        path = Path(name)
        records = _parse(path, folder)
        if not records:
            raise ConfigError(f"{_where(folder)}: {path.name} has no records; every file (a "
                              "client) needs at least one.")
        parsed += [(*record, path) for record in records]
    instructions, contexts, responses, clients, categories, lines, paths = zip(*parsed,
                                                                               strict=True)

    def every(values: tuple[str | None, ...], key: str) -> bool:
        missing = [i for i, v in enumerate(values) if v is None]
        if missing and len(missing) < len(values):
            i = missing[0]
            raise ConfigError(f"{_where(folder)}: {paths[i].name}, line {lines[i]}, has no {key} "
                              f"while other records have one; give every record a {key}, or "
                              "none.")
        return not missing

    if every(clients, "client"):
        by, owners = "client", clients
    elif len(files) > 1:
        by, owners = "file", tuple(p.stem for p in paths)
    elif every(categories, "category"):
        by, owners = "category", categories
    else:
        by, owners = "", None
    groups, names = None, ()
    if owners is not None:
        unique, groups = np.unique(np.array(owners), return_inverse=True)
        groups, names = groups.astype(np.int64), tuple(str(n) for n in unique)
    return Records(instructions, contexts, responses, groups, names, by)


def read_records(name: str) -> Records:
    """The records of ``dataset = jsonl:PATH_OR_DIR`` (read once per process and file version);
    a bad file is one sentence."""
    root = jsonl_path(name)
    files = jsonl_files(root)
    stamps = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _read(str(root), stamps)


def check_instructions(name: str) -> None:
    """A ``jsonl:`` value names readable records, in one sentence if not (a path that does not
    exist yet is refused when the data is read)."""
    root = jsonl_path(name)
    if root.exists():
        read_records(name)


def has_clients(name: str) -> bool:
    """Whether the records name their clients (a path that does not exist yet: assumed so; the
    data's read says it does not exist)."""
    return not jsonl_path(name).exists() or read_records(name).groups is not None


def instruction_sample(prompt: list[int], response: list[int], length: int, pad: int,
                       ) -> tuple[np.ndarray, np.ndarray]:
    """One record as a sample: ``length`` input tokens and their ``length`` labels.

    The record's tokens are ``prompt`` then ``response`` (its end-of-sequence token included); a
    sample sees the first ``length + 1`` of them (inputs ``0..length-1``, labels the next token
    at each place: ``1..length``). A record that does not fit keeps its response's start: the
    prompt is cut from its front to what the response leaves, but to no less than half the
    window, and the response is then cut at the window's end. Inputs past the record are
    ``pad``; every label but the response's is :data:`~pflalign.data.datasets.IGNORE_INDEX`."""
    room = max(length + 1 - len(response), (length + 1) // 2)
    prompt = prompt[-room:] if len(prompt) > room else prompt
    tokens = (prompt + response)[:length + 1]
    inputs = np.full(length, pad, dtype=np.int32)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    shown = tokens[:length]
    inputs[:len(shown)] = shown
    labels[len(prompt) - 1:len(tokens) - 1] = tokens[len(prompt):]
    return inputs, labels


def load_instructions(name: str, tokenizer: str, length: int) -> dict:
    """The fields of the pooled :class:`~pflalign.data.datasets.Dataset` of ``dataset =
    jsonl:PATH_OR_DIR`` (which :func:`pflalign.data.datasets.load_dataset` reads once per
    process): N records as N x ``length`` token ids (int32) and their labels (int64, the
    prompt and padding masked)."""
    records = read_records(name)
    if tokenizer in ("", CHARACTERS):
        raise ConfigError(f"dataset = {name!r} holds instructions for a language model, which "
                          "tokenizes them: set model = hf:<model> (hf:smollm2-135m offline).")
    from pflalign.models.language import tokenizer_of

    tok = tokenizer_of(tokenizer)
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos  # type: ignore[attr-defined]
    prompts = [prompt_of(i, c) for i, c in zip(records.instructions, records.contexts,
                                                strict=True)]
    encode = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    ending = [] if eos is None else [int(eos)]
    rows = [instruction_sample(list(p), list(r) + ending, length, 0 if pad is None else int(pad))
            for p, r in zip(encode(prompts), encode(list(records.responses)), strict=True)]
    images = np.stack([inputs for inputs, _ in rows])
    labels = np.stack([targets for _, targets in rows])
    images.setflags(write=False)
    labels.setflags(write=False)
    return {"name": name, "images": images, "labels": labels, "num_classes": len(tok),
            "mean": (), "std": (), "kind": TOKENS, "groups": records.groups,
            "group_names": records.names, "masked_targets": True}
