"""The paper's tables by family: Table 1 (hyperparameters), the token-level summary, Table 2 (main results) and the
variational family's results table.

Each table function takes a ReportContext and returns the rows it rendered (tests check data); render.py holds
the Markdown/LaTeX rendering and file writing every family shares. No table module imports a figure module:
what both use lives in reports/ (data.py, cells.py, vr_scores.py).
"""

from reports.tables.hyperparameters import table1_hyperparameters
from reports.tables.main_results import table2_main_results
from reports.tables.token_level import token_level_summary
from reports.tables.variational import vr_results

__all__ = ["table1_hyperparameters", "table2_main_results", "token_level_summary", "vr_results"]
