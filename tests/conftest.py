"""Shared fixtures: a tiny local model, in-process engines, a served engine.

Engines are expensive (≈12 s in-process, ≈45 s served on 2 cores), so they
are shared per module or session. Everything runs on loopback; nothing is
downloaded.
"""

from __future__ import annotations

import os
import tempfile

# Must be set before vLLM is imported anywhere in this process: the
# EngineCore then runs in-process, so tests reach the scheduler and step it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Each in-process engine binds its own free port (no clash between engines).
os.environ.setdefault("VLLM_RUNBOOK_PORT", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Generated agent tokens go to a private directory of this test session; the
# CLI (also in subprocesses) finds them there.
os.environ.setdefault("VLLM_RUNBOOK_RUNTIME_DIR", tempfile.mkdtemp(prefix="vllm-runbook-rt-"))
os.environ.pop("VLLM_RUNBOOK_TOKEN", None)

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import InProcessEngine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_runbook.collector.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessEngine]:
    """A plain engine: block_size 32, prefix caching, room for 64 requests."""
    eng = InProcessEngine.start(tiny_model)
    yield eng
    eng.close()
