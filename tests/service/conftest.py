from tests.journal.conftest import (  # noqa: F401 - fixtures shared with the journal tests
    fresh_pg_database,
    pg_database,
    pg_url,
    pg_migrated,
    sqlite_template,
    sqlite_url,
)
