"""Alembic environment for the migrations shipped in the package."""

from vllm_runbook.runbooks.store.schema import run_migrations

from alembic import context

run_migrations(context)
