"""The paper's tables by family: Table 1 (hyperparameters), the token-level summary, Table 2 (main results) and the
variational family's results table.

Each table function takes a ReportContext and returns the rows it rendered (tests check data); render.py holds
the Markdown/LaTeX rendering and file writing every family shares. No table module imports a figure module:
what both use lives in reports/ (data.py, cells.py, vr_scores.py).
"""
