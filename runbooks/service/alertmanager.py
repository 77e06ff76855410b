"""The Alertmanager webhook payload (version 4), validated.

Unknown fields are ignored (newer Alertmanagers add some); the fields the
service relies on are required and typed, so a malformed delivery is refused
with a 4xx before anything is stored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_ALERTS = 10_000
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

    @field_validator("startsAt")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("startsAt must carry a timezone (RFC 3339)")
        return value

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
