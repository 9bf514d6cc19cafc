"""The words R3 says to its text policy (docs/r3.md), in one place.

* **Reason** — a system prompt that asks for a plan between ``<think>`` and ``</think>``; the user turn is
  the text-to-image prompt. The generator then draws from the prompt and the plan
  (:func:`generation_prompt`).
* **Reflect** — the image, then "The description of the target image is: {prompt}. How to further edit
  the provided image …"; the answer is ``<think>…</think>instruction`` or "no further edit needed".
* **Refine** — the editor sees only the source image and the instruction.
"""

from __future__ import annotations

from rlgen_cli.r3.rewards import NO_EDIT

__all__ = ["REASON_SYSTEM", "REFLECT_SYSTEM", "generation_prompt", "reason_user", "reflect_user"]

REASON_SYSTEM = (
    "You are an image generation assistant. Before the image is drawn, think about how to draw the "
    "described image: objects, their counts, colours, positions and sizes. Write the plan between "
    "<think> and </think>, and nothing else."
)
REFLECT_SYSTEM = (
    "You are an image editing assistant. Look at the image, think between <think> and </think>, then "
    "write one editing instruction."
)


def reason_user(prompt: str) -> str:
    """The user turn of the reason stage: the text-to-image prompt itself."""
    return prompt


def reflect_user(prompt: str) -> str:
    """The user turn of the reflect stage (the image comes first in the message)."""
    return (
        f"The description of the target image is: {prompt}. How to further edit the provided image to make "
        "it consistent with the target description? Think first, then give the editing instruction. If no "
        f"editing operation is needed, answer: {NO_EDIT}."
    )


def generation_prompt(prompt: str, plan: str) -> str:
    """What the generator is conditioned on: the prompt, then the plan when there is one."""
    plan = plan.strip()
    return f"{prompt}\n{plan}" if plan else prompt
