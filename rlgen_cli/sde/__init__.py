"""Pure tensor maths for flow-matching RL: noise schedules, SDE/ODE/CPS steps with log-probs, step KL,
window policies and ODE solvers.

Imports only torch (and the standard library).
"""

from rlgen_cli.sde.kl import step_kl
from rlgen_cli.sde.schedule import calculate_mu, dynamic_shift_sigmas, sd3_sigmas, shift_sigmas
from rlgen_cli.sde.solvers import compressed_schedule, dpm_solver_2m, euler
from rlgen_cli.sde.step import StepOut, gaussian_logprob, reduce_nonbatch, step
from rlgen_cli.sde.window import WINDOWS, WindowPlan, last_sde_step, plan_window

__all__ = [
    "StepOut",
    "WINDOWS",
    "WindowPlan",
    "calculate_mu",
    "compressed_schedule",
    "dpm_solver_2m",
    "dynamic_shift_sigmas",
    "euler",
    "gaussian_logprob",
    "last_sde_step",
    "plan_window",
    "reduce_nonbatch",
    "sd3_sigmas",
    "shift_sigmas",
    "step",
    "step_kl",
]
