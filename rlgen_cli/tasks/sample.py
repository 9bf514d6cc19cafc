"""``rlgen sample``: prompts (or a prompt file, else ``data.test``) [+ checkpoint] → PNGs and ``manifest.jsonl``.

An editing model draws each row's edit of its source image (``"image"`` in the prompt file; the tiny
editing models pick the generated ``data=tiny_edit``). With ``edit_set=true`` and a GenEval-style ``prompts_file`` it builds an editing set instead: each row's
source image is generated from its ``source_prompt`` (or its ``prompt``) and ``edit_set.jsonl`` repeats
every row with ``"image"`` pointing at that source — the format editing families train on.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from rlgen_cli.tasks.common import run_dir_of, user_errors, validated

MANIFEST = "manifest.jsonl"
EDIT_SET = "edit_set.jsonl"
SOURCE_PROMPT_KEY = "source_prompt"


@user_errors
def sample_task(cfg: DictConfig) -> str:
    typed = validated(cfg)
    from rlgen_cli.recipes.sampling import sample_images
    from rlgen_cli.sde.rollout import StepSpec
    from rlgen_cli.tasks.loading import load_policy
    from rlgen_cli.training.images import to_pil
    from rlgen_cli.training.progress import Progress
    from rlgen_cli.training.run import prepare_run_dir, setup_logging
    from rlgen_cli.training.video import save_video

    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    dataset = _prompt_set(typed, run_dir)  # before the model loads: a bad file costs no model load
    examples = [] if dataset is None else list(dataset)
    prompts = list(typed.prompts) or [ex.prompt for ex in examples]
    if typed.edit_set:
        prompts = [ex.metadata.get(SOURCE_PROMPT_KEY, ex.prompt) for ex in examples]
    policy = load_policy(typed.model, typed.checkpoint, typed.device)
    sources = _sources(policy, examples, dataset, typed.images_per_prompt)
    num_steps = typed.num_steps or policy.cfg.eval_num_steps
    noise_level = (
        typed.sampler.noise_level if typed.sampler.noise_level is not None else policy.cfg.noise_level
    )
    spec = StepSpec(typed.sampler.kind, noise_level, typed.sampler.logprob_reduce, typed.sampler.logprob_form)
    expanded = [p for p in prompts for _ in range(typed.images_per_prompt)]
    with Progress(typed.progress) as progress:
        images = sample_images(
            policy, expanded, num_steps, typed.batch_size, typed.seed, progress, spec, sources=sources
        )
    out_dir = run_dir / "images"
    out_dir.mkdir(exist_ok=True)
    with (run_dir / MANIFEST).open("w", encoding="utf-8") as manifest:
        for i, (prompt, image) in enumerate(zip(expanded, images)):
            if image.ndim == 4:  # (3, F, H, W): a video
                path = save_video(image, out_dir / f"{i:05d}")
            else:
                path = out_dir / f"{i:05d}.png"
                to_pil(image).save(path)
            row = {"file": str(Path("images") / path.name), "prompt": prompt, "sample": i % typed.images_per_prompt,
                   "seed": typed.seed, "num_steps": num_steps, "checkpoint": typed.checkpoint}  # fmt: skip
            manifest.write(json.dumps(row) + "\n")
    if typed.edit_set:
        write_edit_set(run_dir, examples, typed.images_per_prompt)
    from rich.console import Console

    Console().print(
        f"wrote {len(expanded)} samples and {EDIT_SET if typed.edit_set else MANIFEST} to {run_dir}"
    )
    return str(run_dir)


def _prompt_set(cfg, run_dir: Path):
    """The rows to draw: ``prompts_file``, else ``data.test`` (None for inline ``prompts``). An editing
    model needs a source image per row, so inline prompts are refused for it."""
    from rlgen_cli.data.images import EDITING_FAMILIES, require_source_images
    from rlgen_cli.data.paths import load_prompts
    from rlgen_cli.schema.errors import UserError

    editing = cfg.model.family in EDITING_FAMILIES and not cfg.edit_set
    if cfg.prompts:
        if editing:
            raise UserError(
                f"model.family={cfg.model.family} edits a source image per prompt and prompts=[…] has none: "
                f"drop prompts= to draw data.test ({cfg.data.test}) or give prompts_file=FILE.jsonl with "
                'rows like {"prompt": "Make the square red.", "image": "src/0.png"}'
            )
        return None
    key, spec = ("prompts_file", cfg.prompts_file) if cfg.prompts_file else ("data.test", cfg.data.test)
    dataset = load_prompts(spec, run_dir, key)
    if editing:
        require_source_images(list(dataset), dataset.source, key)
    return dataset


def _sources(policy, examples: list, dataset, images_per_prompt: int):
    """Each drawn sample's source image for an editing policy (None for the others)."""
    from rlgen_cli.recipes.sampling import source_images_for

    if dataset is None or not getattr(policy, "takes_source_images", False):
        return None
    return source_images_for(policy, [ex for ex in examples for _ in range(images_per_prompt)], dataset)


def write_edit_set(run_dir: Path, examples: list, images_per_prompt: int) -> Path:
    """``edit_set.jsonl``: every metadata row once per source image, with ``"image"`` set to it."""
    path = run_dir / EDIT_SET
    with path.open("w", encoding="utf-8") as out:
        for i, example in enumerate(examples):
            for k in range(images_per_prompt):
                row = {**example.metadata, "image": f"images/{i * images_per_prompt + k:05d}.png"}
                out.write(json.dumps(row) + "\n")
    return path
