"""R3: reason → reflect → refine, trained jointly with Mix-GRPO (text GRPO + image Flow-GRPO).

A unified policy plans in text and generates an image (reason), critiques its image and writes an edit
instruction or "no further edit needed" (reflect), then edits (refine); docs/maths.md §9. Pure logic lives in
``rewards`` (format checks, stage rewards, per-track advantages), ``data`` (GenEval / GenEval++ / TIIF
loaders) and ``metrics`` (multi-round evaluation); the protocol, composite policy and recipe build on
them. Submodules import torch; this package does not.
"""
