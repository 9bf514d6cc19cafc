"""rlgen: online reinforcement learning for generative models.

Importing this package must stay cheap (no torch): ``rlgen --help`` imports it.
"""

__version__ = "0.1.0"
