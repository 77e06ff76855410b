"""Write the generated files of dashboards/: the Grafana dashboards and the
Prometheus rule file.

    python -m vllm_runbook.dashboards.generate          # rewrite what changed
    python -m vllm_runbook.dashboards.generate --check  # exit 1 listing stale files (CI)

The dashboards take their thresholds from the rule catalog's defaults, and
the rule file is `runbook rules export --format prometheus` of the same
catalog, so a change to rules/catalog makes both stale until regenerated.
The hand-written files beside them (prometheus.yml, alertmanager.yml,
provisioning/) are not touched.

The dashboards are built with Grafana's own types (the Grafana Foundation
SDK, the release pinned in pyproject's `dashboards` extra, which the `dev`
extra includes). Only regenerating needs it, so it is imported here, when a
render starts, and a missing or different release is said, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from vllm_runbook.dashboards.catalog import all_known_series
from vllm_runbook.dashboards.lint import problems, rule_problems
from vllm_runbook.dashboards.queries import RuleNotes
from vllm_runbook.rules import export, load_catalog

DASHBOARDS_DIR = Path(__file__).resolve().parent
RULE_FILE = "vllm-runbook-rules.yml"
SDK, SDK_MODULE = "grafana-foundation-sdk", "grafana_foundation_sdk"
INSTALL = "pip install -e '.[dev]' (or 'vllm-runbook[dashboards]')"


class DashboardError(Exception):
    """A dashboard that Grafana could not load or whose queries name unknown series,
    or no Grafana SDK of the pinned release to build them with."""


def sdk_pin() -> str | None:
    """The SDK release this installation of vllm-runbook pins (its `dashboards` extra)."""
    try:
        requires = importlib.metadata.requires("vllm-runbook") or []
    except importlib.metadata.PackageNotFoundError:
        return None  # run from a source tree that is not installed
    for requirement in requires:
        match = re.match(rf"{SDK}\s*==\s*([^\s;]+)", requirement)
        if match:
            return match.group(1)
    return None


def dashboard_builders() -> Mapping[str, Callable[[RuleNotes], dict[str, Any]]]:
    """The definitions, imported with the SDK they are built with."""
    try:
        from vllm_runbook.dashboards.definitions import DASHBOARDS
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != SDK_MODULE:
            raise
        raise DashboardError(f"{SDK} is not installed; to regenerate: {INSTALL}") from None
    installed, pin = importlib.metadata.version(SDK), sdk_pin()
    if pin is not None and installed != pin:
        raise DashboardError(
            f"{SDK} {installed} is installed but vllm-runbook pins {pin} (one release per "
            f"Grafana version, and their JSON differs); reinstall: {INSTALL}"
        )
    return DASHBOARDS


def render_all() -> dict[str, str]:
    """{file name in dashboards/: its full text}."""
    builders = dashboard_builders()
    catalog = load_catalog()
    notes = RuleNotes(catalog.bind())
    out: dict[str, str] = {}
    for name, build in builders.items():
        dashboard = build(notes)
        found = problems(dashboard)
        if found:
            raise DashboardError(f"{name}:\n  " + "\n  ".join(found))
        out[name] = json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"
    out[RULE_FILE] = export(catalog)
    found = rule_problems(yaml.safe_load(out[RULE_FILE])["groups"], all_known_series())
    if found:
        raise DashboardError(f"{RULE_FILE}:\n  " + "\n  ".join(found))
    return out


def stale_files(directory: Path = DASHBOARDS_DIR) -> list[str]:
    """The generated files whose checked-in text differs from a fresh render."""
    stale = []
    for name, text in render_all().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_runbook.dashboards.generate", description=__doc__
    )
    parser.add_argument("--check", action="store_true", help="only report stale files")
    parser.add_argument("--out", type=Path, default=DASHBOARDS_DIR, help="target directory")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except DashboardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_files(args.out)
        for name in stale:
            print(f"stale: dashboards/{name} (run: python -m vllm_runbook.dashboards.generate)")
        return 1 if stale else 0
    for name, text in render_all().items():
        path = args.out / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
