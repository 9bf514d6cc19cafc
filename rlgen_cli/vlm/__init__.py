"""Multimodal LLMs (Qwen2-VL / Qwen2.5-VL): policy adapters, rollout, data, evaluation and export.

Used by ``recipes/vlm_rl.py`` (token GRPO / StepGRPO, R1-VL — Zhang et al. 2025) and
``recipes/vlm_sft.py`` (SFT warm-up). Submodules import torch / transformers; this package does not.
"""
