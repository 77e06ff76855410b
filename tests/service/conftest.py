from tests.journal.conftest import (  # noqa: F401 - fixtures shared with the journal tests
    fresh_pg_database,
    pg_database,
    pg_migrated,
    pg_url,
    sqlite_template,
    sqlite_url,
)
