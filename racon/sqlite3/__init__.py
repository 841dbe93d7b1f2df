"""Django database backends of RACoN's own (racon.sqlite3.base: SQLite with a per-process writer queue)."""
