"""What a command composes, through the same path as the CLI (``rlgen_cli._hydra.compose_verb``).

``rlgen train`` alone is the ShapesEval run; a launcher or a key override keeps it. Any group choice starts
from neutral defaults: the reward's natural data (upstream layout), the model's and algorithm's own
settings, no time limit, no evaluation before training, no epoch cap. Expected values are written out
by hand from the configs' documented meaning, not read from the configs.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import chosen_group, compose_verb, verb_overrides
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated

SHAPES = ("builtin:shapes_train.jsonl", "builtin:shapes_test.jsonl")
TINY = ("builtin:tiny_train.txt", "builtin:tiny_test.txt")
TINY_EDIT = ("builtin:tiny_edit_train.jsonl", "builtin:tiny_edit_test.jsonl")
TINY_VLM = ("builtin:tiny_r1vl.json", "builtin:tiny_mathvista.jsonl")
GENEVAL = ("dataset/geneval/train_metadata.jsonl", "dataset/geneval/test_metadata.jsonl")
PICKSCORE = ("dataset/pickscore/train.txt", "dataset/pickscore/test.txt")
OCR = ("dataset/ocr/train.txt", "dataset/ocr/test.txt")
COUNTING_EDIT = ("dataset/counting_edit/train_metadata.jsonl", "dataset/counting_edit/test_metadata.jsonl")
R1VL = ("data/R1-VL-10K/R1-VL-10K.json", "data/mathvista/testmini.jsonl")
JPEG = {"jpeg_compressibility"}
R1VL_REWARDS = {"answer_accuracy", "step_rar", "step_rvr"}

NO_CAP = 100000  # "train until stopped"
LEN = {"shapes": (150, 18.0, True), "shapes_grpo_fast": (170, 18.0, True), "neutral": (NO_CAP, 0.0, False)}


class Case(NamedTuple):
    args: str
    family: str
    rewards: set[str]
    data: tuple[str, str]
    length: tuple[int, float, bool]  # epochs, time_limit_minutes, eval_before (the flow loop's keys)
    window: tuple[str, int] | None  # algo.window.kind, .size (None: recipes without a window)
    algo: str | None = None  # algo.name where the model or experiment picks it


# the default's optimizer step is one micro-batch of 64 samples: two processes need two micro-batches
TWO_PROCESS_STEPS = "algo.gradient_accumulation_steps=2"
SHAPES_RUN = ("shapes", {"shapes_geneval"}, SHAPES, LEN["shapes"], None, "nft")
SHAPES_GRPO_FAST = ("shapes", {"shapes_geneval"}, SHAPES, LEN["shapes_grpo_fast"])
N = LEN["neutral"]
CASES = [
    Case("", *SHAPES_RUN),
    Case(f"launcher=accelerate {TWO_PROCESS_STEPS}", *SHAPES_RUN),
    Case("algo.lr=1e-4", *SHAPES_RUN),
    Case("experiment=shapes_nft", *SHAPES_RUN),
    Case("experiment=shapes_grpo_fast", *SHAPES_GRPO_FAST, ("random_window", 2), "grpo"),
    # the ShapesEval experiment with every other algorithm of benchmarks/shapes.py (its settings, e.g.
    # images_every, must exist in the preference and forward recipes too)
    Case("experiment=shapes_grpo_fast algo=dpo", *SHAPES_GRPO_FAST, None, "dpo"),
    Case("experiment=shapes_grpo_fast algo=nft", *SHAPES_GRPO_FAST, None, "nft"),
    Case("model=flux algo=grpo_fast reward=geneval", "flux", {"geneval"}, GENEVAL, N, ("random_window", 2)),
    Case("model=sd3 algo=grpo reward=pickscore", "sd3", {"pickscore"}, PICKSCORE, N, ("all", 0)),
    Case("model=qwen_image algo=mix_grpo reward=clipscore", "qwen_image", {"clipscore"}, PICKSCORE, N, ("sliding", 4)),
    Case("model=wan2_1 reward=ocr", "wan2_1", {"ocr"}, OCR, N, ("all", 0)),
    Case("model=flux_kontext reward=geneval", "flux_kontext", {"geneval"}, COUNTING_EDIT, N, ("all", 0)),
    Case("model=qwen_image_edit algo=grpo_fast", "qwen_image_edit", JPEG, COUNTING_EDIT, N, ("random_window", 2)),
    Case("model=tiny_sd3 launcher=accelerate launcher.num_processes=2", "sd3", JPEG, TINY, N, ("all", 0)),
    Case("model=tiny_flux algo=dance", "flux", JPEG, TINY, N, ("random_subset", 0)),
    Case("model=tiny_flux_kontext", "flux_kontext", JPEG, TINY_EDIT, N, ("all", 0)),
    Case("model=tiny_qwen_image reward=geneval", "qwen_image", {"geneval"}, GENEVAL, N, ("all", 0)),
    Case("model=tiny_qwen_image_edit algo=grpo_fast", "qwen_image_edit", JPEG, TINY_EDIT, N, ("random_window", 2)),
    Case("model=tiny_wan2_1 algo=dpo", "wan2_1", JPEG, TINY, N, None),
    Case("model=shapes_base algo=grpo", "shapes", JPEG, TINY, N, ("all", 0)),
    Case("model=tiny_qwen2_vl", "qwen2_vl", R1VL_REWARDS, TINY_VLM, N, None, "step_grpo"),
    Case("model=qwen2_5_vl", "qwen2_5_vl", R1VL_REWARDS, R1VL, N, None, "step_grpo"),
    Case("model=tiny_qwen2_vl algo=token_grpo reward=length", "qwen2_vl", {"length"}, TINY_VLM, N, None, "token_grpo"),
    # upstream Flow-GRPO evaluates at epoch 0, before the first update: its recipes keep that
    Case("experiment=geneval_sd3", "sd3", {"geneval"}, GENEVAL, (10000, 0.0, True), ("all", 0)),
    Case("experiment=mixgrpo_flux", "flux", {"hpsv2_1", "imagereward", "pickscore"}, PICKSCORE, (300, 0.0, False), ("sliding", 4)),
    Case("experiment=counting_flux_kontext", "flux_kontext", {"geneval", "image_similarity"}, COUNTING_EDIT,
         (10000, 0.0, True), ("all", 0)),
    Case("experiment=tiny_cpu", "sd3", JPEG, TINY, (80, 0.0, False), ("all", 0)),
    Case("experiment=tiny_cpu model=tiny_qwen_image_edit", "qwen_image_edit", JPEG, TINY_EDIT, (80, 0.0, False), ("all", 0)),
    Case("sampler=cps", "sd3", JPEG, TINY, N, ("all", 0)),
    Case("reward=geneval data=pickscore", "sd3", {"geneval"}, PICKSCORE, N, ("all", 0)),
    Case("reward=ocr data.train=my_prompts.txt", "sd3", {"ocr"}, ("my_prompts.txt", OCR[1]), N, ("all", 0)),
]  # fmt: skip


def _train(args: str):
    cfg = compose_verb("train", args.split())
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return cfg


FLOW_LOOP_RECIPES = {"flow_grpo", "flow_pref", "flow_pretrain", "flow_forward"}


def _length(cfg) -> tuple[int, float, bool]:
    """epochs, time_limit_minutes, eval_before; only the flow loop reads the last two (others compose none)."""
    if cfg.recipe in FLOW_LOOP_RECIPES:
        return cfg.epochs, cfg.time_limit_minutes, cfg.eval_before
    assert not hasattr(cfg, "time_limit_minutes") and not hasattr(cfg, "eval_before")
    return cfg.epochs, 0.0, False


@pytest.fixture(scope="module")
def composed() -> dict[str, object]:
    """Every case composed and validated once (one Hydra initialisation per case is the slow part)."""
    return {case.args: validated(_train(case.args)) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.args or "bare" for c in CASES])
def test_composition(case: Case, composed):
    cfg = composed[case.args]
    assert cfg.model.family == case.family
    assert set(cfg.reward.weights) == case.rewards
    assert (cfg.data.train, cfg.data.test) == case.data
    assert _length(cfg) == case.length
    if case.window is not None:
        assert (cfg.algo.window.kind, cfg.algo.window.size) == case.window
    if case.algo is not None:
        assert cfg.algo.name == case.algo


def test_there_are_enough_cases():
    assert len(CASES) >= 15


def test_bare_train_is_exactly_the_shapes_experiment():
    bare = OmegaConf.to_container(_train(""))
    assert bare == OmegaConf.to_container(_train("experiment=shapes_nft"))
    assert bare["algo"]["name"] == "nft" and bare["model"]["path"] == "builtin:shapes_base"
    assert bare["data"]["eval_num_prompts"] == 288 and bare["launcher"]["name"] == "local"


def test_the_default_differs_from_the_grpo_fast_recipe_in_algorithm_and_length_alone():
    """DiffusionNFT on Flow-GRPO-Fast's geometry (16 prompts × 8, two optimizer steps of 64 an epoch),
    each sample trained on 2 of its 10 rollout σ; everything else is the GRPO-Fast experiment's."""
    default = validated(_train(""))
    algo = default.algo
    assert (algo.prompts_per_epoch, algo.group_size, algo.train_batch_size) == (16, 8, 64)
    optimizer = (algo.gradient_accumulation_steps, algo.lr, algo.kl_weight, algo.ema.decay)
    assert optimizer == (1, 3e-5, 0.0, 0.95)
    forward = algo.forward
    assert (forward.solver, forward.sample_with_old, forward.timestep_fraction) == ("dpm2", True, 0.2)
    assert int(default.model.num_steps * algo.forward.timestep_fraction) == 2
    nft, fast = (OmegaConf.to_container(_train(args)) for args in ("", "experiment=shapes_grpo_fast"))
    for cfg in (nft, fast):
        del cfg["algo"], cfg["recipe"], cfg["epochs"]
    assert nft == fast


@pytest.mark.parametrize(
    ("args", "section", "key"),
    [(f"launcher=accelerate {TWO_PROCESS_STEPS}", "launcher", "name"), ("algo.lr=1e-4", "algo", "lr")],
)
def test_a_launcher_or_a_key_override_keeps_shapes_eval(args, section, key):
    bare, other = OmegaConf.to_container(_train("")), OmegaConf.to_container(_train(args))
    assert other[section][key] != bare[section][key]
    if section == "launcher":  # the launcher's whole section is its own; nothing else moves
        other.pop(section), bare.pop(section)
        other["algo"]["gradient_accumulation_steps"] = bare["algo"]["gradient_accumulation_steps"]
    else:
        other[section][key] = bare[section][key]
    assert other == bare


def test_two_processes_without_two_micro_batches_a_step_exit_naming_the_fix():
    with pytest.raises(UserError, match="gradient_accumulation_steps to a multiple of 2"):
        validated(_train("launcher=accelerate"))


def test_r3_runs_without_the_shapes_settings():
    tiny = validated(_train("model=tiny_r3"))
    assert tiny.model.family == "r3_composite" and tiny.r3.offline.enabled
    assert _length(tiny) == LEN["neutral"]
    recipe = validated(_train("experiment=r3_geneval"))
    assert recipe.r3.train_data_path == "./data/rl_train/train_geneval.jsonl"
    assert _length(recipe) == (1000, 0.0, False)


def _verb(name: str, args: str):
    cfg = compose_verb(name, args.split())
    OmegaConf.set_struct(cfg, False)
    if "run_dir" in cfg:  # serve-reward has none
        cfg.run_dir = "/tmp/unused"
    return validated(cfg)


@pytest.mark.parametrize(
    ("verb", "args", "family", "data"),
    [
        ("check_onpolicy", "", "sd3", TINY),
        ("check_onpolicy", "model=tiny_flux_kontext", "flux_kontext", TINY_EDIT),
        ("check_onpolicy", "model=tiny_qwen_image_edit", "qwen_image_edit", TINY_EDIT),
        ("check_onpolicy", "model=tiny_qwen2_vl", "qwen2_vl", TINY_VLM),
        ("check_onpolicy", "model=shapes_base", "shapes", TINY),
        ("eval", "", "sd3", TINY),
        ("eval", "model=tiny_qwen2_vl", "qwen2_vl", TINY_VLM),
        ("eval", "reward=geneval", "sd3", GENEVAL),
        ("eval", "experiment=shapes_eval", "shapes", SHAPES),
        ("sample", "", "sd3", TINY),
        ("sample", "model=tiny_qwen_image_edit", "qwen_image_edit", TINY_EDIT),
    ],
)
def test_other_verbs(verb, args, family, data):
    cfg = _verb(verb, args)
    assert cfg.model.family == family and (cfg.data.train, cfg.data.test) == data
    if verb == "check_onpolicy":
        assert _length(cfg)[1:] == (0.0, False)
        assert cfg.algo.name == ("step_grpo" if family == "qwen2_vl" else "grpo")


def test_check_onpolicy_picks_a_token_algorithm_for_a_vlm():
    assert _verb("check_onpolicy", "model=tiny_qwen2_vl").recipe == "vlm_rl"
    assert _verb("check_onpolicy", "").recipe == "flow_grpo"


def test_serve_reward_composes_every_paired_reward():
    cfg = _verb("serve_reward", "reward=geneval")
    assert set(cfg.reward.weights) == {"geneval"}


@pytest.mark.parametrize(
    ("arg", "group"),
    [
        ("model=flux", "model"),
        ("+experiment=x", "experiment"),
        ("~experiment", "experiment"),
        ("data@data=tiny", "data"),
        ("algo.lr=1e-4", None),
        ("data.train=a.txt", None),
        ("--cfg", None),
        ("job", None),
        ("hydra/launcher=joblib", "hydra/launcher"),
        ("launcher=accelerate", "launcher"),
    ],
)
def test_chosen_group(arg, group):
    assert chosen_group(arg) == group


def test_only_train_without_a_content_choice_gets_the_default_run():
    assert verb_overrides("train", ["--cfg", "job", "launcher=accelerate"]) == [
        "--cfg",
        "job",
        "experiment=shapes_nft",
        "launcher=accelerate",
    ]
    assert verb_overrides("train", ["sampler=cps"]) == ["sampler=cps"]
    assert verb_overrides("check_onpolicy", []) == []
