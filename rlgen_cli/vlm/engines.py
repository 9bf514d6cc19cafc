"""Rollout engines: what samples the completions of a VLM rollout (``algo.token.engine``).

* :class:`HFEngine` (``hf``, default) — transformers ``generate`` on the training model itself: exactly the
  :func:`~rlgen_cli.vlm.rollout.encode_prompts` → :func:`~rlgen_cli.vlm.rollout.check_context` →
  :func:`~rlgen_cli.vlm.rollout.generate` path (KV cache, explicit sampling options, vision tokens
  suppressed, stop at ``<|im_end|>`` / ``<|endoftext|>``). Nothing to sync: it *is* the trained model.
* :class:`VLLMEngine` (``vllm``) — a ``vllm.LLM`` colocated in the trainer process on the same GPU, as
  TRL's ``GRPOTrainer`` with ``vllm_mode="colocate"`` (``distributed_executor_backend="external_launcher"``,
  a share ``gpu_memory_utilization`` of the GPU). Prompts go in as the chat-templated text with the image
  (``{"prompt": ..., "multi_modal_data": {"image": pil}}``; vLLM's own Qwen-VL processor expands the image
  tokens with the same ``min_pixels`` / ``max_pixels``); the ``group_size`` consecutive copies of a
  prompt become one request with ``SamplingParams(n=group)``. The training weights are pushed into the
  vLLM model (``model.load_weights``, then ``reset_prefix_cache``) before the first rollout and before
  every rollout that follows an optimizer step (:meth:`RolloutEngine.weights_updated`): all parameters,
  LoRA merged *out of place* (base + B·A·scale per layer, so the training model and its LoRA-disabled
  reference are never modified — ``merge_adapter`` / ``unmerge_adapter`` would round the base weights).

**π_old never comes from vLLM.** The recipe recomputes the old log-probs with the training model at
temperature 1 on the training layout (``algo.token.old_logprobs=recompute``, required with ``vllm``), so
the importance ratio of the first inner iteration is exactly 1 whatever the engine's numerics (bf16
kernels, paged attention, its sampler). The engine's own per-token log-probs of the sampled tokens are
what ``rlgen check-onpolicy`` holds the training forward against (``vlm/onpolicy.py``) and what the
``sampler/logp_gap_max`` diagnostic tracks. Their vocabulary differs per engine
(:attr:`RolloutEngine.masks_suppressed`): ``hf`` leaves the vision tokens out of the softmax as training
does; vLLM's raw log-probs (``logprobs_mode="raw_logprobs"``: before its logit bias, temperature and
top-k / top-p) normalise over the whole vocabulary.
"""

from __future__ import annotations

import abc
import logging
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.vlm.policy import VLMPolicy, export_merged
from rlgen_cli.vlm.rollout import Completions, SamplingOptions, check_context, encode_prompts, generate

log = logging.getLogger(__name__)

__all__ = [
    "HFEngine",
    "RolloutEngine",
    "VLLMEngine",
    "build_engine",
    "group_runs",
    "merged_named_weights",
]

SUPPRESS_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]: e^-100 ≈ never sampled


class RolloutEngine(abc.ABC):
    """Samples one completion per row of ``prompts``; told when the training weights changed."""

    name = "base"
    masks_suppressed = True
    """Whether the recorded log-probs leave the suppressed (vision) tokens out of the softmax, as the
    training path does; False = normalised over the whole vocabulary."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[str],
        images: Sequence[Image.Image | None],
        options: SamplingOptions,
        seed: int,
        labels: Sequence[Any],
    ) -> Completions:
        """Completions of the chat-templated ``prompts`` (one per row, rows in order).

        Args:
            prompts: Chat-templated prompt strings; identical consecutive rows are one group.
            images: One image (or None) per row.
            options: Decoding options.
            seed: Seed of this call's sampling.
            labels: Per row, how the context-check error names the sample.

        Raises:
            UserError: When a prompt + image tokens + completion budget exceeds the context.
        """

    def weights_updated(self) -> None:  # noqa: B027  (a no-op unless the engine holds its own weights)
        """Called after every optimizer step of the training model."""

    def close(self) -> None:  # noqa: B027  (nothing to release by default)
        """Release what the engine holds."""


class HFEngine(RolloutEngine):
    """transformers ``generate`` on the training model (today's rollout, unchanged)."""

    name = "hf"

    def __init__(self, policy: VLMPolicy) -> None:
        self.policy = policy

    def generate(
        self,
        prompts: Sequence[str],
        images: Sequence[Image.Image | None],
        options: SamplingOptions,
        seed: int,
        labels: Sequence[Any],
    ) -> Completions:
        encoded = encode_prompts(self.policy, prompts, images)
        check_context(self.policy, encoded, options.max_new_tokens, labels)
        return generate(self.policy, encoded, options, seed=seed)


def merged_named_weights(policy: VLMPolicy) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the policy as a plain Hugging Face model, names as vLLM's ``load_weights`` takes.

    Full fine-tuning: every parameter as is. LoRA: peft's ``base_model.model.`` prefix and ``.base_layer``
    dropped, ``lora_*`` tensors skipped, and each adapted weight sent as ``base + ΔW`` computed out of place
    (peft's ``get_delta_weight``, cast to the base dtype as ``merge_and_unload`` does) — equal to the
    merged model of :func:`~rlgen_cli.vlm.policy.export_merged`, with the training model left untouched.
    """
    model = policy.model
    if not policy.is_lora:
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    prefix = getattr(model, "prefix", "lora_")
    for name, param in model.named_parameters():
        if prefix in name or "original_module" in name:
            continue
        tensor = param.detach()
        if ".base_layer." in name:
            module = model.get_submodule(name.split(".base_layer.")[0])
            if isinstance(module, LoraLayer) and name.endswith(".base_layer.weight"):
                if module.merged:
                    raise RuntimeError(f"{name}: the adapter is merged in place; weights would be doubled")
                with torch.no_grad():
                    delta = sum(
                        module.get_delta_weight(adapter)
                        for adapter in module.active_adapters
                        if adapter in module.lora_A
                    )
                    tensor = (tensor + delta).to(tensor.dtype)
        clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield clean.replace("modules_to_save.default.", ""), tensor


def group_runs(prompts: Sequence[str], images: Sequence[Image.Image | None]) -> list[tuple[int, int]]:
    """``(start, count)`` runs of consecutive rows with the same prompt and the same image (pixels)."""

    def same(i: int, j: int) -> bool:
        a, b = images[i], images[j]
        if prompts[i] != prompts[j] or (a is None) != (b is None):
            return False
        return a is b or a is None or (a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes())

    runs: list[tuple[int, int]] = []
    for i in range(len(prompts)):
        if runs and same(runs[-1][0], i):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VLLMEngine(RolloutEngine):
    """A colocated ``vllm.LLM`` (TRL's colocate mode) sampling from the synced training weights.

    Args:
        policy: The training policy (its processor counts the context; its weights are pushed to vLLM).
        gpu_memory_utilization: Fraction of the GPU vLLM may take (weights + KV cache); the training
            model, its gradients and the optimizer need the rest.
        seed: vLLM's engine seed (each request also gets its own seed from :meth:`generate`'s ``seed``).
        llm: An already-built ``vllm.LLM`` (tests); default: built from the policy's weights.
    """

    name = "vllm"
    masks_suppressed = False  # raw log-probs: the −100 logit bias on vision tokens comes after them

    def __init__(self, policy: VLMPolicy, gpu_memory_utilization: float, seed: int, llm: Any = None) -> None:
        self.policy = policy
        self.stale = True  # the first rollout pushes the current (possibly resumed) weights
        self.syncs = 0
        self._tmp_dir: str | None = None
        self.llm = llm if llm is not None else self._build(gpu_memory_utilization, seed)

    def _build(self, gpu_memory_utilization: float, seed: int) -> Any:
        policy, cfg = self.policy, self.policy.cfg
        if policy.device.type != "cuda":
            raise UserError(
                f"algo.token.engine=vllm needs a CUDA device, the run is on {policy.device} "
                "(set device=cuda, or use algo.token.engine=hf)"
            )
        try:
            from vllm import LLM
        except ImportError as err:
            raise UserError(
                f"algo.token.engine=vllm but vllm cannot be imported ({err}); pip install vllm, or use "
                "algo.token.engine=hf"
            ) from err
        source, revision = cfg.path, cfg.revision
        if cfg.tiny or not source:  # built in-process: vLLM loads a merged copy written to a temp dir
            self._tmp_dir = tempfile.mkdtemp(prefix="rlgen_vllm_")
            source, revision = str(export_merged(policy, self._tmp_dir)), None
        # One in-process worker on this GPU, as TRL's colocate mode; vLLM reads the torch.distributed env.
        for key, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        start = time.perf_counter()
        llm = LLM(
            model=source,
            revision=revision,
            dtype=cfg.dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=min(cfg.vlm.max_context, policy.max_positions),
            limit_mm_per_prompt={"image": 1},
            mm_processor_kwargs={"min_pixels": cfg.vlm.min_pixels, "max_pixels": cfg.vlm.max_pixels},
            distributed_executor_backend="external_launcher",
            logprobs_mode="raw_logprobs",
        )
        log.info(
            "vLLM engine on %s (%.1fs, gpu_memory_utilization %.2f)",
            source,
            time.perf_counter() - start,
            gpu_memory_utilization,
        )
        return llm

    def vllm_model(self) -> Any:
        """The ``nn.Module`` inside the in-process vLLM worker (TRL's colocate path)."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        except AttributeError as err:
            raise RuntimeError(
                "cannot reach the vLLM model (llm.llm_engine.model_executor.driver_worker.model_runner.model); "
                "this vLLM version runs the engine out of process — use one TRL's colocate mode supports"
            ) from err

    def sync_weights(self) -> None:
        """Push the training weights (LoRA merged out of place) into vLLM and drop its prefix cache."""
        start = time.perf_counter()
        self.vllm_model().load_weights(merged_named_weights(self.policy))
        self.llm.reset_prefix_cache()
        self.stale, self.syncs = False, self.syncs + 1
        log.debug("synced weights into vLLM in %.2fs", time.perf_counter() - start)

    def weights_updated(self) -> None:
        self.stale = True  # pushed once before the next rollout, however many steps were taken

    def sampling_params(self, options: SamplingOptions, n: int, seed: int) -> Any:
        """Every option explicit, as the HF path: top-k 0 → -1 (off), temperature 0 → greedy."""
        from vllm import SamplingParams

        sample = options.temperature > 0
        return SamplingParams(
            n=n,
            temperature=options.temperature if sample else 0.0,
            top_p=options.top_p if sample else 1.0,
            top_k=options.top_k if sample and options.top_k > 0 else -1,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=options.max_new_tokens,
            seed=seed,
            stop_token_ids=list(self.policy.stop_ids),
            logprobs=0,
            logit_bias={i: SUPPRESS_BIAS for i in self.policy.suppressed_ids} or None,
            detokenize=False,
        )

    def generate(
        self,
        prompts: Sequence[str],
        images: Sequence[Image.Image | None],
        options: SamplingOptions,
        seed: int,
        labels: Sequence[Any],
    ) -> Completions:
        encoded = encode_prompts(self.policy, prompts, images, device=torch.device("cpu"))
        check_context(self.policy, encoded, options.max_new_tokens, labels)
        if self.stale:
            self.sync_weights()
        runs = group_runs(prompts, images)
        rng = random.Random(seed)
        requests, params = [], []
        for start, count in runs:
            request: dict[str, Any] = {"prompt": prompts[start]}
            if images[start] is not None:
                request["multi_modal_data"] = {"image": images[start]}
            requests.append(request)
            params.append(self.sampling_params(options, count, rng.randrange(2**31)))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return self._completions(outputs, runs)

    def _completions(self, outputs: Sequence[Any], runs: list[tuple[int, int]]) -> Completions:
        stops, suppressed = set(self.policy.stop_ids), set(self.policy.suppressed_ids)
        ids, truncated, logprobs = [], [], []
        for output, (start, count) in zip(outputs, runs, strict=True):
            if len(output.outputs) != count:
                raise RuntimeError(
                    f"vLLM returned {len(output.outputs)} completions for row {start}, not {count}"
                )
            for done in output.outputs:
                tokens = [int(t) for t in done.token_ids]
                cut = not tokens or tokens[-1] not in stops
                if cut and done.finish_reason == "stop":
                    raise RuntimeError(
                        f"vLLM stopped row {start} (stop_reason {done.stop_reason!r}) without returning a stop "
                        "token; the training layout needs it"
                    )
                if suppressed.intersection(tokens):
                    raise RuntimeError(f"vLLM sampled a vision token for row {start} despite the logit bias")
                values = [
                    float(step[t].logprob) for step, t in zip(done.logprobs or [], tokens, strict=False)
                ]
                ids.append(torch.tensor(tokens, dtype=torch.long))
                truncated.append(cut)
                logprobs.append(
                    torch.tensor(values if len(values) == len(tokens) else [float("nan")] * len(tokens))
                )
        return Completions(ids=ids, truncated=truncated, logprobs=logprobs)

    def close(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None


def build_engine(policy: VLMPolicy, token: Any, seed: int) -> RolloutEngine:
    """The engine ``algo.token.engine`` names (``token``: the validated ``algo.token`` section, which already
    refused ``vllm`` when it is not installed or with ``old_logprobs=sampler``)."""
    if token.engine == "hf":
        return HFEngine(policy)
    return VLLMEngine(policy, token.vllm_gpu_memory_utilization, seed)
