"""analysis: the results store (DuckDB schema, connect, ingest) and the analyses that read or fill it."""
