"""The paper's tables by family: Table 1 (hyperparameters), the token-level summary, Table 2 (main results) and the
variational family's results table. No table module imports a figure module: what both use lives in reports/.
"""
