"""`runbook rules export` and `runbook rules check`: the alert rule catalog.

`rules export --without-plugin` writes only the rules that work on engines
without the plugin, each reading vLLM's own series where the collector's are
absent (vllm_runbook.rules.needs).

The rules' `runbook` labels (and the configuration's `automation:` keys) are
checked against the runbook catalog the rules are deployed with: `--catalog DIR`
(repeatable), by default the shipped one.

A usage or validation error is raised (USAGE), and the CLI's `main` reports
it on stderr as one line per problem, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_runbook.rules.model import load_catalog
from vllm_runbook.rules.needs import without_plugin
from vllm_runbook.rules.prometheus_operator import (
    DEFAULT_NAME,
    parse_label,
    prometheus_rule,
)
from vllm_runbook.rules.promql import (
    DEFAULT_RUNBOOK_URL_BASE,
    GENERATED_HEADER,
    dump_yaml,
    rule_groups,
)
from vllm_runbook.rules.slo import slo_rule_groups
from vllm_runbook.runbooks.model.catalogs import runbook_names
from vllm_runbook.runbooks.model.config import load_config
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.operate.cli.errors import UsageError


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Add `rules export` and `rules check` to an argparse subparsers object.

    Each leaf parser sets ``func``: call ``args.func(args)`` for the exit code.
    """
    rules = subparsers.add_parser("rules", help="the alert rule catalog")
    sub = rules.add_subparsers(dest="rules_command", metavar="{export,check}", required=True)

    exp = sub.add_parser(
        "export", help="write the catalog as a Prometheus rule file or a PrometheusRule"
    )
    exp.add_argument(
        "--format",
        choices=["prometheus", "prometheus-operator"],
        default="prometheus",
        help="prometheus: a rule file; prometheus-operator: a PrometheusRule resource",
    )
    exp.add_argument(
        "--rules",
        dest="rules_dir",
        type=Path,
        default=None,
        help="rule directory or file (default: the built-in catalog)",
    )
    exp.add_argument(
        "--config", type=Path, default=None, help="configuration file whose rules.overrides apply"
    )
    exp.add_argument("--runbook-url-base", default=DEFAULT_RUNBOOK_URL_BASE)
    exp.add_argument(
        "--without-plugin",
        action="store_true",
        help="only the rules that work on engines without the plugin, reading vLLM's own "
        "series where the collector's are absent (one group: vllm-runbook-without-plugin)",
    )
    operator = exp.add_argument_group("prometheus-operator")
    operator.add_argument(
        "--name", default=None, help=f"the PrometheusRule's name (default {DEFAULT_NAME})"
    )
    operator.add_argument("--namespace", default=None, help="its namespace (default: none)")
    operator.add_argument(
        "--label",
        dest="labels",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label for the Operator's ruleSelector, e.g. release=kube-prometheus-stack "
        "(repeatable)",
    )
    exp.add_argument(
        "-o", "--output", type=Path, default=None, help="file to write (default: stdout)"
    )
    _runbook_catalog(exp)
    exp.set_defaults(func=cmd_export)

    check = sub.add_parser("check", help="validate a rule directory or file")
    check.add_argument(
        "path",
        nargs="?",
        type=Path,
        default=None,
        help="rule directory or file (default: the built-in catalog)",
    )
    check.add_argument(
        "--config",
        type=Path,
        default=None,
        help="also validate this configuration's rules.overrides",
    )
    _runbook_catalog(check)
    check.set_defaults(func=cmd_check)
    return rules


def _runbook_catalog(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--catalog",
        metavar="DIR",
        type=Path,
        action="append",
        help="runbook catalog the rules' runbook labels must name (repeatable; "
        "default: the shipped one)",
    )


def _runbooks(args: argparse.Namespace) -> list[str]:
    """The runbook catalog's names (a broken catalog raises its CatalogError)."""
    return runbook_names(args.catalog)


def cmd_export(args: argparse.Namespace) -> int:
    operator_options = args.name is not None or args.namespace is not None or args.labels
    if args.format != "prometheus-operator" and operator_options:
        raise UsageError("--name, --namespace and --label need --format prometheus-operator")
    runbooks = _runbooks(args)
    config = load_config(args.config, runbooks=runbooks)
    rules = config.bind(load_catalog(args.rules_dir or config.catalog, runbooks=runbooks))
    if args.without_plugin:
        rules = without_plugin(rules)
    # The configuration's SLOs: a group each, recording rules and burn-rate alerts.
    groups = rule_groups(rules, runbook_url_base=args.runbook_url_base) + slo_rule_groups(
        config.slos, runbook_url_base=args.runbook_url_base
    )
    if args.format == "prometheus-operator":
        resource = prometheus_rule(
            groups,
            name=args.name or DEFAULT_NAME,
            namespace=args.namespace,
            labels=dict(parse_label(text) for text in args.labels),
        )
        text = GENERATED_HEADER + dump_yaml(resource)
    else:
        text = GENERATED_HEADER + dump_yaml({"groups": groups})
    if args.output is None:
        sys.stdout.write(text)
    else:
        try:
            args.output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
    return ExitCode.OK


def cmd_check(args: argparse.Namespace) -> int:
    runbooks = _runbooks(args)
    config = load_config(args.config, runbooks=runbooks)
    catalog = load_catalog(args.path or config.catalog, runbooks=runbooks)
    rules = config.bind(catalog)
    files = len({r.file for r in rules})
    print(f"ok: {len(rules)} rules ({len(catalog.alerts)} alerts) in {files} files")
    return ExitCode.OK
