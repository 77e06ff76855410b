"""Runbook catalogs for tests that need a runbook to act where the shipped one
would refuse ("nothing to improve"): what those tests check is not the verdict."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from vllm_runbook.runbooks.model.spec import CATALOG_DIR


def acting_catalog(tmp: Path, runbook: str = "oom-pressure") -> Path:
    """The shipped runbook catalog, with `runbook`'s `acts_only_if` taken out
    (shipped, oom-pressure refuses an engine without preemptions)."""
    out = tmp / "catalog"
    shutil.copytree(CATALOG_DIR, out)
    path = out / f"{runbook}.yaml"
    doc = yaml.safe_load(path.read_text())
    assert doc.pop("acts_only_if")  # the shipped runbook's refusal, there to take out
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def catalog_with(tmp: Path, runbook: str, **fields: object) -> Path:
    """The shipped runbook catalog with top-level `fields` of `runbook` replaced
    (e.g. a threshold a test cannot wait for)."""
    out = tmp / "catalog"
    shutil.copytree(CATALOG_DIR, out)
    path = out / f"{runbook}.yaml"
    doc = yaml.safe_load(path.read_text())
    for key, value in fields.items():
        assert key in doc, key  # replacing, not adding
        doc[key] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out
