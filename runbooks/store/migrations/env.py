"""Alembic environment for the migrations shipped in the package."""

from alembic import context
from runbooks.store.schema import run_migrations

run_migrations(context)
