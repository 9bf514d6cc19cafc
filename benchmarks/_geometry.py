"""The small-but-real CFG geometry the performance benchmarks measure, and the ShapesEval default.

``sd3_cfg``: an SD3 pipeline with 2 joint blocks of width 64 (4 heads × 16), 64-px images (a 2×
downsampling VAE, 2×2 patches: 256 image tokens), saved with ``save_pretrained`` and loaded back through
``model=sd3`` (the real loader), trained by Flow-GRPO (``algo=grpo``, β 0, every step trained) with CFG
4.5 and a rank-32 LoRA on 2 prompts × 4 images per epoch from the 16 tiny prompts (JPEG
compressibility), 8 steps, sampling and training batches of 4 (one transformer batch of 8 with
``algo.cfg_grad=both``, two of 4 with ``conditional``): 2 optimizer steps per epoch.
``shapes``: the ShapesEval Flow-GRPO-Fast recipe (``experiment=shapes_grpo_fast``).
``shapes_nft``: what the default ``rlgen train`` runs (``experiment=shapes_nft``): the same model and
prompts trained by DiffusionNFT (ODE rollouts from the old policy, forward-noised training passes; no SDE
step, so ``profile_epoch.py``'s phases do not apply to it).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from rlgen_cli.models.tiny import SD3Sizes, tiny_sd3_pipeline
from rlgen_cli.recipes import flow_forward, flow_grpo, flow_run
from rlgen_cli.training.reporting.progress import Progress

SD3_CFG_ALGO = [
    "algo=grpo", "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=4",
    "algo.train_batch_size=4", "algo.gradient_accumulation_steps=1", "algo.kl_weight=0",
    "algo.window.timestep_fraction=1.0", "algo.ema.enabled=false",
]  # fmt: skip
GRPO_GEOMETRIES = ("sd3_cfg", "shapes")
"""The geometries trained by Flow-GRPO, whose SDE steps ``profile_epoch.py`` labels."""
GEOMETRIES = (*GRPO_GEOMETRIES, "shapes_nft")
EXPERIMENTS = {"shapes": "shapes_grpo_fast", "shapes_nft": "shapes_nft"}
SD3_CFG_SIZES = SD3Sizes(
    clip_intermediate_size=64,
    t5_d_kv=16,
    t5_d_ff=128,
    patch_size=2,
    num_layers=2,
    attention_head_dim=16,
    caption_projection_dim=64,
    vae_sample_size=64,
    vae_block_out_channels=(8, 16),
    vae_norm_groups=4,
)
"""The ``sd3_cfg`` geometry: 2 joint blocks of width 64, a 2× downsampling VAE, 2×2 patches."""


def save_sd3_cfg_pipeline(directory: Path, seed: int = 0) -> Path:
    """Build the ``sd3_cfg`` pipeline (random weights, offline tokenizers) and save it to ``directory``."""
    tiny_sd3_pipeline(seed, sizes=SD3_CFG_SIZES).save_pretrained(directory)
    return directory


def overrides_for(geometry: str, workdir: Path | None = None) -> list[str]:
    """Hydra overrides of ``geometry`` (``sd3_cfg`` saves its pipeline under ``workdir`` first)."""
    if geometry in EXPERIMENTS:
        return [f"experiment={EXPERIMENTS[geometry]}"]
    if geometry != "sd3_cfg":
        raise ValueError(f"unknown geometry {geometry!r}; choose one of {', '.join(GEOMETRIES)}")
    path = save_sd3_cfg_pipeline(Path(workdir or tempfile.mkdtemp(prefix="rlgen-sd3cfg-")) / "pipeline")
    return [
        "model=sd3",
        "reward=jpeg_compressibility",
        "sampler=flow_sde",
        f"model.path={path}",
        "model.local_files_only=true",
        "model.dtype=float32",
        "model.resolution=64",
        "model.num_steps=8",
        "model.eval_num_steps=8",
        "model.max_sequence_length=32",
        "model.guidance_scale=4.5",
        "model.lora.rank=32",
        "model.lora.alpha=64",
        *SD3_CFG_ALGO,
    ]


def run_epoch(run: flow_run.FlowRun, epoch: int, progress: Progress) -> dict[str, float]:
    """What the recipe's ``run`` does per epoch without evaluation or checkpoints: the epoch and its
    logging (DiffusionNFT's old policy is built at the first epoch and kept, as its ``run`` does)."""
    if run.cfg.recipe == "flow_forward":
        if id(run) not in _OLD_POLICIES:  # built once, at the first epoch (a later build is a resume's)
            _OLD_POLICIES[id(run)] = flow_forward.OldPolicy.build(run)
        old = _OLD_POLICIES[id(run)]
        metrics = flow_forward.forward_epoch(run, old, epoch, progress)
        flow_run.log_epoch(run, epoch, metrics, flow_forward.console_line(metrics))
        return metrics
    metrics = flow_grpo.grpo_epoch(run, epoch, progress)
    flow_run.log_epoch(run, epoch, metrics, flow_grpo.console_line(metrics))
    return metrics


_OLD_POLICIES: dict[int, flow_forward.OldPolicy] = {}


def default_warmup(recipe: flow_run.FlowRun) -> int:
    """Epochs that show every training prompt once (the cache then holds them, as in a long run); 2 when
    that is more than 10 epochs."""
    passes = math.ceil(len(recipe.train_set) / recipe.cfg.algo.prompts_per_epoch)
    return passes if passes <= 10 else 2
