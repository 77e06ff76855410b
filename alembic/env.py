"""Alembic environment for developers (`alembic -c alembic.ini ...`).

The version scripts live in `runbooks/store/migrations/versions/` so that an
installed package can migrate its own database (`runbook db upgrade`);
alembic.ini points `version_locations` there and this file runs the same
environment code as the packaged one.
"""

from vllm_runbook.runbooks.store.schema import run_migrations

from alembic import context

run_migrations(context)
