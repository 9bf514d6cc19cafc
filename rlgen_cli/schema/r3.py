"""Schema of R3 (reason → reflect → refine, Mix-GRPO): the ``r3`` section and ``recipe=r3``'s config.

The keys upstream R3's ``train_rl.sh`` names keep their names (``kl_weight_text``, ``group_size``,
``train_data_path``, ``reward_server_urls``, …; docs/r3.md maps each to an override). Everything R3 reads
lives here: its composite policy (``r3.policy``: text policy, generator, editor — three ordinary model
sections), its data, its reward, its loss weights and its optimiser, so an R3 run composes no ``algo``
and no ``sampler``; ``reward.kwargs.<name>`` still passes client options (timeouts, tokens) to the
reward that ``reward_fn`` selects.

``r3.offline``: a model may declare an offline stand-in (``model=tiny_r3`` does): its runs read the
packaged tiny prompts of ``dataset_name`` and score with a local reward, whatever an experiment says, so
``rlgen train experiment=r3_geneval model=tiny_r3`` runs on a laptop without a reward server. The stand-in
is logged at start; ``r3.offline.enabled=false`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from omegaconf import OmegaConf

from rlgen_cli.errors import UserError, require
from rlgen_cli.schema.choices import R3Dataset, SdeKind
from rlgen_cli.schema.families import families
from rlgen_cli.schema.model import (
    FlowModelConfig,
    ModelSection,
    UnifiedModelConfig,
    VlmModelConfig,
    require_family_schema,
    typed_model_section,
)
from rlgen_cli.schema.ranges import (
    ANY,
    BELOW_ONE,
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    PROBABILITY,
    at_least,
)
from rlgen_cli.schema.run import DataConfig, RewardConfig, RunConfig
from rlgen_cli.schema.unread import require_defaults, shown
from rlgen_cli.schema.vlm import VLMOptions

EtaSchedule = Literal["constant", "monotonic"]

log = logging.getLogger(__name__)

R3_FAMILIES = families("unified")
"""``model.family`` values that run the R3 recipe: the composite of three models (``r3.policy.text`` /
``generator`` / ``editor``) or BAGEL, one network for both tracks (``r3.policy.bagel``, ``r3.policy.think``)."""
SERVED_REWARDS = ("geneval", "geneval_plus", "tiif")
"""``reward_fn`` values scored by a server: the GenEval server, or the VLM judge with GenEval++ / TIIF
prompts. Any other value names a local reward of the registry (``mix`` = the ``reward`` section as is)."""
SERVED_COMPONENTS = {"geneval": "remote", "geneval_plus": "geneval_plus", "tiif": "tiif"}
"""The reward component (``reward.kwargs.<component>`` holds its client options) that scores each served
``reward_fn``."""
SERVED_GENEVAL = "geneval"
"""The reward ``reward_fn=geneval`` calls on the server."""
TINY_DATA = {name: f"builtin:r3_{name}_tiny.jsonl" for name in get_args(R3Dataset)}


def is_r3(model: ModelSection) -> bool:
    """Whether ``model`` is a unified policy (R3 recipe, check and eval)."""
    return model.family in R3_FAMILIES


def track_models(family: str, policy: Any) -> dict[str, list[Any]]:
    """The model sections each track runs (``text`` / ``image``): the composite's parts, or BAGEL twice."""
    if family == "r3_bagel":
        return {"text": [policy.bagel], "image": [policy.bagel]}
    return {"text": [policy.text], "image": [policy.generator, policy.editor]}


@dataclass
class R3PolicySection:
    """The unified policy's networks; its keys are those of the policy the model option picks
    (``- /r3_policy@r3.policy: r3_composite`` or ``r3_bagel``)."""

    def require_family_schemas(self) -> None:
        """Each network was composed with its family's schema (each policy names its networks)."""


@dataclass
class R3CompositePolicy(R3PolicySection):
    """``model.family=r3_composite``: one model section per role, each as ``model=`` would give it."""

    text: VlmModelConfig = field(default_factory=lambda: VlmModelConfig(family="qwen2_5_vl", tiny=True))
    """Text policy (plans, critiques, instructions): a VLM family (qwen2_vl | qwen2_5_vl). Of its ``vlm``
    keys R3 reads the pixel bounds, ``max_context`` and ``freeze_vision``; the VLM recipes' prompt, length
    and evaluation keys (``system_prompt``, ``prompt_format``, ``completion_cap``, ``eval_*``) are refused:
    R3 writes its own prompts, ``r3.max_output_token_n_gen`` / ``_edit`` tokens, greedily when evaluating."""
    generator: FlowModelConfig = field(
        default_factory=lambda: FlowModelConfig(family="qwen_image", tiny=True)
    )
    """Text-to-image policy (reason stage): any flow family without source images."""
    editor: FlowModelConfig = field(
        default_factory=lambda: FlowModelConfig(family="qwen_image_edit", tiny=True)
    )
    """Editing policy (refine stage): any flow family that takes source images."""
    share_text_encoder: bool = False
    """The text policy IS the generator's Qwen2.5-VL text encoder, with a LoRA adapter that is disabled
    whenever the generator encodes a prompt (one copy of the 7 B weights instead of two)."""

    def __post_init__(self) -> None:
        require_text_vlm_unread(self.text.vlm)

    def require_family_schemas(self) -> None:
        for role in ("text", "generator", "editor"):
            require_family_schema(getattr(self, role), f"r3.policy.{role}")


@dataclass
class R3BagelPolicy(R3PolicySection):
    """``model.family=r3_bagel``: the one BAGEL network that writes, draws and edits."""

    bagel: FlowModelConfig = field(default_factory=lambda: FlowModelConfig(family="bagel", tiny=True))
    """The BAGEL network (a ``model=bagel`` section). ``lora.enabled=false``: full fine-tuning of everything
    but the ViT (upstream R3); ``true``: one adapter whose targets must name both experts (understanding =
    text track, ``*_moe_gen`` = image)."""
    think: bool = True
    """Reason = plan text, then the image from prompt + plan (BAGEL's thinking mode); false = no plan, the
    image from the prompt alone (the reason stage then trains its image only)."""

    def require_family_schemas(self) -> None:
        require_family_schema(self.bagel, "r3.policy.bagel")


R3_UNREAD_TEXT_VLM = {
    "system_prompt": "R3 gives its text policy its own system prompts (r3/prompts.py: one to plan, one to "
    "reflect); no setting replaces them",
    "prompt_format": "R3 writes its own reason and reflect prompts (r3/prompts.py); no setting changes them",
    "completion_cap": "R3 caps plans at r3.max_output_token_n_gen and reflections at "
    "r3.max_output_token_n_edit tokens: set those instead",
    "eval_max_new_tokens": "R3's evaluation writes up to r3.max_output_token_n_gen (plans) and "
    "r3.max_output_token_n_edit (reflections) tokens: set those instead",
    "eval_temperature": "R3's evaluation decodes greedily; no setting samples its text",
    "eval_top_p": "R3's evaluation decodes greedily; no setting samples its text",
    "eval_top_k": "R3's evaluation decodes greedily; no setting samples its text",
}
"""``r3.policy.text.vlm.*`` keys of the VLM recipes that R3 never reads → what R3 does instead."""


def require_text_vlm_unread(vlm: VLMOptions) -> None:
    """The text policy's :data:`R3_UNREAD_TEXT_VLM` keys at their schema defaults: another value would
    silently do nothing, so it is refused (from the command line, an experiment or a model YAML alike)."""
    require_defaults(
        vlm,
        VLMOptions,
        R3_UNREAD_TEXT_VLM,
        lambda key, value, _: (
            f"r3.policy.text.vlm.{key}={shown(value)} does nothing with R3: {R3_UNREAD_TEXT_VLM[key]}. "
            f"Drop r3.policy.text.vlm.{key}"
        ),
    )


R3_POLICY_SCHEMAS: dict[str, type] = {"r3_composite": R3CompositePolicy, "r3_bagel": R3BagelPolicy}
"""``model.family`` → the schema of ``r3.policy`` (the ``r3_policy`` config group's options)."""


def require_policy_schema(family: str, policy: R3PolicySection) -> None:
    """``r3.policy`` was composed with the schema of ``family``'s policy, each network with its family's."""
    schema = R3_POLICY_SCHEMAS[family]
    require(
        type(policy) is schema,
        f"model.family={family} reads r3.policy as {schema.__name__}, and it was composed as "
        f"{type(policy).__name__}: choose the family's model option (model=tiny_r3, r3_qwen, r3_bagel, "
        f"tiny_r3_bagel), or give a model YAML of your own '- /r3_policy@r3.policy: {family}' in its defaults",
    )
    policy.require_family_schemas()


def typed_policy(family: str, saved: Any) -> Any:
    """A checkpoint's saved ``r3.policy`` under the schema of ``family``'s policy, each network under its
    family's schema; keys the policy does not read (saved by an rlgen with one policy schema for both
    families) are dropped."""
    schema = R3_POLICY_SCHEMAS[family]
    kept = {
        f.name: typed_model_section(saved[f.name]) if f.name in MODEL_ROLES else saved[f.name]
        for f in dataclasses.fields(schema)
        if f.name in saved
    }
    if "text" in kept:  # an older rlgen's runs may hold values R3 never read: they are refused now
        _reset_unread_text_vlm(kept["text"])
    return OmegaConf.merge(OmegaConf.structured(schema), kept)


def _reset_unread_text_vlm(text: Any) -> None:
    """A saved text policy's :data:`R3_UNREAD_TEXT_VLM` keys back at their defaults (they changed nothing)."""
    defaults = VLMOptions()
    for key in R3_UNREAD_TEXT_VLM:
        text.vlm[key] = getattr(defaults, key)


MODEL_ROLES = ("text", "generator", "editor", "bagel")
"""The fields of a policy that hold a model section."""


@dataclass
class OfflineConfig:
    """A model's offline stand-in for data and reward (see the module docstring)."""

    enabled: bool = False
    """Read the packaged prompts of ``data`` and score with ``reward`` instead of the experiment's data
    and reward server (the model option sets it)."""
    reward: str = "jpeg_compressibility"
    """Local reward that replaces ``reward_fn``: it must score any prompt set, so not a GenEval detector."""
    data: dict[str, str] = field(default_factory=lambda: dict(TINY_DATA))
    """``dataset_name`` → the prompts that replace ``train_data_path`` and ``val_data_path``."""


@dataclass
class R3Config:
    # -- upstream R3's keys ----------------------------------------------------------------------------
    kl_weight_text: Annotated[float, NON_NEGATIVE] = 0.001
    """KL weight of the text track (k3 estimator against the reference = adapter off)."""
    kl_weight_image: Annotated[float, NON_NEGATIVE] = 0.001
    """KL weight of the image track: mean((μθ − μref)²/s²) at the trained step."""
    tune_text_cot: bool = True
    """Train the text track (plans and instructions) with token GRPO (needs ce_weight > 0)."""
    tune_image_cot: bool = True
    """Train the image track (generated and edited images) with Flow-GRPO at each image's SDE step (needs
    enable_sde_gen or enable_sde_edit, and mse_weight or kl_weight_image > 0)."""
    group_size: Annotated[int, at_least(2)] = 16
    """Branches per prompt (reason) or per stage-1 image (refine)."""
    prompts_per_step: Annotated[int, COUNT] = 1
    """Prompts (reason) or stage-1 images (refine) per optimizer step, over all processes: a step rolls out
    prompts_per_step × group_size branches, dealt to the processes in equal consecutive shares — whole
    groups each, or one group over num_processes / prompts_per_step consecutive processes, which then share
    its prompt, initial noise and SDE step (:class:`R3Geometry`). Upstream: 2 (16 branches on each of 4
    of 8 GPUs)."""
    max_output_token_n_gen: Annotated[int, COUNT] = 196
    """Text tokens of a plan (reason stage)."""
    max_output_token_n_edit: Annotated[int, COUNT] = 384
    """Text tokens of a reflection (reflect stage)."""
    num_timesteps_gen: Annotated[int, at_least(2)] = 16
    """Timesteps of the generation schedule, both ends included: 16 = 15 denoising steps (upstream)."""
    num_timesteps_edit: Annotated[int, at_least(2)] = 21
    """Timesteps of the editing schedule: 21 = 20 denoising steps (upstream)."""
    enable_sde_gen: bool = True
    """One SDE step per generated image (false = ODE only: the reason stage trains text alone)."""
    enable_sde_edit: bool = True
    """One SDE step per edited image (false = ODE only: the refine stage trains text alone)."""
    train_data_path: str | None = "./data/rl_train/train_geneval.jsonl"
    """Training prompts (jsonl in the format of dataset_name); ``builtin:NAME`` = a packaged file."""
    val_data_path: str | None = "./data/rl_test/test_geneval.jsonl"
    """Evaluation prompts, same format (null = train_data_path)."""
    dataset_name: Annotated[str, R3Dataset] = "geneval"
    """geneval | geneval_plus | tiif (docs/maths.md §12)."""
    reward_fn: str = "geneval"
    """geneval (GenEval server) | geneval_plus | tiif (OpenAI-compatible judge with those prompts) | mix
    (the ``reward`` section) | the name of any local reward."""
    reward_server_urls: list[str] = field(default_factory=list)
    """Hosts of the reward servers / judges (empty = the client's default, 127.0.0.1)."""
    reward_server_port: Annotated[list[int], PORT] = field(default_factory=list)
    """Ports on every host (empty = the client's default); endpoints = every host × port."""
    # -- rewards and loss -----------------------------------------------------------------------------
    format_weight: Annotated[float, ANY] = 1.0
    """w_f: reason text reward f·(r + w_f), refine text reward f·(w_f + Δ) (upstream's
    ``format_reward_weight``, 1.0 in its code and training script)."""
    ce_weight: Annotated[float, NON_NEGATIVE] = 1.0
    """Weight of the text track: ce_weight·(L_text + kl_weight_text·KL_text)."""
    mse_weight: Annotated[float, NON_NEGATIVE] = 2.0
    """Weight of the image track's policy loss (mse_weight·L_img + kl_weight_image·KL_img)."""
    clip_range: Annotated[float, POSITIVE] = 0.2
    """PPO clip ε of both tracks."""
    scale_by_std: bool = False
    """Divide advantages by the group std (+1e-4); R3 only subtracts the group mean."""
    perfect_ratio: Annotated[float, PROBABILITY] = 0.15
    """Share of refine steps whose stage-1 image is drawn from the perfect ones."""
    perfect_threshold: Annotated[float, ANY] = 1.0
    """A stage-1 image with reward ≥ this is perfect (GenEval: every clause satisfied)."""
    buffer_size: Annotated[int, COUNT] = 256
    """Stage-1 images kept for the refine stage (the newest; shared by all ranks)."""
    max_sde_timestep_idx_for_edit: Annotated[int, COUNT] = 2
    """The edit stage's SDE step is one of the first N steps."""
    # -- sampling ---------------------------------------------------------------------------------------
    temperature: Annotated[float, POSITIVE] = 0.9
    """Text sampling temperature (log-probs are always taken at temperature 1)."""
    top_p: Annotated[float, FRACTION] = 0.9
    """Nucleus (top-p) of text sampling."""
    sde_kind: Annotated[str, SdeKind] = "dance"
    """Stochastic step: dance (score form, η from ``eta_schedule``) | flow_sde | cps."""
    eta_schedule: Annotated[str, EtaSchedule] = "constant"
    """η of the ``dance`` step: ``constant`` (the noise level) or ``monotonic`` (upstream R3's default:
    η·sqrt(σ / (1 − min(σ, 0.95))) at the step's σ, growing towards noise)."""
    noise_level_gen: Annotated[float, NON_NEGATIVE] = 0.7
    """η of the generation SDE step."""
    noise_level_edit: Annotated[float, NON_NEGATIVE] = 1.0
    """η of the editing SDE step."""
    micro_batch_size: Annotated[int | None, COUNT] = None
    """Branches per forward on one process (rollout and training alike; a text micro-batch samples under
    the seed of its first branch); null = a process's share of one group. It must divide that share; a
    number that does on every process count compared gives the same forwards, so the same run, on each."""
    # -- optimiser --------------------------------------------------------------------------------------
    lr: Annotated[float, POSITIVE] = 5e-6
    """AdamW's learning rate (both tracks)."""
    warmup_steps: Annotated[int, NON_NEGATIVE] = 10
    """Linear learning-rate warm-up, then constant."""
    adam_beta1: Annotated[float, BELOW_ONE] = 0.9
    """AdamW's β₁ (decay of the gradient's running mean)."""
    adam_beta2: Annotated[float, BELOW_ONE] = 0.95
    """AdamW's β₂ (decay of the squared gradient's running mean)."""
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: Annotated[float, ANY] = 1.0
    """Global grad-norm clip over both tracks; ≤ 0 disables it."""
    # -- evaluation -------------------------------------------------------------------------------------
    eval_rounds: Annotated[int, NON_NEGATIVE] = 3
    """``rlgen eval``: reflect → refine rounds after generation (auto-stop on "no further edit needed")."""
    eval_max_prompts: Annotated[int, NON_NEGATIVE] = 8
    """Prompts of the periodic evaluation during training (0 = all of val_data_path)."""
    policy: R3PolicySection = field(default_factory=R3PolicySection)
    offline: OfflineConfig = field(default_factory=OfflineConfig)

    def __post_init__(self) -> None:
        require(
            self.tune_text_cot or self.tune_image_cot, "r3.tune_text_cot and r3.tune_image_cot are both false"
        )
        require(bool(self.reward_fn), "r3.reward_fn is empty; e.g. geneval, geneval_plus, tiif or mix")
        require(
            self.max_sde_timestep_idx_for_edit <= self.num_timesteps_edit - 1,
            f"r3.max_sde_timestep_idx_for_edit ({self.max_sde_timestep_idx_for_edit}) must be in "
            f"[1, {self.num_timesteps_edit - 1}] (the editing steps)",
        )
        require(
            self.eta_schedule == "constant" or self.sde_kind == "dance",
            f"r3.eta_schedule={self.eta_schedule} scales η of the score-form step: use r3.sde_kind=dance "
            f"(not {self.sde_kind}) or r3.eta_schedule=constant",
        )
        require(
            self.sde_kind != "cps" or max(self.noise_level_gen, self.noise_level_edit) <= 1,
            "r3.sde_kind=cps takes noise levels in [0, 1]: set r3.noise_level_gen and r3.noise_level_edit",
        )

    @property
    def steps_gen(self) -> int:
        """Denoising steps of the reason stage."""
        return self.num_timesteps_gen - 1

    @property
    def steps_edit(self) -> int:
        """Denoising steps of the refine stage."""
        return self.num_timesteps_edit - 1

    def data_paths(self) -> tuple[str, str]:
        """(train, val) prompts, the offline stand-in's when it is on.

        Raises:
            UserError: When neither the paths nor an offline stand-in give prompts.
        """
        if self.offline.enabled:
            require(
                self.dataset_name in self.offline.data,
                f"r3.offline.data has no prompts for dataset_name={self.dataset_name!r}",
            )
            path = self.offline.data[self.dataset_name]
            return path, path
        path = self.train_data_path or self.val_data_path
        if path is None:  # (require() cannot tell the type checker that path is a str after it)
            raise UserError(
                "r3.train_data_path is not set: give the jsonl of r3.dataset_name (e.g. r3.train_data_path="
                "data/rl_train/train_geneval.jsonl, or the packaged builtin:r3_geneval_tiny.jsonl)"
            )
        return self.train_data_path or path, self.val_data_path or path


@dataclass(frozen=True)
class R3Geometry:
    """How a step's prompts_per_step × group_size branches split over ``world_size`` processes.

    Process r rolls out the consecutive global positions r·per_process … r·per_process + per_process − 1
    (branch j of prompt p sits at p·group_size + j), in pieces of ``group_share`` branches of one group
    each; a group spans ``ranks_per_group`` consecutive processes (upstream's policy group). Everything a
    branch draws is keyed by its global position or its group, so the run is the same on any process count
    that keeps the forwards (``micro_batch``) the same.
    """

    prompts_per_step: int
    group_size: int
    world_size: int
    micro_batch_size: int | None

    @property
    def branches_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def per_process(self) -> int:
        """Branches one process rolls out per step."""
        return self.branches_per_step // self.world_size

    @property
    def group_share(self) -> int:
        """Branches of one group on one process: the whole group, or its part when the group spans
        processes."""
        return min(self.per_process, self.group_size)

    @property
    def ranks_per_group(self) -> int:
        return self.group_size // self.group_share

    @property
    def micro_batch(self) -> int:
        """Branches per forward: ``micro_batch_size``, or null = a process's share of one group."""
        return self.micro_batch_size or self.group_share

    def first_position(self, rank: int) -> int:
        return rank * self.per_process


def r3_geometry(r3: R3Config, world_size: int) -> R3Geometry:
    """The split of a step over ``world_size`` processes.

    Raises:
        UserError: When the step's branches cannot be dealt in equal shares of whole groups or equal parts
            of one group, or ``r3.micro_batch_size`` does not divide a process's share of a group.
    """
    geometry = R3Geometry(r3.prompts_per_step, r3.group_size, world_size, r3.micro_batch_size)
    prompts, size, branches = r3.prompts_per_step, r3.group_size, geometry.branches_per_step
    require(
        branches % world_size == 0,
        f"r3.prompts_per_step × r3.group_size = {prompts} × {size} = {branches} branches per step cannot be "
        f"split over {world_size} processes: every process rolls out the same number of branches. Use a "
        f"process count that divides {branches}, or change r3.prompts_per_step (prompts per step over all "
        "processes) or r3.group_size",
    )
    require(
        prompts % world_size == 0 or world_size % prompts == 0,
        f"{world_size} processes would each roll out {geometry.per_process} branches of a step of "
        f"{prompts} prompts × {size}, mixing parts of different groups (r3.prompts_per_step={prompts}): a "
        "process rolls out whole groups or an equal part of one group. Use a process count that divides or "
        "is a multiple of r3.prompts_per_step, or set r3.prompts_per_step to a divisor or a multiple of "
        f"{world_size}",
    )
    require(
        r3.micro_batch_size is None or geometry.group_share % r3.micro_batch_size == 0,
        f"r3.micro_batch_size ({r3.micro_batch_size}) must divide the {geometry.group_share} branches of a "
        f"group on each of {world_size} processes (r3.prompts_per_step={prompts}, r3.group_size={size}): a "
        "forward holds branches of one group. Use a divisor of it, or null (that share per forward)",
    )
    return geometry


def require_same_forwards(geometry: R3Geometry, exact_reduction: bool | None) -> None:
    """``r3.micro_batch_size=null`` (a process's share of a group per forward) with a group spread over
    processes: the forwards hold fewer branches than on one process and round differently, so the run
    depends on the process count in the last bits. Refused under ``launcher.exact_reduction=true`` (the
    promise of the same run on any process count), a warning under null (on where it can be)."""
    if geometry.micro_batch_size is not None or geometry.ranks_per_group == 1:
        return
    message = (
        f"r3.micro_batch_size=null runs {geometry.group_share} branches per forward on {geometry.world_size} "
        f"processes and {geometry.group_size} on one: forwards of other sizes round differently, so this run "
        "differs from one on another process count in the last bits. Set "
        f"r3.micro_batch_size={geometry.group_share} for the same run on any process count that divides it"
    )
    require(exact_reduction is not True, message)
    log.warning(message)


def require_trainable_tracks(r3: R3Config) -> None:
    """Each tuned track can receive a gradient: the text track's loss is weighted by ``ce_weight``; the image
    track trains each image's SDE step (none with both stages ODE only) on ``mse_weight·L_img +
    kl_weight_image·KL_img``. A tuned track that cannot would leave its switch and weights doing nothing, and
    with the other track off the run would train nothing at all (``grad_norm`` 0 every step)."""
    if r3.tune_text_cot:
        require(
            r3.ce_weight > 0,
            "r3.ce_weight=0 weights the text track's loss to nothing, so r3.tune_text_cot=true trains no text: "
            f"set a positive r3.ce_weight{_or_other_track(r3.tune_image_cot, 'tune_text_cot', 'image')}",
        )
    if not r3.tune_image_cot:
        return
    alone = _or_other_track(r3.tune_text_cot, "tune_image_cot", "text")
    require(
        r3.enable_sde_gen or r3.enable_sde_edit,
        "r3.tune_image_cot=true trains each image's SDE step, and r3.enable_sde_gen=false "
        "r3.enable_sde_edit=false draw every image by ODE: turn a stage's SDE on (r3.enable_sde_gen=true or "
        f"r3.enable_sde_edit=true){alone}",
    )
    require(
        r3.mse_weight > 0 or r3.kl_weight_image > 0,
        "r3.mse_weight=0 and r3.kl_weight_image=0 weight the image track's loss to nothing, so "
        f"r3.tune_image_cot=true trains no image: set a positive r3.mse_weight{alone}",
    )


def _or_other_track(other_on: bool, switch: str, other: str) -> str:
    """The alternative a refused track's message offers: switch it off when the other track trains."""
    if other_on:
        return f", or r3.{switch}=false to train the {other} track alone"
    return f" (the {other} track is off too: this run would train nothing)"


def _check_bagel(bagel: FlowModelConfig) -> None:
    require(
        bagel.family == "bagel",
        f"model.family=r3_bagel runs the BAGEL of r3.policy.bagel; its family is {bagel.family!r}: set "
        "r3.policy.bagel.family=bagel",
    )


R3_DATA_KEYS = {
    "train": "R3 reads its training prompts from r3.train_data_path (in the format of r3.dataset_name): set "
    "r3.train_data_path instead",
    "test": "R3 evaluates on r3.val_data_path (null = r3.train_data_path): set r3.val_data_path instead",
    "eval_num_prompts": "R3's periodic evaluation takes the first r3.eval_max_prompts prompts of "
    "r3.val_data_path: set r3.eval_max_prompts instead",
    "eval_images_per_prompt": "R3's evaluation draws one image per prompt and refines it over r3.eval_rounds "
    "reflect → refine rounds; no setting draws more",
}
"""``data.*`` → where R3 takes it from: it reads none of the ``data`` section every run composes."""


def require_data_unread(data: DataConfig) -> None:
    """``recipe=r3`` reads none of ``data.*`` (:data:`R3_DATA_KEYS`): a value other than the schema's default
    would silently do nothing, so it is refused, naming the ``r3.*`` key that does it. R3's model options
    leave the data group unset (``- override /data@_global_.data: null``), so a reward option's natural
    data (``reward=geneval_remote`` → ``data=geneval``) does not land here."""
    require_defaults(
        data,
        DataConfig,
        R3_DATA_KEYS,
        lambda key, value, _: (
            f"data.{key}={value} does nothing with recipe=r3: {R3_DATA_KEYS[key]}. Drop data.{key} (or the "
            "data= option; a model YAML of your own for R3 adds '- override /data@_global_.data: null' to its "
            "defaults, as conf/model/r3_qwen.yaml does, so that a reward option's data stays out)"
        ),
    )


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else [value] if isinstance(value, str | int) else list(value)


def require_served_reward_keys(r3: R3Config, reward: RewardConfig) -> None:
    """Refuse client options a served ``reward_fn`` would override or merge with the ``r3`` keys.

    ``reward_fn=geneval`` calls the server's ``geneval``, and ``r3.reward_server_urls`` × ``_port`` are
    the endpoints: a ``reward.kwargs.<component>.reward`` naming another reward, ``endpoints`` beside
    the ``r3`` keys (the client would balance over both sets) or ``hosts`` other than
    ``r3.reward_server_urls`` would be overridden or merged without a word. (``ports``, which the
    client presets fill, are replaced by a non-empty ``r3.reward_server_port``.)

    Raises:
        UserError: Naming the keys in conflict and how to keep one of them.
    """
    if r3.offline.enabled or r3.reward_fn not in SERVED_COMPONENTS:
        return
    component = SERVED_COMPONENTS[r3.reward_fn]
    kwargs, key = dict(reward.kwargs.get(component) or {}), f"reward.kwargs.{component}"
    named = kwargs.get("reward")
    if component == "remote" and named not in (None, SERVED_GENEVAL):
        raise UserError(
            f"r3.reward_fn=geneval calls the server's {SERVED_GENEVAL!r} reward, but {key}.reward={named} "
            f"names another: drop {key}.reward, or score with r3.reward_fn=mix and {key}.reward={named}"
        )
    r3_keys = [f"r3.{k}={v}" for k, v in (("reward_server_urls", r3.reward_server_urls),
                                          ("reward_server_port", r3.reward_server_port)) if v]  # fmt: skip
    endpoints = _as_list(kwargs.get("endpoints"))
    if endpoints and r3_keys:
        raise UserError(
            f"{key}.endpoints={endpoints} and {' '.join(r3_keys)} both name R3's reward servers, and the "
            f"client would balance over all of them: give them in one place, r3.reward_server_urls and "
            f"r3.reward_server_port ({key}.endpoints=null), or {key}.endpoints with "
            f"r3.reward_server_urls=[] r3.reward_server_port=[] {key}.ports=null"
        )
    hosts = _as_list(kwargs.get("hosts"))
    if hosts and r3.reward_server_urls and hosts != list(r3.reward_server_urls):
        raise UserError(
            f"{key}.hosts={hosts} differs from r3.reward_server_urls={r3.reward_server_urls}, which R3 "
            f"uses: set the hosts in r3.reward_server_urls and drop {key}.hosts"
        )


@dataclass
class R3TrainConfig(RunConfig):
    """``recipe=r3``: the shared run keys plus ``r3`` (no ``algo``, no ``sampler``)."""

    recipe: str = "r3"
    model: UnifiedModelConfig = field(default_factory=lambda: UnifiedModelConfig(family="r3_composite"))
    """The unified family; its networks are configured under ``r3.policy``."""
    r3: R3Config = field(default_factory=R3Config)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_data_unread(self.data)
        require_trainable_tracks(self.r3)
        require_served_reward_keys(self.r3, self.reward)
        require_same_forwards(r3_geometry(self.r3, self.launcher.world_size), self.launcher.exact_reduction)
        require_policy_schema(self.model.family, self.r3.policy)
        if isinstance(self.r3.policy, R3BagelPolicy):  # model.family=r3_bagel (required just above)
            _check_bagel(self.r3.policy.bagel)
        self.r3.data_paths()

    def text_policy_dtype(self) -> str:
        """The text policy's dtype (what check-onpolicy's text tolerance defaults from)."""
        return track_models(self.model.family, self.r3.policy)["text"][0].dtype
