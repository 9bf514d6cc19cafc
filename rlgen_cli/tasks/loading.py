"""Rebuild a policy for sampling or evaluation, from the config or from a checkpoint's own config.

A checkpoint's weights only fit the model that made them, so ``rlgen sample`` / ``rlgen eval`` of a
checkpoint draw with the checkpoint's saved ``model`` section, the command line's ``model.*`` overrides
on top (dtype, guidance, decoding, …). What would make the weights not fit is refused instead of silently
replaced: a checkpoint of another kind or (chosen on the command line) another family, and an override
of a key that defines the saved weights (``schema/model.py: WEIGHT_KEYS``). :func:`with_checkpoint_model`
puts that section into the verb's config before ``resolved.yaml`` is written, so the run directory
records the model that drew the images, and :func:`describe_model` is the line ``run.log`` names it with.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlgen_cli.errors import UserError
from rlgen_cli.schema.families import family_spec
from rlgen_cli.schema.model import WEIGHT_KEYS, typed_model_section
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.schema.unread import shown
from rlgen_cli.tasks.common import command_line_overrides

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."


def _model_overrides() -> list[Any]:
    """The command line's overrides of ``model.*`` keys (``+`` / ``++`` ones too), parsed by Hydra."""
    return [
        o for o in command_line_overrides() if o.key_or_group.startswith(MODEL_PREFIX) and not o.is_delete()
    ]


def _chosen_model() -> str | None:
    """The command line's choice of model, when it made one: ``model.family=NAME``, ``model=NAME``, or
    an experiment's model option other than the verb's default; None when it left the default."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    overrides = {o.key_or_group: o for o in command_line_overrides() if not o.is_delete()}
    if "model.family" in overrides:
        return overrides["model.family"].input_line
    hydra = HydraConfig.get()
    option = hydra.runtime.choices.get("model")
    if "model" in overrides:
        return f"model={option}"
    if option == _default_model(hydra.job.config_name):
        return None
    experiment = hydra.runtime.choices.get("experiment")
    return f"model={option}" + (f" (from experiment={experiment})" if experiment else "")


def _default_model(config_name: str) -> str | None:
    """The model option the verb's primary config (``conf/NAME.yaml``) picks in its defaults."""
    from rlgen_cli._hydra import conf_dir

    defaults = OmegaConf.load(conf_dir() / f"{config_name}.yaml").get("defaults", [])
    return next(
        (entry["model"] for entry in defaults if isinstance(entry, Mapping) and "model" in entry), None
    )


@functools.cache
def _model_options(family: str) -> tuple[str, ...]:
    """The ``conf/model`` options of ``family``."""
    from rlgen_cli._hydra import conf_dir
    from rlgen_cli.schema.model import option_family

    paths = sorted((conf_dir() / "model").glob("*.yaml"))
    return tuple(p.stem for p in paths if option_family(OmegaConf.load(p)) == family)


def require_checkpoint_family(saved: str, composed: str, checkpoint: str, verb: str) -> None:
    """A checkpoint's weights fit only the family that made them: refused, a checkpoint of another kind
    than the model ``rlgen verb`` composes (a VLM's where flow models draw), and one of another family than
    the model the command line chose (without a choice the checkpoint's own model is used)."""
    saved_kind, composed_kind = family_spec(saved).kind, family_spec(composed).kind
    options = ", ".join(_model_options(saved)) or saved
    held = f"checkpoint={checkpoint} holds a model.family={saved} model ({saved_kind})"
    if saved_kind != composed_kind:
        if verb == "sample":
            fix = f"rlgen sample draws with flow models only; evaluate it with rlgen eval model=OPTION ({options})"
        else:
            fix = f"choose a model option of its family, model=OPTION ({options}), so rlgen {verb} composes its kind"
        raise UserError(f"{held}, and this config composes model.family={composed} ({composed_kind}): {fix}")
    chosen = _chosen_model()
    if chosen is not None and saved != composed:
        raise UserError(
            f"{chosen} is a model.family={composed} model, and {held}: its weights fit only {saved}. Drop "
            f"that choice to {verb} the checkpoint's own model, or choose one of {saved}'s options ({options})"
        )


def checkpoint_model(cfg: DictConfig, checkpoint: str, verb: str) -> DictConfig:
    """The ``model`` section ``checkpoint``'s weights fit: its saved one, with the command line's ``model.*``
    overrides on top; refused where the weights would not fit (:func:`require_checkpoint_family`,
    :func:`require_saved_weights`)."""
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    saved = typed_model_section(open_checkpoint(checkpoint).config().model)
    require_checkpoint_family(saved.family, cfg.model.family, checkpoint, verb)
    model = saved.copy()
    for override in _model_overrides():
        key = override.key_or_group.removeprefix(MODEL_PREFIX)
        try:
            OmegaConf.update(model, key, override.value(), merge=True)
        except OmegaConfBaseException as err:
            raise UserError(
                f"{override.input_line} does not apply to checkpoint={checkpoint}'s model.family={saved.family} "
                f"section ({err}): drop it"
            ) from err
        require_saved_weights(saved, model, key, checkpoint)
    return model


def require_saved_weights(saved: DictConfig, model: DictConfig, key: str, checkpoint: str) -> None:
    """An override of ``model.KEY`` keeps every key of :data:`WEIGHT_KEYS` it reaches at its saved value:
    another rank, seed or base would give other weights than the trained ones (or not load them)."""
    for weight_key in WEIGHT_KEYS:
        if not (key == weight_key or key.startswith(f"{weight_key}.") or weight_key.startswith(f"{key}.")):
            continue
        compared = max(key, weight_key, key=len)  # the deeper of the two: the key the user set, or its part
        before, after = (_plain(OmegaConf.select(section, compared)) for section in (saved, model))
        if before != after:
            raise UserError(
                f"model.{compared}={shown(after)} would change the weights checkpoint={checkpoint} holds: it was "
                f"trained with model.{compared}={shown(before)}, and its tensors fit only that. Drop the "
                f"override (or set model.{compared}={shown(before)}); other weights need another checkpoint "
                "or none"
            )


def _plain(value: Any) -> Any:
    """A selected config value as plain Python (sections and lists compared by value)."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def with_checkpoint_model(cfg: DictConfig, checkpoint: str | None, verb: str) -> DictConfig:
    """``cfg`` with its ``model`` replaced by the checkpoint's (unchanged without a checkpoint): the config
    the run really uses, which ``resolved.yaml`` then records."""
    if checkpoint is None:
        return cfg
    cfg = cfg.copy()
    cfg.model = checkpoint_model(cfg, checkpoint, verb)
    return cfg


def with_checkpoint_policy(cfg: DictConfig, checkpoint: str | None) -> DictConfig:
    """``cfg`` with ``r3.policy`` replaced by the checkpoint's, as R3's evaluation loads it (a unified
    policy's weights fit only the parts that made them)."""
    if checkpoint is None:
        return cfg
    from rlgen_cli.schema.r3 import typed_policy
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    saved = open_checkpoint(checkpoint).config()
    require_checkpoint_family(saved.model.family, cfg.model.family, checkpoint, "eval")
    cfg = cfg.copy()
    cfg.r3.policy = typed_policy(cfg.model.family, saved.r3.policy)
    return cfg


def describe_model(model_cfg: ModelConfig, checkpoint: str | None) -> str:
    """What draws the images, in one line: the family, where its weights come from, its sampling
    settings, and the checkpoint whose trained weights are loaded."""
    if model_cfg.tiny:
        source = f"tiny (random weights, tiny_seed={model_cfg.tiny_seed})"
    elif model_cfg.weights == "random_init":
        source = f"random_init ({model_cfg.variant} architecture, tiny_seed={model_cfg.tiny_seed})"
    else:
        source = f"path={model_cfg.path}" + (f"@{model_cfg.revision}" if model_cfg.revision else "")
    trained = f", trained weights of {checkpoint}" if checkpoint else ", base weights"
    if not hasattr(model_cfg, "resolution"):  # a VLM's section: no image size or guidance to report
        return f"model.family={model_cfg.family} {source}, dtype={model_cfg.dtype}{trained}"
    size = f"{model_cfg.height or model_cfg.resolution}x{model_cfg.width or model_cfg.resolution}"
    return (
        f"model.family={model_cfg.family} {source}, dtype={model_cfg.dtype}, {size}, "
        f"guidance_scale={model_cfg.guidance_scale}{trained}"
    )


def load_policy(model_cfg: ModelConfig, checkpoint: str | None, device_name: str) -> Any:
    """The policy of ``model_cfg`` with ``checkpoint``'s trained weights loaded (when given).

    ``model_cfg`` is the model the run uses: with a checkpoint, the one :func:`with_checkpoint_model` put
    into the config.
    """
    from rlgen_cli.models import build_policy, resolve_device
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    policy = build_policy(model_cfg, resolve_device(device_name))
    if checkpoint is None:
        return policy
    ckpt = open_checkpoint(checkpoint)
    policy.trainable.load(ckpt.weights)
    log.info("loaded trained weights from %s", ckpt.path)
    return policy
