"""Saving, loading and describing checkpoints, and stopping cleanly on Ctrl-C."""
