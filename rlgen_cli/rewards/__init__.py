"""Rewards: the :class:`Reward` protocol, the registry, weighted mixes and local rewards.

Importing this package registers the built-in local rewards (``brightness``, ``char_fraction``,
``jpeg_compressibility``, ``jpeg_incompressibility``, ``pickscore``, ``clipscore``, ``aesthetic``,
``image_similarity``, ``imagereward``, ``hpsv2``, ``hpsv2_1``, ``hpsv3``, ``qwenvl``, ``geneval``, ``ocr``,
``video_ocr``) and the clients of served rewards (``remote``, ``flowgrpo_remote``, ``openai_judge``). Model-backed rewards import
transformers (or rapidocr) lazily, on first use, so the import stays cheap. It never imports
:mod:`rlgen_cli.models`.
"""

from rlgen_cli.rewards import brightness as _brightness  # noqa: F401  (registers brightness)
from rlgen_cli.rewards import char_fraction as _char_fraction  # noqa: F401  (registers char_fraction)
from rlgen_cli.rewards import clip as _clip  # noqa: F401  (registers the CLIP rewards)
from rlgen_cli.rewards import geneval as _geneval  # noqa: F401  (registers geneval)
from rlgen_cli.rewards import hpsv2 as _hpsv2  # noqa: F401  (registers hpsv2, hpsv2_1)
from rlgen_cli.rewards import hpsv3 as _hpsv3  # noqa: F401  (registers hpsv3)
from rlgen_cli.rewards import imagereward as _imagereward  # noqa: F401  (registers imagereward)
from rlgen_cli.rewards import jpeg as _jpeg  # noqa: F401  (registers the JPEG rewards)
from rlgen_cli.rewards import ocr as _ocr  # noqa: F401  (registers ocr, video_ocr)
from rlgen_cli.rewards import r1vl as _r1vl  # noqa: F401  (answer_accuracy, step_rar, step_rvr, think_format, length)
from rlgen_cli.rewards import remote as _remote  # noqa: F401  (registers remote, flowgrpo_remote, openai_judge)
from rlgen_cli.rewards import shapes as _shapes  # noqa: F401  (registers shapes_geneval)
from rlgen_cli.rewards import vlm_judge as _vlm_judge  # noqa: F401  (registers qwenvl)
from rlgen_cli.rewards.base import Reward, RewardBatch, RewardResult
from rlgen_cli.rewards.mix import WeightedMix, build_mix
from rlgen_cli.rewards.registry import available, build_reward, register

__all__ = [
    "Reward",
    "RewardBatch",
    "RewardResult",
    "WeightedMix",
    "available",
    "build_mix",
    "build_reward",
    "register",
]
