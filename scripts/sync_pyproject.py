"""Rewrite pyproject.toml's [tool.flwr.app.config] block from the config schema's defaults."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.config import defaults, toml_literal  # noqa: E402

BEGIN, END = "# BEGIN GENERATED CONFIG", "# END GENERATED CONFIG"


def generated_block() -> str:
    lines = [f"{key} = {toml_literal(value)}" for key, value in defaults().items()]
    return "\n".join([BEGIN, *lines, END])


def main() -> None:
    path = ROOT / "pyproject.toml"
    text = path.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + generated_block() + text[stop:])
    print(f"updated {path}")


if __name__ == "__main__":
    main()
