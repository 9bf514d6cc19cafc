"""ImageReward against the ``image-reward`` package: same random weights, same images and prompts, same score.

The reference side is the package's own code: ``ImageReward.ImageReward`` (its ``__init__``, its
``_transform(224)`` and its ``score(prompt, pil_image)``) on ``BLIP_Pretrain`` with the package's ViT
(``vit.py``) and BERT with cross-attention (``med.py``). Shrunk: ``create_vit`` builds the package's
``VisionTransformer`` 2 blocks deep at width 64 (``BLIP_Pretrain`` asks for ViT-L), ``med_config`` is one
BERT layer (width 768, which ``ImageReward`` hard-codes for its head), and ``init_tokenizer`` reads a small
uncased WordPiece vocabulary instead of downloading ``bert-base-uncased``. ``med.py`` imports three helpers
from ``transformers.modeling_utils`` that transformers 5 moved to ``transformers.pytorch_utils`` (or, for
``find_pruneable_heads_and_indices``, dropped; only head pruning uses it): the import is pointed at them;
``init_tokenizer`` reads transformers 4's ``additional_special_tokens_ids``, which the local tokenizer supplies,
and the BERT calls transformers 4 helpers (``init_weights`` without ``post_init``, ``invert_attention_mask``,
``get_head_mask``) given back here as 4.x defined them.
"""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.rewards import RewardBatch, build_reward
from tests.rewards.reference import ODD_SIZES, SAMPLE_PROMPTS, import_past_inits

PACKAGES = ["ImageReward", "ImageReward.models"]  # their __init__ import ReFL's training stack and CLIP
VISION_WIDTH, VISION_DEPTH, VISION_HEADS = 64, 2, 2
TEXT_WIDTH, TEXT_HEADS = 768, 12  # ImageReward's MLP(768)
REL_TOL = 1e-5
WORDS = ["a", "photo", "of", "cat", "sitting", "on", "red", "chair", "salt", "pepper", "white", "plate", "field",
         "flowers", "full", "width", "letters", "don", "panic", "it", "fine", "spaced", "out", "prompt"]  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _removed_helper(*args, **kwargs):
    raise NotImplementedError("find_pruneable_heads_and_indices: head pruning is not part of scoring")


def _init_weights_without_post_init(self) -> None:
    """med.py's BertModel calls ``init_weights()`` alone, as transformers 4 allowed; 5 needs the tied-weight
    map ``post_init()`` builds first."""
    from transformers import PreTrainedModel

    self.all_tied_weights_keys = self.get_expanded_tied_weights_keys(all_submodels=False)
    PreTrainedModel.init_weights(self)


def _invert_attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
    """transformers 4's ``ModuleUtilsMixin.invert_attention_mask`` (gone in 5), which med.py calls."""
    extended = mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


def _get_head_mask(self, head_mask, num_hidden_layers: int, is_attention_chunked: bool = False) -> list:
    """transformers 4's ``get_head_mask`` (gone in 5) for the only case scoring uses: no head mask."""
    if head_mask is not None:
        raise NotImplementedError("head masks are not part of ImageReward's scoring")
    return [None] * num_hidden_layers


def _spread_weights(model: torch.nn.Module) -> None:
    """Random weights at unit gain (std 1/√fan-in; norms and biases jittered): with the packages' small inits
    (std 0.02 towers, 1/769 head) the image barely reaches the score, and a preprocessing difference hides."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, param[0].numel() ** -0.5)
            else:
                param.add_(torch.randn_like(param) * 0.1)


def _import_reference(monkeypatch: pytest.MonkeyPatch):
    """``ImageReward.ImageReward`` with its imports resolved (see the module docstring)."""
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    for name in ("apply_chunking_to_forward", "prune_linear_layer"):
        if not hasattr(modeling_utils, name):
            monkeypatch.setattr(modeling_utils, name, getattr(pytorch_utils, name), raising=False)
    if not hasattr(modeling_utils, "find_pruneable_heads_and_indices"):
        monkeypatch.setattr(
            modeling_utils, "find_pruneable_heads_and_indices", _removed_helper, raising=False
        )
    return import_past_inits("ImageReward.ImageReward", PACKAGES)


def _write_vocab(folder) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *LETTERS, *(f"##{c}" for c in LETTERS)]
    vocab += list("'’&;-–“”.,!?")
    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(reference ImageReward on shrunk BLIP, rlgen reward on its saved state dict)."""
    from transformers import BertTokenizer, BlipConfig

    root = tmp_path_factory.mktemp("imagereward_reference")
    _write_vocab(root / "bert")
    with pytest.MonkeyPatch.context() as monkeypatch:
        module = _import_reference(monkeypatch)
    blip, blip_pretrain, vit, med_module = (
        importlib.import_module(f"ImageReward.models.BLIP.{name}")
        for name in ("blip", "blip_pretrain", "vit", "med")
    )

    class LocalBertTokenizer(BertTokenizer):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):  # init_tokenizer asks for bert-base-uncased
            return cls(str(root / "bert" / "vocab.txt"), do_lower_case=True)

        @property
        def additional_special_tokens_ids(self) -> list[int]:  # transformers 4's name, read by init_tokenizer
            return self.convert_tokens_to_ids(list(self.extra_special_tokens))

    def shrunk_create_vit(vit_name, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
        encoder = vit.VisionTransformer(
            img_size=image_size,
            patch_size=16,
            embed_dim=VISION_WIDTH,
            depth=VISION_DEPTH,
            num_heads=VISION_HEADS,
            use_grad_checkpointing=use_grad_checkpointing,
            ckpt_layer=ckpt_layer,
        )
        return encoder, VISION_WIDTH

    vocab_size = len(LocalBertTokenizer.from_pretrained("bert-base-uncased")) + 2  # + [DEC], [ENC]
    med = dict(architectures=["BertModel"], attention_probs_dropout_prob=0.1, hidden_act="gelu",
               hidden_dropout_prob=0.1, hidden_size=TEXT_WIDTH, initializer_range=0.02, intermediate_size=64,
               layer_norm_eps=1e-12, max_position_embeddings=64, model_type="bert", num_attention_heads=TEXT_HEADS,
               num_hidden_layers=1, pad_token_id=0, type_vocab_size=2, vocab_size=vocab_size,
               encoder_width=VISION_WIDTH, add_cross_attention=True)  # fmt: skip
    (root / "med_config.json").write_text(json.dumps(med), encoding="utf-8")
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(blip, "BertTokenizer", LocalBertTokenizer)
        monkeypatch.setattr(blip_pretrain, "create_vit", shrunk_create_vit)
        monkeypatch.setattr(med_module.BertModel, "init_weights", _init_weights_without_post_init)
        model = module.ImageReward(med_config=str(root / "med_config.json"), device="cpu").eval()
    for name, method in (
        ("invert_attention_mask", _invert_attention_mask),
        ("get_head_mask", _get_head_mask),
    ):
        if not hasattr(med_module.BertModel, name):  # only these tests use the package's BertModel
            setattr(med_module.BertModel, name, method)
    _spread_weights(model)
    torch.save(model.state_dict(), root / "ImageReward.pt")
    model.blip.tokenizer.save_pretrained(root / "tokenizer")
    config = BlipConfig(
        vision_config=dict(
            hidden_size=VISION_WIDTH,
            intermediate_size=4 * VISION_WIDTH,
            num_hidden_layers=VISION_DEPTH,
            num_attention_heads=VISION_HEADS,
            image_size=224,
            patch_size=16,
            hidden_act="gelu",
            layer_norm_eps=1e-6,
        ),
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=TEXT_HEADS,
            max_position_embeddings=64,
            encoder_hidden_size=VISION_WIDTH,
            hidden_act="gelu",
            layer_norm_eps=1e-12,
            is_decoder=True,
            pad_token_id=0,
        ),
    )
    config.save_pretrained(root / "config")
    reward = build_reward(
        "imagereward",
        model_path=str(root / "ImageReward.pt"),
        config_path=str(root / "config"),
        tokenizer_path=str(root / "tokenizer"),
        device="cpu",
        local_files_only=True,
    )
    return SimpleNamespace(model=model, reward=reward)


def _cases(count: int | None = None):
    """Every sample prompt on a cycle of odd sizes; ``count`` keeps the first few (300×524 first)."""
    rng = np.random.default_rng(3)
    prompts = list(SAMPLE_PROMPTS[1:] + SAMPLE_PROMPTS[:1])[:count]
    sizes = [ODD_SIZES[(i + 1) % len(ODD_SIZES)] for i in range(len(prompts))]
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes], prompts


def _assert_matches_reference(ref, arrays, prompts) -> None:
    with torch.no_grad():
        expected = torch.tensor([ref.model.score(p, Image.fromarray(a)) for a, p in zip(arrays, prompts)])
    got = torch.cat(
        [
            ref.reward.score(
                RewardBatch(prompts=[p], images=torch.from_numpy(a).permute(2, 0, 1)[None].float() / 255)
            ).scores
            for a, p in zip(arrays, prompts)
        ]
    )
    torch.testing.assert_close(
        got, expected.float(), rtol=REL_TOL, atol=REL_TOL * float(expected.abs().max())
    )


def test_scores_equal_the_reference_package(reference):
    _assert_matches_reference(reference, *_cases(count=2))  # "don’t" at 300×524, "&amp;" at 517×333


@pytest.mark.slow
def test_every_sample_prompt_and_size_equals_the_reference_package(reference):
    _assert_matches_reference(reference, *_cases())
