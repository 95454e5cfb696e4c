"""The paper's figures by family: training curves (figures 1, 2, 5-8) and the token-level study (figures 3, 4, and
beyond the paper 9 and 10, the drift grid), and the variational-reasoning family's.
"""
