"""reports: the paper's figures and tables, and one index page, drawn from the results database (read-only)."""
