"""The results database as a small library for notebooks: ``open_results()`` and DataFrames of runs, metric curves,
the main results and the token-level study (``library``), and the curves the reports read (``curves``).

    from analysis.results import open_results
    res = open_results()                    # read-only; $PREDMASK_DB or results/predmask.duckdb
    res.summary("smoke")                    # Table 2's numbers as a pandas DataFrame (backend="polars" for polars)
"""

from analysis.results.library import BACKENDS, LEVELS, Results, UnknownNameError, open_results

__all__ = ["BACKENDS", "LEVELS", "Results", "UnknownNameError", "open_results"]
