"""The `send_warmup_requests` action: real completions through the engine's vLLM API.

The agent lives in the EngineCore process and cannot submit requests, so
warm-up goes where traffic goes: vLLM's OpenAI-compatible server (the
inventory's `vllm:` URL, or `runbook exec --vllm`). Each request is a prompt
of exactly `prompt_tokens` token ids (no tokenizer needed: the completions
API takes ids), different per request and per run so the prefix cache does
not turn the prefill into a lookup (the prompts of the collector's warm-up at
engine start, collector/warmup.py), and `output_tokens` tokens are generated with
`ignore_eos` so the decode path runs that many steps. At most `concurrency`
are in flight. Prompts longer than the model's `max_model_len` allows are
shortened to fit (reported in the details).

vLLM's `VLLM_API_KEY` in this process's environment is sent as the bearer
token, as vLLM's server expects it. Read-only for the engine's knobs: nothing
to revert.
"""

from __future__ import annotations

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import httpx
from pydantic import Field
from vllm_runbook.collector.warmup import PROMPTS as _PROMPTS
from vllm_runbook.collector.warmup import warmup_prompt
from vllm_runbook.runbooks.engine.operations import ActionContext, ActionOutcome
from vllm_runbook.runbooks.model.actions import ActionError, ActionParams, action

__all__ = ["SendWarmupRequests", "WarmupFailed", "send_warmup_requests", "warmup_prompt"]


class WarmupFailed(ActionError):
    """No warm-up request could be served (or the API server is unknown or down)."""


def _headers() -> dict[str, str]:
    key = os.environ.get("VLLM_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _model(client: httpx.Client, api_url: str) -> tuple[str, int | None]:
    """The served model's id and max_model_len from GET /v1/models."""
    try:
        response = client.get(f"{api_url}/v1/models")
    except httpx.HTTPError as exc:
        raise WarmupFailed(f"vLLM API server {api_url} unreachable: {exc}") from None
    if response.status_code != 200:
        raise WarmupFailed(f"vLLM API server {api_url}/v1/models: HTTP {response.status_code}")
    try:
        card = response.json()["data"][0]
        return str(card["id"]), card.get("max_model_len")
    except (ValueError, KeyError, IndexError, TypeError):
        raise WarmupFailed(f"{api_url}/v1/models: not a vLLM model list") from None


class SendWarmupRequests(ActionParams):
    """Send `count` completions of `prompt_tokens` prompt tokens to the engine's
    vLLM API server (needs its URL: the inventory's `vllm:`, or `--vllm`)."""

    count: Annotated[int, Field(ge=1, le=10_000)]
    prompt_tokens: Annotated[int, Field(ge=1)]
    output_tokens: Annotated[int, Field(ge=1, le=4096)] = 16
    # At most this many in flight: warm-up must not become the overload it prevents.
    concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 120.0


@action(mutating=False)
def send_warmup_requests(params: SendWarmupRequests, ctx: ActionContext) -> ActionOutcome:
    if not ctx.api_url:
        raise WarmupFailed(
            "send_warmup_requests needs the engine's vLLM API server URL: set `vllm:` "
            "for this engine in the inventory, or pass --vllm URL"
        )
    api_url = ctx.api_url.rstrip("/")
    timeout = httpx.Timeout(params.timeout_seconds, connect=10.0)
    with httpx.Client(timeout=timeout, headers=_headers()) as client:
        model, max_model_len = _model(client, api_url)
        prompt_tokens = params.prompt_tokens
        if max_model_len is not None and prompt_tokens + params.output_tokens > max_model_len:
            prompt_tokens = max(1, int(max_model_len) - params.output_tokens)
        plan = {
            "api": api_url,
            "model": model,
            "requests": params.count,
            "prompt_tokens": prompt_tokens,
            "output_tokens": params.output_tokens,
            "concurrency": params.concurrency,
        }
        if prompt_tokens != params.prompt_tokens:
            plan["prompt_tokens_requested"] = params.prompt_tokens
        if ctx.dry_run:
            return ActionOutcome(after={"warmup": {**plan, "sent": 0}}, details=plan)

        # A fresh offset per run: a second warm-up is not served from the
        # blocks the first one left in the prefix cache.
        offset = secrets.randbelow(_PROMPTS)

        def one(index: int) -> str | None:
            body = {
                "model": model,
                "prompt": warmup_prompt((offset + index) % _PROMPTS, prompt_tokens),
                "max_tokens": params.output_tokens,
                "min_tokens": params.output_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
            }
            try:
                response = client.post(f"{api_url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}"
            return None

        started = time.monotonic()
        with ThreadPoolExecutor(min(params.concurrency, params.count)) as pool:
            errors = [e for e in pool.map(one, range(params.count)) if e is not None]
        seconds = round(time.monotonic() - started, 3)
    summary: dict[str, Any] = {
        **plan,
        "sent": params.count,
        "succeeded": params.count - len(errors),
        "failed": len(errors),
        "seconds": seconds,
    }
    if errors:
        summary["first_error"] = " ".join(errors[0].split())
    if len(errors) == params.count:
        raise WarmupFailed(f"no warm-up request succeeded ({params.count} sent): {errors[0]}")
    return ActionOutcome(after={"warmup": summary}, details=plan)
