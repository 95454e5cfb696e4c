"""The paper's figures by family: training curves (figures 1, 2, 5-8) and the token-level study (figures 3, 4, and
beyond the paper 9 and 10, the drift grid).

Each figure function takes a ReportContext and returns the arrays it plotted (tests check data); draw.py holds the
drawing helpers both families share.
"""

from reports.figures.token_level import (
    fig3_unsafe_keep,
    fig4_corrective,
    fig9_drift_sensitivity,
    fig10_criteria_vs_drift,
)
from reports.figures.training import (
    fig1_main_comparison,
    fig2_tight_threshold,
    fig5_training_reward,
    fig6_aime24_aime25,
    fig7_response_length,
    fig8_ppo_kl_clipfrac,
)

__all__ = [
    "fig1_main_comparison",
    "fig2_tight_threshold",
    "fig3_unsafe_keep",
    "fig4_corrective",
    "fig5_training_reward",
    "fig6_aime24_aime25",
    "fig7_response_length",
    "fig8_ppo_kl_clipfrac",
    "fig9_drift_sensitivity",
    "fig10_criteria_vs_drift",
]
