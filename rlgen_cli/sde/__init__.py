"""Pure tensor maths for flow-matching RL: noise schedules, SDE/ODE/CPS steps with log-probs, step KL.

Imports only torch (and the standard library).
"""

from rlgen_cli.sde.kl import KL_FORMS, step_kl
from rlgen_cli.sde.schedule import calculate_mu, dynamic_shift_sigmas, sd3_sigmas, shift_sigmas
from rlgen_cli.sde.step import (
    LOGPROB_FORMS,
    REDUCTIONS,
    STEP_KINDS,
    StepOut,
    gaussian_logprob,
    reduce_nonbatch,
    step,
)

__all__ = [
    "KL_FORMS",
    "LOGPROB_FORMS",
    "REDUCTIONS",
    "STEP_KINDS",
    "StepOut",
    "calculate_mu",
    "dynamic_shift_sigmas",
    "gaussian_logprob",
    "reduce_nonbatch",
    "sd3_sigmas",
    "shift_sigmas",
    "step",
    "step_kl",
]
