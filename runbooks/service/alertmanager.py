"""The Alertmanager webhook payload (version 4), validated.

Unknown fields are ignored (newer Alertmanagers add some); the fields the
service relies on are required and typed, so a malformed delivery is refused
with a 4xx before anything is stored.

A well-formed time can still be one the journal cannot hold: startsAt
0001-01-01T00:30:00+01:00 is before year 1 in UTC (Python cannot even convert
it). Such an alert is rejected on its own (`Alert.starts_at_problem`), and the
rest of its group is stored: a 4xx or 5xx for the whole delivery would drop
its valid alerts or make Alertmanager retry it forever. endsAt is kept in the
stored payload only (Alertmanager's zero time, 0001-01-01T00:00:00Z, means
"no end yet"), so any parseable value is accepted.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_ALERTS = 10_000
# RFC 3339's date-time (section 5.6), as Go's time.RFC3339Nano writes it.
RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})", re.ASCII
)
# executions.alert_fingerprint; Alertmanager's fingerprints are 16 hex digits.
MAX_FINGERPRINT = 64


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Alert(_Lenient):
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime
    endsAt: datetime | None = None
    generatorURL: str = ""
    fingerprint: str = Field(min_length=1, max_length=MAX_FINGERPRINT)

    @field_validator("startsAt", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        # pydantic would take a number (or a string of digits) as a Unix time:
        # Alertmanager sends RFC 3339 text, and anything else is not its payload.
        if not isinstance(value, str) or RFC3339.fullmatch(value) is None:
            raise ValueError("startsAt must be an RFC 3339 time (2006-01-02T15:04:05Z)")
        return value

    @field_validator("startsAt")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("startsAt must carry a timezone (RFC 3339)")
        return value

    def starts_at_problem(self) -> str | None:
        """Why startsAt cannot be stored (None: it can): it must be a time of
        the years 1 to 9999 once converted to UTC, as the journal keeps it."""
        try:
            self.startsAt.astimezone(UTC)
        except OverflowError:
            return f"startsAt {self.startsAt.isoformat()} is outside years 1-9999 in UTC"
        return None

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")


class WebhookPayload(_Lenient):
    version: Literal["4"]
    groupKey: str = Field(max_length=4096)
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: str
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""
    alerts: list[Alert] = Field(max_length=MAX_ALERTS)


def unstorable_text(document: Any) -> str | None:
    """Where the payload holds text no database column can store (a NUL
    character, a lone surrogate from a `\\ud800` escape), or None.

    PostgreSQL refuses both; refusing them here makes them a 4xx (nothing
    stored) instead of a store error. Iterative: JSON nests deeper than
    Python recurses."""
    stack: list[tuple[str, Any]] = [("payload", document)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return f"{where}: NUL character in text"
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where}: text is not valid Unicode (lone surrogate)"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(f"{where} key", key), (f"{where}.{key}", item)]
        elif isinstance(value, list):
            stack += [(f"{where}.{i}", item) for i, item in enumerate(value)]
    return None
