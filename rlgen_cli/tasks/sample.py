"""``rlgen sample``: prompts (or a prompt file, else ``data.test``) [+ checkpoint] → PNGs and ``manifest.jsonl``.

Each image draws its noise from its own stream (``sde/noise.py``), not from ``seed`` directly, so a
manifest row records what reproduces it: ``noise_seed``, the seed of the ``torch.Generator`` (on
``noise_device``) whose first ``randn`` is the image's initial noise — a diffusers pipeline given
``generator=noise_generator(row)`` for that one prompt draws the same noise (in float32), and
:func:`initial_noise` returns it in the shape rlgen samples from — and, for a stochastic sampler,
``step_noise_seed``, the generator of its per-step noise. ``run_seed`` is the ``seed`` setting the
streams derive from (with the image's position ``index``).

An editing model draws each row's edit of its source image (``"image"`` in the prompt file; the tiny
editing models pick the generated ``data=tiny_edit``). With ``edit_set=true`` and a GenEval-style ``prompts_file`` it builds an editing set instead: each row's
source image is generated from its ``source_prompt`` (or its ``prompt``) and ``edit_set.jsonl`` repeats
every row with ``"image"`` pointing at that source — the format editing families train on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rlgen_cli.tasks.common import refuse_overrides, run_dir_of, user_errors, validated

MANIFEST = "manifest.jsonl"
EDIT_SET = "edit_set.jsonl"
SOURCE_PROMPT_KEY = "source_prompt"
log = logging.getLogger(__name__)


TRAINING_DATA = {
    "data.train": "it names rlgen train's prompts; rlgen sample draws prompts=[…], prompts_file or data.test",
    "data.eval_num_prompts": "it sizes rlgen train's periodic evaluation; rlgen sample draws every prompt of "
    "prompts=[…], prompts_file or data.test",
    "data.eval_images_per_prompt": "it sizes rlgen train's periodic evaluation; rlgen sample draws "
    "images_per_prompt images per prompt: set images_per_prompt",
}
"""The ``data`` keys ``rlgen sample`` composes (the data options are shared with training) and never reads."""


@user_errors
def sample_task(cfg: DictConfig) -> str:
    typed = validated(cfg)
    refuse_overrides(_unread_data(typed), "sample")
    from rlgen_cli.sde.rollout import StepSpec
    from rlgen_cli.sde.sampling import sample_images
    from rlgen_cli.tasks.loading import describe_model, load_policy, with_checkpoint_model
    from rlgen_cli.tasks.prerequisites import Prerequisites, checkpoint_problems, model_problems
    from rlgen_cli.training.reporting.images import to_pil
    from rlgen_cli.training.reporting.progress import Progress
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging
    from rlgen_cli.training.reporting.video import save_video

    missing = Prerequisites().add(checkpoint_problems(typed.checkpoint, "checkpoint"))
    if not missing.missing:  # the checkpoint's own model draws: resolved.yaml records it
        cfg = with_checkpoint_model(cfg, typed.checkpoint, "sample")
        typed = validated(cfg)
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    dataset = _prompt_set_or_problem(typed, run_dir, missing)  # a bad file costs no model load
    missing.add(model_problems(typed)).require()
    log.info("sampling with %s", describe_model(typed.model, typed.checkpoint))
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
        task = progress.task("sampling", total=len(expanded))
        images = sample_images(
            policy,
            expanded,
            num_steps,
            typed.batch_size,
            typed.seed,
            spec=spec,
            sources=sources,
            on_batch=lambda n: progress.advance(task, n),
        )
    out_dir = run_dir / "images"
    out_dir.mkdir(exist_ok=True)
    stochastic = spec.kind != "ode" and spec.noise_level > 0  # draws step noise too
    with (run_dir / MANIFEST).open("w", encoding="utf-8") as manifest:
        for i, (prompt, image) in enumerate(zip(expanded, images)):
            if image.ndim == 4:  # (3, F, H, W): a video
                path = save_video(image, out_dir / f"{i:05d}")
            else:
                path = out_dir / f"{i:05d}.png"
                to_pil(image).save(path)
            row = {"file": str(Path("images") / path.name), "prompt": prompt, "sample": i % typed.images_per_prompt,
                   "num_steps": num_steps, "checkpoint": typed.checkpoint,
                   **noise_record(typed.seed, i, policy.device, stochastic)}  # fmt: skip
            manifest.write(json.dumps(row) + "\n")
    if typed.edit_set:
        write_edit_set(run_dir, examples, typed.images_per_prompt)
    from rlgen_cli.training.reporting.console import shared_console

    shared_console().print(
        f"wrote {len(expanded)} samples and {EDIT_SET if typed.edit_set else MANIFEST} to {run_dir}"
    )
    return str(run_dir)


def _unread_data(cfg: Any) -> dict[str, str]:
    """:data:`TRAINING_DATA`, and ``data.test`` when ``prompts`` or ``prompts_file`` say what to draw."""
    if not (cfg.prompts or cfg.prompts_file):
        return TRAINING_DATA
    given = "prompts=[…]" if cfg.prompts else f"prompts_file={cfg.prompts_file}"
    return TRAINING_DATA | {
        "data.test": f"rlgen sample draws data.test only without prompts and prompts_file, and {given} is given"
    }


def noise_record(seed: int, index: int, device: Any, stochastic: bool) -> dict[str, Any]:
    """What reproduces the noise of the ``index``-th image drawn with ``seed`` (see the module doc)."""
    from rlgen_cli.sde.noise import Stream, stream_seed

    record = {"noise_seed": stream_seed(seed, 0, index, Stream.INITIAL_NOISE), "noise_device": str(device)}
    if stochastic:
        record["step_noise_seed"] = stream_seed(seed, 0, index, Stream.STEP_NOISE)
    return record | {"run_seed": seed, "index": index}


def noise_generator(row: dict[str, Any]) -> Any:
    """A fresh ``torch.Generator`` whose first ``randn`` is a manifest row's initial noise (what a diffusers
    pipeline takes as ``generator=`` for that one image)."""
    import torch

    return torch.Generator(device=row["noise_device"]).manual_seed(row["noise_seed"])


def initial_noise(policy: Any, row: dict[str, Any]) -> Any:
    """The initial noise x_1 rlgen sampled a manifest row's image from: (1, …) float32 on the policy's
    device, in the policy's latent layout (packed for FLUX and Qwen-Image)."""
    return policy.noise(1, [noise_generator(row)])


def _prompt_set_or_problem(cfg, run_dir: Path, missing: Any):
    """:func:`_prompt_set`, or None with its problem added to ``missing`` (reported with the others)."""
    from rlgen_cli.errors import UserError

    try:
        return _prompt_set(cfg, run_dir)
    except UserError as err:
        missing.add([str(err)])
        return None


def _prompt_set(cfg, run_dir: Path):
    """The rows to draw: ``prompts_file``, else ``data.test`` (None for inline ``prompts``). An editing
    model needs a source image per row, so inline prompts are refused for it."""
    from rlgen_cli.data.images import EDITING_FAMILIES, require_source_images
    from rlgen_cli.data.paths import load_prompts
    from rlgen_cli.errors import UserError

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
    from rlgen_cli.data.images import source_images

    if dataset is None or not policy.capabilities.takes_source_images:
        return None
    rows = [ex for ex in examples for _ in range(images_per_prompt)]
    return source_images(
        rows, dataset, policy.cfg.height or policy.cfg.resolution, policy.cfg.width or policy.cfg.resolution
    )


def write_edit_set(run_dir: Path, examples: list, images_per_prompt: int) -> Path:
    """``edit_set.jsonl``: every metadata row once per source image, with ``"image"`` set to it."""
    path = run_dir / EDIT_SET
    with path.open("w", encoding="utf-8") as out:
        for i, example in enumerate(examples):
            for k in range(images_per_prompt):
                row = {**example.metadata, "image": f"images/{i * images_per_prompt + k:05d}.png"}
                out.write(json.dumps(row) + "\n")
    return path
