from tests.journal.conftest import (  # noqa: F401 - fixtures shared with the journal tests
    db_url,
    fresh_pg_database,
    pg_database,
    pg_migrated,
    pg_url,
    sqlite_template,
    sqlite_url,
)
