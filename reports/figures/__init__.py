"""The paper's figures by family: training curves (figures 1, 2, 5-8) and the token-level study (figures 3, 4, and
beyond the paper 9 and 10, the drift grid), and the variational-reasoning family's.

Each figure function takes a ReportContext and returns the arrays it plotted (tests check data); draw.py holds the
drawing helpers every family shares.
"""
