"""What steers the weights while a run goes: the EMA, the learning-rate schedule and the reward-hacking guard."""
