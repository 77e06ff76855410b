"""`runbook serve`: the service assembled from its configuration (`build`) and run
(`cmd_serve`); its options are vllm_runbook.runbooks.operate.cli.serve's."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_runbook.collector.auth import TokenError, is_loopback, runtime_dir
from vllm_runbook.runbooks.model.exit_codes import ExitCode
from vllm_runbook.runbooks.service import heap

if TYPE_CHECKING:
    from vllm_runbook.runbooks.service.lifecycle import Service


def read_credentials_from_env() -> Any:
    """An optional token that may read the /api routes but not post webhooks."""
    from vllm_runbook.runbooks.service.auth import Credentials

    token = os.environ.get("RUNBOOK_READ_TOKEN", "").strip()
    return Credentials(token=token) if token else None


def _read_secret(path: Path, what: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise TokenError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not value:
        raise TokenError(f"{what} {path} is empty")
    return value


def credentials_from(config: Any, host: str) -> Any:
    """The webhook's credentials: configured, or a generated token stored
    0600 in the runtime directory (loopback only)."""
    from vllm_runbook.runbooks.service.auth import Credentials

    webhook = config.webhook
    name = webhook.token_name  # who an answer with the token is recorded as
    if webhook.token_file is not None:
        return Credentials(token=_read_secret(webhook.token_file, "webhook token_file"), name=name)
    if webhook.username and webhook.password_file is not None:
        password = _read_secret(webhook.password_file, "webhook password_file")
        return Credentials(username=webhook.username, password=password)
    env = os.environ.get("RUNBOOK_WEBHOOK_TOKEN", "").strip()
    if env:
        return Credentials(token=env, name=name)
    if not is_loopback(host):
        raise TokenError(
            f"binding to {host} (not loopback) needs webhook credentials "
            "(webhook.token_file, or username + password_file)"
        )
    directory = runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / "webhook.token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    logging.getLogger("vllm_runbook.service").warning(
        "webhook token generated in %s: point Alertmanager's credentials_file there", path
    )
    return Credentials(token=_read_secret(path, "webhook token"), name=name)


def build(
    config_path: str | None,
    db: str | None,
    host: str,
    worker: bool = True,
    rules: bool = True,
    catalog: list[Path] | None = None,
    freeze_heap: bool = False,
) -> Service:
    """The service: config, store (migrated), app, and its jobs (none started:
    the app's lifespan starts them); raises the errors the CLI maps.
    `freeze_heap`: the process is the service's own (`runbook serve`): its
    long-lived objects leave garbage collection (service/heap.py)."""
    from vllm_runbook.runbooks.engine.client import normalize_url
    from vllm_runbook.runbooks.engine.operations import engine_registry
    from vllm_runbook.runbooks.engine.router import router_bindings
    from vllm_runbook.runbooks.model.catalogs import load_deployment
    from vllm_runbook.runbooks.service.app import create_app
    from vllm_runbook.runbooks.service.browser import BrowserPolicy
    from vllm_runbook.runbooks.service.discovery import (
        AgentUrls,
        ApiUrls,
        Discovery,
        Inventory,
        sources_from,
    )
    from vllm_runbook.runbooks.service.lifecycle import Service
    from vllm_runbook.runbooks.service.retention import Retention
    from vllm_runbook.runbooks.service.telemetry import ServiceMetrics
    from vllm_runbook.runbooks.service.webhooks import GroupCommitter, Router
    from vllm_runbook.runbooks.store import Journal, upgrade

    # The configuration, the rule catalog it names and the runbook catalog
    # (--catalog), each checked against the others: names come from them.
    registry = engine_registry()
    deployment = load_deployment(config_path, catalog, registry)
    config, runbooks = deployment.config, deployment.runbooks
    url = db or config.database
    upgrade(url)
    store = Journal(url)
    # The engines: the static list, and what discovery finds (service/discovery.py).
    inventory = Inventory(config.engines, config.discovery)
    router = Router(
        engines=config.engines,
        automation=config.automation,
        alert_runbooks=deployment.alert_runbooks,
        known_runbooks=frozenset(runbooks),
        inventory=inventory,
        advisory=config.advisory(runbooks),
    )
    metrics = ServiceMetrics(
        engine_names={normalize_url(e.agent): e.name for e in config.engines},
        runbooks=sorted(runbooks),
        scrape_targets=[t.url for e in config.engines for t in e.targets()] if rules else (),
        receivers=[r.name for r in config.notifications.receivers],
    )

    def named(added: list[Any], removed: list[Any]) -> None:
        for entry in added:  # executions are keyed by the agent URL
            metrics.engine_names[normalize_url(entry.engine.agent)] = entry.engine.name
        for entry in removed:  # no longer scraped: no duration series left behind
            for target in entry.engine.targets():
                with contextlib.suppress(KeyError):
                    metrics.scrape_duration.remove(target.url)

    inventory.on_change(named)
    # The webhook's writer: a job of the service's scheduler, the app's to feed.
    committer = GroupCommitter(store, router)
    discovery = None
    if config.discovery.enabled:
        discovery = Discovery(inventory, sources_from(config.discovery), observer=metrics)
    runner = None
    breaker = None
    if worker:
        from vllm_runbook.runbooks.engine.client import EngineClient
        from vllm_runbook.runbooks.run.executor import Executor
        from vllm_runbook.runbooks.service.breaker import Breaker
        from vllm_runbook.runbooks.service.breaker_job import BreakerJob
        from vllm_runbook.runbooks.service.worker import Worker

        executor = Executor(
            store,
            runbooks,
            registry,
            client_factory=lambda url: EngineClient(url, token=inventory.token(url)),
            api_urls=ApiUrls(inventory),
            routers=router_bindings(config.engines),
            gone=inventory.gone_reason,
            breaker_hold_seconds=config.breaker.cooldown_seconds if config.breaker.enabled else 0.0,
            slos=config.slos,
            alert_for_seconds=deployment.alert_for_seconds,
        )
        if config.breaker.enabled:
            breaker = BreakerJob(
                Breaker(
                    store,
                    executor,
                    config.breaker,
                    engines=AgentUrls(inventory),  # static and discovered, as they are now
                    on_trip=metrics.breaker_tripped,
                )
            )
        runner = Worker(
            store,
            executor,
            waits=config.executor,
            metrics=metrics,
            approval_timeout_s=config.approvals.timeout_seconds,
        )
    leader = None
    if rules and (config.engines or discovery is not None):
        from vllm_runbook.runbooks.service.leader import RulesLeader
        from vllm_runbook.runbooks.service.rules_service import RulesService
        from vllm_runbook.runbooks.service.worker import ExecutorHook

        hook = ExecutorHook(store, runner, router.advisory) if runner is not None else None
        names = list(runbooks)
        # a broken catalog fails the start, not a cycle
        RulesService.from_config(config, runbooks=names).close()
        metrics.rules_evaluation_interval.set(config.evaluation_interval)
        leader = RulesLeader(
            store,
            lambda: RulesService.from_config(
                config,
                store=store,
                hook=hook,
                metrics=metrics,
                runbooks=names,
                inventory=inventory,
            ),
            config.leader_lease,
            metrics=metrics,
            split=config.rules.replicas == "split",
            freeze_heap=freeze_heap,
        )
    credentials = credentials_from(config, host)
    notifier = None
    if config.notifications.receivers:
        from vllm_runbook.runbooks.service.notify import Notifier

        try:
            notifier = Notifier.from_config(store, config.notifications, metrics=metrics)
        except OSError as exc:
            raise TokenError(f"notifications: cannot read a receiver's token_file: {exc}") from None
    service = Service(
        config,
        store,
        runbooks,
        metrics,
        Retention(store, config.retention, metrics),
        worker=runner,
        leader=leader,
        notifier=notifier,
        discovery=discovery,
        breaker=breaker,
        committer=committer,
    )
    status = (lambda: {"rules_leader": leader.is_leader}) if leader is not None else None
    service.app = create_app(
        store,
        router,
        credentials,
        runner,
        metrics=metrics,
        status=status,
        # Off loopback the journal's reads (engines, alert labels, reasons) need credentials.
        protect_reads=not is_loopback(host),
        read_credentials=read_credentials_from_env(),
        approval_timeout_s=config.approvals.timeout_seconds,
        # The names the page and the open reads answer to (a rebound DNS name gets 400).
        browser=BrowserPolicy.build(
            credentials.secret,
            page_url=config.notifications.page_url,
            hosts=config.page.hosts,
            bind_host=host,
        ),
        limits=config.limits,
        lifespan=service.lifespan,
        inventory=inventory,
        engines=config.engines,
        committer=committer,
    )
    return service


def unreadable_at_start(
    engines: Any, runbooks: Any, client_factory: Any = None, timeout: float = 5.0
) -> list[str]:
    """What `runbook serve` logs at start: per configured engine, each check,
    verification signal and guard of the loaded runbooks that cannot be read
    there and why; for engines that do not answer yet, once for the catalog,
    what their configuration alone rules out (the API server's signals)."""
    from vllm_runbook.runbooks.engine.client import EngineClient, EngineClientError
    from vllm_runbook.runbooks.engine.operations import SignalReader
    from vllm_runbook.runbooks.engine.sources import API_SIGNALS, NO_API_URL, unreadable

    make = client_factory or (lambda url: EngineClient(url, timeout=timeout))
    lines: list[str] = []
    unreached: list[Any] = []
    for engine in engines:
        try:
            reader = SignalReader(make(engine.agent), api_url=engine.vllm)
            reader.read()
        except (EngineClientError, OSError) as exc:
            unreached.append((engine, exc))
            continue
        found = unreadable(runbooks, reader.unavailable)
        lines.append(f"engine {engine.name} ({engine.agent}): {len(found)} cannot be read")
        lines += [f"  {line}" for line in found]
    if unreached or not engines:
        where = "; ".join(f"{e.name} ({exc})" for e, exc in unreached) or "none configured"
        lines.append(f"catalog (engines not reachable yet: {where}): the rest is read at each run")
        if not engines or any(not e.vllm for e, _ in unreached):
            found = unreadable(runbooks, dict.fromkeys(API_SIGNALS, NO_API_URL))
            lines += [f"  {line}" for line in found]
    return lines


def log_unreadable_at_start(engines: Any, runbooks: Any) -> None:
    lines = unreadable_at_start(engines, runbooks)
    if lines:
        logging.getLogger("vllm_runbook.service").warning(
            "signals the runbooks name that cannot be read:\n%s", "\n".join(lines)
        )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from vllm_runbook.runbooks.service.limits import MAX_HEAD_BYTES, timed_h11_protocol

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per scrape and per scheduled cycle would drown what matters.
    for chatty in ("httpx", "apscheduler"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # A broken catalog or configuration, a token, the store: raised to the CLI's `main`.
    service = build(
        args.config,
        args.db,
        args.host,
        not args.no_worker,
        not args.no_rules,
        args.catalog,
        freeze_heap=True,
    )
    log_unreadable_at_start(service.config.engines, service.runbooks)
    heap.freeze("built")  # the imports and the app: alive as long as the process
    # The jobs start and stop with the app (its lifespan: service/lifecycle.py).
    # uvicorn re-raises SIGTERM/SIGINT after its shutdown (the default action
    # ends the process), so the `finally` below is for a start that failed.
    limits = service.config.limits
    app = service.app
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            # h11 with a deadline on each request head and the connections counted
            # per client (service/limits.py); the body's limit and deadline and the
            # connection limit's 503 (not on /healthz) are the app's RequestLimits.
            # No limit_concurrency: uvicorn's would answer the probes 503 as well.
            http=timed_h11_protocol(
                limits.header_timeout_seconds, app.state.refused, app.state.connections
            ),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            # Hinted int, used as a float (call_later): a fraction of a second is kept.
            timeout_keep_alive=limits.keep_alive_seconds,  # type: ignore[arg-type]
        )
    finally:
        service.stop()
    return ExitCode.OK
