"""docs/privacy.md's table of what leaves a client covers every method: each method that runs
under dp has a row, and each one the docs call refused is refused."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from pflalign.methods.registry import METHODS
from pflalign.settings.options import ConfigError

DOC = (ROOT / "docs" / "privacy.md").read_text()


def table_names() -> set[str]:
    """The method names of the table's first column ('pflalign-*' stands for the ablations)."""
    section = DOC.split("## What leaves a client, per method")[1].split("\n## ")[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            first = line.split("|")[1]
            names |= set(re.findall(r"[a-z][a-z0-9-]*\*?", first.split("(")[0]))
    return names


def test_every_method_that_runs_under_dp_has_a_row_and_every_other_is_named_refused():
    names = table_names()
    refused = DOC.split("Refused under dp, each in one sentence")[1].split("\n\n")[0]
    for name, spec in METHODS.items():
        if spec.method.private:
            assert name in names or (name.startswith("pflalign-") and "pflalign-*" in names), \
                name
        else:
            assert re.search(rf"\b{re.escape(name)}\b \(", refused), name


@pytest.mark.parametrize("name", [n for n, s in METHODS.items() if not s.method.private])
def test_a_method_the_docs_call_refused_is_refused_under_either_dp(name):
    from pflalign.run.config import build_settings

    for dp in ("central", "local"):
        with pytest.raises(ConfigError, match=re.escape(f"{name} cannot run dp = '{dp}'")):
            build_settings({"dp": dp, "methods": name, "eval-audit-fraction": 0.0})
