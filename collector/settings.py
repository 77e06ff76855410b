"""What the collector is configured with (VLLM_RUNBOOK_* variables), and which
engine it sits in (model name, DP rank, parallel sizes: read once at start)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_runbook.collector.auth import TokenError, configured_token, is_loopback
from vllm_runbook.collector.autopilot import DEFAULT_TARGET, parse_mode, parse_target
from vllm_runbook.collector.metrics import POLICIES
from vllm_runbook.collector.server import ServerLimits
from vllm_runbook.collector.tiers import TierConfig
from vllm_runbook.collector.vllm_support import TESTED_VLLM, describe, minor
from vllm_runbook.collector.warmup import WarmupSettings

logger = logging.getLogger("vllm_runbook.collector")

DEFAULT_PORT = 9360
# TESTED_VLLM: the inclusive (major, minor) range of the compatibility
# matrix's last green run (vllm_support.py, vllm_matrix.json).


@dataclass(frozen=True)
class CollectorSettings:
    host: str = "127.0.0.1"
    port: int | None = DEFAULT_PORT  # None: no HTTP endpoint; 0: any free port
    window_seconds: float = 60.0
    nvml_interval: float = 1.0  # the field reports poll GPU memory every second
    server_limits: ServerLimits = field(default_factory=ServerLimits)
    autopilot: bool = False
    # VLLM_RUNBOOK_AUTOPILOT=advisory: it decides and exports, changes nothing.
    autopilot_advisory: bool = False
    autopilot_target: float = DEFAULT_TARGET
    # The scheduling policy to start with (None: vLLM's own --scheduling-policy),
    # and the tiers of the `tiered` policy and of the per-tier signals.
    policy: str | None = None
    tiers: TierConfig = field(default_factory=TierConfig)
    # The warm-up at engine start (collector/warmup.py): off unless asked for.
    warmup: WarmupSettings = field(default_factory=WarmupSettings)
    # No step for this long while requests wait or run: stalled (collector/stall.py).
    stall_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(
                f"VLLM_RUNBOOK_POLICY must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CollectorSettings:
        env = dict(os.environ) if env is None else env
        port_text = env.get("VLLM_RUNBOOK_PORT", str(DEFAULT_PORT)).strip().lower()
        port = None if port_text in ("off", "none", "-1") else int(port_text)
        return cls(
            host=env.get("VLLM_RUNBOOK_HOST", "127.0.0.1"),
            port=port,
            window_seconds=float(env.get("VLLM_RUNBOOK_WINDOW_SECONDS", "60")),
            nvml_interval=float(env.get("VLLM_RUNBOOK_NVML_INTERVAL", "1")),
            stall_seconds=float(env.get("VLLM_RUNBOOK_STALL_SECONDS", "10")),
            server_limits=ServerLimits.from_env(env),
            **_autopilot_settings(env),
            policy=env.get("VLLM_RUNBOOK_POLICY", "").strip().lower() or None,
            tiers=TierConfig.from_env(env),
            warmup=_warmup_settings(env),
        )


def _autopilot_settings(env: dict[str, str]) -> dict[str, Any]:
    """VLLM_RUNBOOK_AUTOPILOT and _TARGET. A bad value leaves the autopilot
    off (one log line) rather than the collector unstarted."""
    try:
        on, advisory = parse_mode(env.get("VLLM_RUNBOOK_AUTOPILOT", "off"))
        return {
            "autopilot": on,
            "autopilot_advisory": advisory,
            "autopilot_target": parse_target(
                env.get("VLLM_RUNBOOK_AUTOPILOT_TARGET", str(DEFAULT_TARGET))
            ),
        }
    except ValueError as exc:
        logger.error("vllm-runbook: autopilot left off: VLLM_RUNBOOK_AUTOPILOT*: %s", exc)
        return {"autopilot": False, "autopilot_advisory": False, "autopilot_target": DEFAULT_TARGET}


def _warmup_settings(env: dict[str, str]) -> WarmupSettings:
    """VLLM_RUNBOOK_WARMUP*. A bad value leaves the warm-up off (one log line)
    rather than the collector unstarted or the engine's start delayed by a guess."""
    try:
        return WarmupSettings.from_env(env)
    except ValueError as exc:
        logger.error("vllm-runbook: warm-up at start left off: %s", exc)
        return WarmupSettings()


def agent_token(host: str, env: dict[str, str] | None = None) -> str | None:
    """The configured token; None means "generate one" (loopback only).
    TokenError when the agent must not start."""
    token = configured_token(env)
    if token is None and not is_loopback(host):
        raise TokenError(
            f"binding to {host} (not loopback) needs VLLM_RUNBOOK_TOKEN or VLLM_RUNBOOK_TOKEN_FILE"
        )
    return token


def check_vllm_version(version: str) -> bool:
    """True when `version` is in the tested range; logs a warning otherwise."""
    low, high = TESTED_VLLM
    if not (low <= minor(version) <= high):
        logger.warning(
            "vllm-runbook: vLLM %s is outside the tested range %s; "
            "the collector will disable itself if the scheduler differs",
            version,
            describe(TESTED_VLLM),
        )
        return False
    return True


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@dataclass(frozen=True)
class EngineIdentity:
    """Which engine the collector sits in: the labels of every series it exports."""

    model_name: str
    # data_parallel_index keeps the DP rank even where vLLM runs a non-MoE
    # DP rank as an independent engine (data_parallel_rank is 0 there).
    dp_rank: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    start_time: float = field(default_factory=time.time)

    @property
    def labels(self) -> tuple[str, str]:
        """(model_name, engine): the values of metrics.BASE_LABELS."""
        return (self.model_name, str(self.dp_rank))

    @classmethod
    def of(cls, vllm_config: Any) -> EngineIdentity:
        served = vllm_config.model_config.served_model_name
        parallel = vllm_config.parallel_config
        rank = getattr(parallel, "data_parallel_index", None)
        return cls(
            model_name=served[0] if isinstance(served, list) else str(served),
            dp_rank=int(parallel.data_parallel_rank if rank is None else rank) or 0,
            tensor_parallel_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            pipeline_parallel_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
            data_parallel_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
        )
