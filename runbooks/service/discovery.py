"""The engine inventory: the static `engines:` list and the engines discovery finds.

    inventory = Inventory(config.engines, discovery=config.discovery)
    discovery = Discovery(inventory, sources_from(config.discovery), metrics=metrics)
    discovery.schedule(scheduler, config.discovery.refresh_interval_seconds)
    inventory.engines()                    # what the service acts on now
    inventory.resolve(alert.labels)        # -> Resolution: exactly one engine, or why not

Prometheus already discovers every engine (Kubernetes, Consul, clouds, files);
the service asks it for its active targets (`/api/v1/targets`) of the jobs
that scrape the collector agents, or reads file_sd files (Prometheus' own
format, so anything that writes those works). An engine's agent URL is the
target's scrape URL less its path; its labels are the target's (instance,
pod, namespace, ...); its name is its `instance` label.

Each refresh reads every source; a source that fails keeps what it found last
(counted, and logged once per change of state), never empties the inventory.
An engine that a source no longer reports has *departed*: the service stops
scraping it, its findings resolve, an execution in flight on it ends "engine
gone" (runbooks/run/executor.py) and nothing is reverted on it.

Alert -> engine (`resolve`): the static list first, as it always did (an
entry whose labels the alert carries, else whose name is the alert's
`instance`), then the discovered engines by their identity labels
(`IDENTITY`: namespace, pod, instance; and the alert's DP rank `engine` against
the target's `dp_rank` where both carry one; an alert's `instance` may also
name the agent's or vLLM's address).
Exactly one engine, or nothing runs and the reason is said.
"""

from __future__ import annotations

import glob
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import yaml
from vllm_runbook.rules.config import EngineConfig
from vllm_runbook.runbooks.engine.client import normalize_url
from vllm_runbook.runbooks.model.config import DiscoveryConfig, PrometheusDiscovery, label_matches

log = logging.getLogger("vllm_runbook.service")

STATIC, PROMETHEUS, FILE_SD = "static", "prometheus", "file_sd"
SOURCES: Final = (STATIC, PROMETHEUS, FILE_SD)
# Labels that name where an engine runs: an alert is matched on these.
IDENTITY: Final = ("namespace", "pod", "instance")
DP_RANK: Final = "engine"  # the collector's and vLLM's label for the DP rank (alerts carry it)
# A discovered target's DP rank (not `engine`: a target label of that name would
# rename the agent's own `engine` label to exported_engine). The PodMonitor sets it.
DP_RANK_TARGET: Final = "dp_rank"
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:-]")


class DiscoveryError(Exception):
    """A source could not be read (message: one line)."""


@dataclass(frozen=True)
class Entry:
    """One engine of the inventory: where it came from and when it was last seen."""

    engine: EngineConfig
    source: str
    last_seen: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.engine.name,
            "agent": self.engine.agent,
            "vllm": self.engine.vllm,
            "labels": dict(self.engine.labels),
            "source": self.source,
            "last_seen": self.last_seen,
        }


@dataclass(frozen=True)
class Resolution:
    """An alert's engine, or why there is none (`reason`)."""

    engine: EngineConfig | None
    reason: str | None = None


@dataclass(frozen=True)
class Departed:
    name: str
    source: str
    at: float


def _netloc(url: str | None) -> str | None:
    return urlsplit(url).netloc if url else None


def _strip(url: str) -> str:
    return url.strip().rstrip("/")


class Inventory:
    """The engines in use: static ones (never change) and each source's last good list.

    Thread-safe; readers get immutable snapshots. `version` grows at every change."""

    def __init__(
        self,
        static: Sequence[EngineConfig] = (),
        discovery: DiscoveryConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.tokens = discovery.agent_tokens if discovery is not None else None
        started = clock()
        self._static = tuple(Entry(e, STATIC, started) for e in static)
        self._by_source: dict[str, tuple[Entry, ...]] = {}
        self._lock = threading.Lock()
        self._entries: tuple[Entry, ...] = self._static
        self._by_agent: dict[str, Entry] = {_strip(e.engine.agent): e for e in self._static}
        self._departed: dict[str, Departed] = {}
        self._listeners: list[Callable[[list[Entry], list[Entry]], None]] = []
        self.version = 0

    # -- reading ---------------------------------------------------------------------
    def entries(self) -> tuple[Entry, ...]:
        return self._entries

    def engines(self) -> tuple[EngineConfig, ...]:
        return tuple(e.engine for e in self._entries)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(SOURCES, 0)
        for entry in self._entries:
            out[entry.source] += 1
        return out

    def by_agent(self, url: str) -> Entry | None:
        return self._by_agent.get(_strip(url))

    def api_url(self, agent_url: str) -> str | None:
        entry = self.by_agent(agent_url)
        return entry.engine.vllm if entry is not None else None

    def departed(self, agent_url: str) -> Departed | None:
        """Why an engine is no longer there (None: it is, or never was)."""
        url = _strip(agent_url)
        if url in self._by_agent:
            return None
        return self._departed.get(url)

    def gone_reason(self, agent_url: str) -> str | None:
        gone = self.departed(agent_url)
        if gone is None:
            return None
        return f"engine gone: {gone.name} left the inventory ({gone.source}) at {_iso(gone.at)}"

    def token(self, agent_url: str) -> str | None:
        """The agent's bearer token from the configured files (None: the client's default)."""
        if self.tokens is None:
            return None
        entry = self.by_agent(agent_url)
        labels = dict(entry.engine.labels) if entry is not None else {}
        path = next(
            (t.file for t in self.tokens.by_label if label_matches(t.match, labels)),
            self.tokens.file,
        )
        if path is None:
            return None
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            log.warning("agent token file %s cannot be read: %s", path, exc.strerror)
            return None

    # -- changing --------------------------------------------------------------------
    def on_change(self, listener: Callable[[list[Entry], list[Entry]], None]) -> None:
        """`listener(added, removed)` after every change (on the refreshing thread)."""
        self._listeners.append(listener)

    def update(self, source: str, found: Iterable[EngineConfig]) -> tuple[list[Entry], list[Entry]]:
        """Replace what `source` reports; returns (added, removed) engines."""
        now = self.clock()
        with self._lock:
            before = {_strip(e.engine.agent): e for e in self._entries}
            taken = {_strip(e.engine.agent) for e in self._static}
            taken |= {
                _strip(e.engine.agent)
                for s, entries in self._by_source.items()
                if s != source
                for e in entries
            }
            names = {e.engine.name for e in self._entries if e.source != source}
            mine: list[Entry] = []
            for engine in found:
                url = _strip(engine.agent)
                if url in taken:
                    continue  # listed already (static first): one engine, one entry
                taken.add(url)
                name = engine.name
                n = 2
                while name in names:
                    name, n = f"{engine.name}-{n}", n + 1
                names.add(name)
                if name != engine.name:
                    engine = engine.model_copy(update={"name": name})
                mine.append(Entry(engine, source, now))
            self._by_source[source] = tuple(mine)
            entries = self._static + tuple(
                e for s in sorted(self._by_source) for e in self._by_source[s]
            )
            after = {_strip(e.engine.agent): e for e in entries}
            added = [e for url, e in after.items() if url not in before]
            removed = [e for url, e in before.items() if url not in after]
            for entry in removed:
                self._departed[_strip(entry.engine.agent)] = Departed(
                    entry.engine.name, entry.source, now
                )
            for entry in added:
                self._departed.pop(_strip(entry.engine.agent), None)
            # Keep the departed for a day: an execution started before still finds why.
            for url in [u for u, d in self._departed.items() if now - d.at > 86400]:
                del self._departed[url]
            changed = bool(added or removed) or any(
                after[u].engine != before[u].engine for u in after if u in before
            )
            self._entries = entries
            self._by_agent = after
            if changed:
                self.version += 1
        if added or removed:
            log.info(
                "inventory (%s): %d engine(s) added%s, %d removed%s",
                source,
                len(added),
                f" ({', '.join(e.engine.name for e in added[:10])})" if added else "",
                len(removed),
                f" ({', '.join(e.engine.name for e in removed[:10])})" if removed else "",
            )
        if changed:
            for listener in self._listeners:
                try:
                    listener(added, removed)
                except Exception:
                    log.exception("inventory listener failed")
        return added, removed

    # -- alerts ----------------------------------------------------------------------
    def resolve(self, labels: Mapping[str, str]) -> Resolution:
        """The one engine the alert's labels name (see the module doc)."""
        static = [e.engine for e in self._static]
        by_labels = [
            e for e in static if e.labels and all(labels.get(k) == v for k, v in e.labels.items())
        ]
        if not by_labels:
            instance = labels.get("instance")
            by_labels = [e for e in static if e.name == instance]
        if len(by_labels) == 1:
            return Resolution(by_labels[0])
        if len(by_labels) > 1:
            return _ambiguous(by_labels)
        found = [e.engine for e in self._entries if e.source != STATIC and _matches(e, labels)]
        if len(found) == 1:
            return Resolution(found[0])
        if found:
            return _ambiguous(found)
        shown = ", ".join(f"{k}={labels[k]}" for k in (*IDENTITY, DP_RANK) if k in labels)
        return Resolution(
            None,
            "no engine in the inventory matches the alert's labels"
            + (f" ({shown})" if shown else " (it carries none of instance, pod, namespace)"),
        )


class AgentUrls(Iterable[str]):
    """The inventory's agent URLs (normalized) each time it is iterated (the breaker's)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    def __iter__(self) -> Iterator[str]:
        return iter([normalize_url(e.engine.agent) for e in self.inventory.entries()])


class ApiUrls(Mapping[str, str]):
    """Agent URL -> vLLM's API server URL, as the inventory has it now (the executor's)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    def __getitem__(self, url: str) -> str:
        api = self.inventory.api_url(url)
        if api is None:
            raise KeyError(url)
        return api

    def __iter__(self) -> Iterator[str]:
        return iter(e.engine.agent for e in self.inventory.entries() if e.engine.vllm)

    def __len__(self) -> int:
        return sum(1 for e in self.inventory.entries() if e.engine.vllm)


def _ambiguous(engines: list[EngineConfig]) -> Resolution:
    # Sorted: the inventory's order depends on which source answered first.
    ordered = sorted(e.name for e in engines)
    names = ", ".join(ordered[:5]) + (", ..." if len(engines) > 5 else "")
    return Resolution(
        None,
        f"{len(engines)} engines match the alert's labels ({names}): ambiguous, nothing runs",
    )


def _matches(entry: Entry, labels: Mapping[str, str]) -> bool:
    engine = entry.engine
    compared = 0
    for key in IDENTITY:
        if key not in labels:
            continue
        value = labels[key]
        if key == "instance":
            known = {engine.labels.get("instance"), engine.name}
            known |= {_netloc(engine.agent), _netloc(engine.vllm)}
            if value not in known:
                return False
        elif key in engine.labels:
            if engine.labels[key] != value:
                return False
        else:
            continue
        compared += 1
    if compared and DP_RANK in labels and DP_RANK_TARGET in engine.labels:
        return bool(labels[DP_RANK] == engine.labels[DP_RANK_TARGET])
    return compared > 0


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# -- sources ---------------------------------------------------------------------------


def engine_name(labels: Mapping[str, str], address: str) -> str:
    """The inventory name of a discovered engine: its `instance` label (Prometheus
    sets it to the target's address unless relabelled), with `-dp<N>` where the
    target names its DP rank (`dp_rank`), made a valid name."""
    raw = labels.get("instance") or address
    if DP_RANK_TARGET in labels:
        raw += f"-dp{labels[DP_RANK_TARGET]}"
    name = _NAME_BAD.sub("_", raw).lstrip("_.:-")
    return name or "engine"


def discovered_engine(
    address: str, labels: Mapping[str, str], scheme: str, vllm_port: int | None
) -> EngineConfig:
    """An inventory entry from a target: its address (host:port) and labels."""
    shown = {k: v for k, v in labels.items() if not k.startswith("__")}
    shown.setdefault("instance", address)
    agent = f"{scheme}://{address}"
    vllm = None
    if vllm_port is not None:
        host = urlsplit(agent).hostname or address
        host = f"[{host}]" if ":" in host else host
        vllm = f"{scheme}://{host}:{vllm_port}"
    return EngineConfig.model_validate(
        {"name": engine_name(shown, address), "agent": agent, "vllm": vllm, "labels": shown}
    )


class Source(Protocol):
    name: str

    def read(self) -> list[EngineConfig]:
        """Every engine the source reports now; DiscoveryError when it cannot say."""
        ...


class FileSD:
    """Prometheus' file_sd files (JSON or YAML: a list of {targets: [...], labels: {...}}),
    found by glob patterns; a file is re-read only when it changed (mtime, size)."""

    name = FILE_SD

    def __init__(self, patterns: Sequence[Path | str], vllm_port: int | None = None) -> None:
        self.patterns = [str(p) for p in patterns]
        self.vllm_port = vllm_port
        self._cache: dict[str, tuple[tuple[int, int], list[EngineConfig]]] = {}

    def read(self) -> list[EngineConfig]:
        paths = sorted({p for pattern in self.patterns for p in glob.glob(pattern)})
        if not paths and not any(glob.has_magic(p) for p in self.patterns):
            raise DiscoveryError(f"file_sd: no such file: {', '.join(self.patterns)}")
        engines: list[EngineConfig] = []
        cache: dict[str, tuple[tuple[int, int], list[EngineConfig]]] = {}
        for path in paths:
            try:
                stat = Path(path).stat()
            except OSError as exc:
                raise DiscoveryError(f"file_sd: {path}: {exc.strerror}") from None
            key = (stat.st_mtime_ns, stat.st_size)
            hit = self._cache.get(path)
            found = hit[1] if hit is not None and hit[0] == key else self._read_file(path)
            cache[path] = (key, found)
            engines += found
        self._cache = cache
        return engines

    def _read_file(self, path: str) -> list[EngineConfig]:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise DiscoveryError(f"file_sd: {path}: {exc}") from None
        try:
            data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark is not None else getattr(exc, "lineno", None)
            where = f"{path}:{line}" if line else path
            raise DiscoveryError(f"file_sd: {where}: not valid {_kind(path)}") from None
        return parse_file_sd(data or [], path, self.vllm_port)


def _kind(path: str) -> str:
    return "JSON" if path.endswith(".json") else "YAML"


def parse_file_sd(data: Any, where: str, vllm_port: int | None) -> list[EngineConfig]:
    if not isinstance(data, list):
        raise DiscoveryError(f"file_sd: {where}: expected a list of target groups")
    engines = []
    for i, group in enumerate(data):
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise DiscoveryError(f"file_sd: {where}: group {i} has no `targets` list")
        labels = group.get("labels") or {}
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise DiscoveryError(f"file_sd: {where}: group {i}: labels must map strings to strings")
        scheme = labels.get("__scheme__", "http")
        for target in group["targets"]:
            if not isinstance(target, str) or not target.strip():
                raise DiscoveryError(f"file_sd: {where}: group {i}: a target is not host:port")
            try:
                engines.append(discovered_engine(target.strip(), labels, scheme, vllm_port))
            except ValueError as exc:
                raise DiscoveryError(f"file_sd: {where}: target {target!r}: {exc}") from None
    return engines


class PrometheusSD:
    """A Prometheus' active targets (`/api/v1/targets?state=active`) of the agents' jobs."""

    name = PROMETHEUS

    def __init__(
        self,
        config: PrometheusDiscovery,
        vllm_port: int | None = None,
        get: Callable[[str, dict[str, str]], tuple[int, bytes]] | None = None,
    ) -> None:
        self.config = config
        self.vllm_port = vllm_port
        self._get = get or self._fetch

    def _fetch(self, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        """The scraper's HTTP client (rules/fetch.py), on a loop of its own per refresh."""
        import asyncio
        import ssl

        from vllm_runbook.rules.fetch import Fetcher

        c = self.config
        auth = None
        if c.username is not None and c.password_file is not None:
            auth = (c.username, _secret(c.password_file, "password_file"))
        context = None
        if c.ca_file is not None:
            try:
                context = ssl.create_default_context(cafile=str(c.ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise DiscoveryError(f"prometheus: ca_file {c.ca_file}: {exc}") from None
        fetcher = Fetcher(
            "vllm-runbook-discovery", ssl_context=context, auth=auth, accept="application/json"
        )

        async def get() -> tuple[int, bytes]:
            try:
                async with asyncio.timeout(c.timeout_seconds):
                    return await fetcher.get(url, headers)
            except TimeoutError:
                raise DiscoveryError(
                    f"prometheus {c.url}: no answer within {c.timeout_seconds:g} s"
                ) from None
            finally:
                await fetcher.aclose()

        return asyncio.run(get())

    def read(self) -> list[EngineConfig]:
        c = self.config
        headers: dict[str, str] = {}
        if c.bearer_token_file is not None:
            headers["Authorization"] = f"Bearer {_secret(c.bearer_token_file, 'bearer_token_file')}"
        url = c.url.rstrip("/") + "/api/v1/targets?state=active"
        try:
            status, body = self._get(url, headers)
        except DiscoveryError:
            raise
        except Exception as exc:  # the client's errors: connection, TLS, timeout
            raise DiscoveryError(f"prometheus {c.url}: {type(exc).__name__}: {exc}") from None
        if status != 200:
            raise DiscoveryError(f"prometheus {c.url}: HTTP {status}")
        try:
            data = json.loads(body)
            targets = data["data"]["activeTargets"]
            if not isinstance(targets, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise DiscoveryError(f"prometheus {c.url}: not a /api/v1/targets answer") from None
        return targets_to_engines(targets, c, self.vllm_port)


def targets_to_engines(
    targets: list[Any], config: PrometheusDiscovery, vllm_port: int | None
) -> list[EngineConfig]:
    engines = []
    for target in targets:
        if not isinstance(target, dict):
            continue
        labels = target.get("labels") or {}
        if not isinstance(labels, dict):
            continue
        if config.jobs and labels.get("job") not in config.jobs:
            continue
        if not label_matches(config.match, labels):
            continue
        parts = urlsplit(str(target.get("scrapeUrl", "")))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            continue
        try:
            engines.append(discovered_engine(parts.netloc, labels, parts.scheme, vllm_port))
        except ValueError as exc:
            log.warning("discovery: target %s skipped: %s", parts.netloc, exc)
    return engines


def _secret(path: Path, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise DiscoveryError(f"prometheus: cannot read {what} {path}: {exc.strerror}") from None
    return value


def sources_from(config: DiscoveryConfig) -> list[Source]:
    sources: list[Source] = []
    if config.prometheus is not None:
        sources.append(PrometheusSD(config.prometheus, config.vllm_port))
    if config.file_sd:
        sources.append(FileSD(config.file_sd, config.vllm_port))
    return sources


# -- the refresh -----------------------------------------------------------------------


class DiscoveryObserver(Protocol):
    def discovery_refreshed(self, counts: Mapping[str, int]) -> None: ...

    def discovery_failed(self, source: str) -> None: ...


@dataclass
class Discovery:
    """Refreshes the inventory from its sources: a job of the service's scheduler."""

    inventory: Inventory
    sources: Sequence[Source]
    observer: DiscoveryObserver | None = None
    failing: dict[str, str] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> None:
        """Read every source once; a failing one keeps its last good list."""
        with self._lock:
            for source in self.sources:
                try:
                    found = source.read()
                except DiscoveryError as exc:
                    self._failed(source.name, str(exc))
                    continue
                except Exception as exc:  # a bug must not stop the refresh of the others
                    log.exception("discovery source %s failed", source.name)
                    self._failed(source.name, f"{type(exc).__name__}: {exc}")
                    continue
                if self.failing.pop(source.name, None) is not None:
                    log.warning("discovery source %s works again", source.name)
                self.inventory.update(source.name, found)
            if self.observer is not None:
                self.observer.discovery_refreshed(self.inventory.counts())

    def _failed(self, source: str, error: str) -> None:
        self.failures[source] = self.failures.get(source, 0) + 1
        if self.observer is not None:
            self.observer.discovery_failed(source)
        if source not in self.failing:
            kept = sum(1 for e in self.inventory.entries() if e.source == source)
            log.warning(
                "discovery source %s failed: %s; keeping its last %d engine(s)", source, error, kept
            )
        self.failing[source] = error

    def schedule(self, scheduler: Any, interval_s: float) -> None:
        from datetime import UTC, datetime

        scheduler.add_job(
            self.refresh,
            "interval",
            seconds=interval_s,
            id="vllm-runbook-discovery",
            name="discovery",
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
            next_run_time=datetime.now(UTC),
        )
