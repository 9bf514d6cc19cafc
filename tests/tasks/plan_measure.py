"""Measured memory of a real training epoch on the CPU, for ``rlgen plan``'s predicted-against-measured
checks (``test_plan.py``) and the table of docs/plan.md.

*Measured* runs the run itself: ``flow_run.setup`` builds the FlowRun with its weights on the CPU, then
``flow_grpo.sample_rollouts`` rolls out the epoch's samples and ``flow_grpo.update`` trains on them, each
under ``torch.profiler`` with memory profiling. The CPU allocator reports every allocation and free to
the profiler with the bytes it holds (``total_allocated``); the peak of that count over a phase, less its
value at the start, is the phase's peak above what existed before — the CPU's ``max_memory_allocated``.
What existed before is summed from the tensors themselves: every weight and buffer of the pipeline's
modules (and the frozen reference of full fine-tuning), the optimizer's moments, the EMA shadows and the
float64 gradient sums. The update runs once before it is measured, so its moments exist, as in every epoch
after the first.

Two kinds of tensor are left out of the measurement, by the allocations that made them: the decoded
images and an editing set's source images, which a GPU run keeps in host memory, and the prompt caches' entries, which the plan counts at
their cap (a one-epoch run fills them with its few prompts only); the compared plan leaves the caches out.
So are oneDNN's private buffers — what a CPU convolution allocates for itself besides the tensors it
returns (its layout reorders and scratchpad): kernels' workspaces, which a GPU's kernels have too, of
other sizes; the measurement reports by how much they raised the peak (:attr:`Epoch.private`). The
measurement shares no counting code with the planner.

    python tests/tasks/plan_measure.py model=tiny_sd3 algo.timesteps_per_pass=4   # one docs row
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import open_dict
from torch.profiler import ProfilerActivity, profile

from rlgen_cli._hydra import compose_verb
from rlgen_cli.tasks.common import validated

MIB = 2**20
CACHE_ROWS = ("prompt cache", "negative-prompt cache")


@dataclass(frozen=True)
class Epoch:
    """Bytes of one process over an epoch: the state kept throughout, each phase's peak above it."""

    state: int
    rollout: int
    """The rollout's peak above the state."""
    update: int
    """The update's peak above the state: the samples it keeps and one training step."""
    private: int = 0
    """How much higher the larger phase peaked with oneDNN's private buffers counted (CPU kernels'
    layout copies and scratchpad: not tensors; a GPU's kernels keep workspaces of their own)."""

    @property
    def total(self) -> int:
        return self.state + max(self.rollout, self.update)


def typed(args: list[str], run_dir: str) -> tuple[Any, Any]:
    """The validated config ``rlgen plan args`` composes, and the raw one."""
    raw = compose_verb("plan", args)
    with open_dict(raw):
        raw.run_dir = run_dir
    return validated(raw), raw


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """{data pointer: bytes} of the distinct storages behind ``tensors``."""
    out = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _allocations(work: Any) -> tuple[Any, list[Any]]:
    """``work()``'s result and the CPU allocator's allocation events while it ran, in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag.name == "Allocation":
            nodes.append(node)
    return result, sorted(nodes, key=lambda n: n.start_time_ns)


def peak_above_start(events: list[Any], left_out: list[torch.Tensor]) -> tuple[int, int]:
    """The most bytes allocated at once during ``events`` above the count before them, less the
    allocations of ``left_out`` (tensors still alive at the end: each one's last allocation); and the same
    with oneDNN's private buffers left out too (what a oneDNN kernel allocates for itself, not a tensor
    it returns: its layout reorders and scratchpad)."""
    ptrs = set(_storages(left_out))
    last = {e.extra_fields.ptr: i for i, e in enumerate(events) if e.extra_fields.alloc_size > 0}
    skipped = {i for ptr, i in last.items() if ptr in ptrs}
    private: set[int] = set()  # oneDNN's buffers alive
    total = peak = tensors = tensors_peak = 0
    for i, event in enumerate(events):
        size, ptr = event.extra_fields.alloc_size, event.extra_fields.ptr
        if i in skipped:
            continue
        total += size
        peak = max(peak, total)
        if size > 0 and "mkldnn" in getattr(event.parent, "name", ""):
            private.add(ptr)
        elif size < 0 and ptr in private:
            private.discard(ptr)
        else:
            tensors += size
            tensors_peak = max(tensors_peak, tensors)
    return peak, tensors_peak


def _cached(policy: Any) -> list[torch.Tensor]:
    """The tensors of every entry of the policy's prompt caches."""
    from rlgen_cli.models.prompt_cache import PromptCache

    holders = [policy, policy.encode, *(v for v in vars(policy).values() if hasattr(v, "__dict__"))]
    caches = {id(v): v for h in holders for v in vars(h).values() if isinstance(v, PromptCache)}
    return [t for c in caches.values() for cond, _ in c._entries.values() for t in cond.tensors.values()]


def _state(run: Any, copies: list[torch.Tensor] = ()) -> int:
    """Bytes of the weights, optimizer moments, EMA shadows and float64 gradient sums of ``run``, and of
    the recipe's ``copies`` of the trained weights (an old policy, an online DPO reference)."""
    from rlgen_cli.tasks.plan import components_of

    modules = list(components_of(run.policy).values())
    reference = getattr(getattr(run.policy.trainable, "_reference", None), "_frozen", None)
    modules += [reference] if reference is not None else []
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [s for per_param in run.optimizer.state.values() for s in per_param.values() if s.dim() > 0]
    tensors += list(run.ema.shadow) if run.ema is not None else []
    tensors += [run.dist.exact.flat] if run.dist.exact is not None else []
    return sum(_storages([*tensors, *copies]).values())


def _kept(rollouts: Any) -> list[torch.Tensor]:
    """The device tensors a rollout keeps for the update: its trajectory and conditioning."""
    traj = [getattr(rollouts.traj, k) for k in rollouts.traj._PER_SAMPLE]
    return [t for t in (*traj, *rollouts.cond.tensors.values()) if isinstance(t, torch.Tensor)]


def measure(args: list[str]) -> Epoch:
    """One real epoch of ``rlgen train args`` on the CPU: its state, the sampling phase's peak and the
    update's (second update) peak, by the recipe's own functions."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg, raw = typed(args, run_dir)
        return MEASURES[cfg.recipe](cfg, raw)


def _decoded_images(run: Any) -> list[torch.Tensor]:
    """Every image the policy decodes from now on (host memory in a GPU run)."""
    images: list[torch.Tensor] = []
    decode = run.policy.decode
    run.policy.decode = lambda x0: images.append(decode(x0)) or images[-1]
    return images


def _measure_grpo(cfg: Any, raw: Any) -> Epoch:
    """``flow_grpo.sample_rollouts``, then ``flow_grpo.update`` on the epoch's samples."""
    from rlgen_cli.recipes import flow_grpo, flow_run
    from rlgen_cli.training.reporting.progress import Progress

    run = flow_run.setup(cfg, raw)
    images = _decoded_images(run)
    progress = Progress(False)
    rollouts, events = _allocations(lambda: flow_grpo.sample_rollouts(run, 0, progress))
    host = [*images, rollouts.images, *([] if rollouts.sources is None else [rollouts.sources])]
    rollout_all, rollout = peak_above_start(events, [*host, *_cached(run.policy)])
    samples = rollouts.select(torch.arange(len(rollouts.indices)))  # the copy the update trains on
    advantages = torch.linspace(-1, 1, len(rollouts.indices))
    flow_grpo.update(run, samples, advantages, progress)  # the moments exist from the first step on
    _, events = _allocations(lambda: flow_grpo.update(run, samples, advantages, progress))
    kept = sum(_storages(_kept(rollouts) + _kept(samples)).values())
    update_all, update = (kept + peak for peak in peak_above_start(events, []))
    private = max(rollout_all, update_all) - max(rollout, update)
    return Epoch(_state(run), rollout, update, private)


def _measure_forward(cfg: Any, raw: Any) -> Epoch:
    """DiffusionNFT / AWM: ``flow_forward.sample_epoch`` (scored as it runs), then ``flow_forward.update``
    on its samples with weights in [0, 1]."""
    from rlgen_cli.recipes import flow_forward, flow_run
    from rlgen_cli.training.reporting.progress import Progress

    run = flow_run.setup(cfg, raw)
    old = flow_forward.OldPolicy.build(run)
    images = _decoded_images(run)
    progress = Progress(False)
    rollouts, events = _allocations(lambda: flow_forward.sample_epoch(run, old, 0, progress))
    rollout_all, rollout = peak_above_start(events, [*images, rollouts.images, *_cached(run.policy)])
    weights = torch.linspace(0, 1, len(rollouts.indices))
    flow_forward.update(run, old, rollouts, weights, 0, progress)  # the moments exist from the first step on
    _, events = _allocations(lambda: flow_forward.update(run, old, rollouts, weights, 0, progress))
    kept = sum(_storages([rollouts.x0, *rollouts.cond.tensors.values()]).values())
    update_all, update = (kept + peak for peak in peak_above_start(events, []))
    private = max(rollout_all, update_all) - max(rollout, update)
    return Epoch(_state(run, list(old.weights.shadow)), rollout, update, private)


def _measure_pref(cfg: Any, raw: Any) -> Epoch:
    """DPO / SFT: ``flow_pref.pref_epoch``'s sampling (``sample_latents``, DPO under the reference), decode
    and scoring, ``gather_samples``, then ``dpo_update`` / ``sft_update``."""
    from contextlib import nullcontext

    from rlgen_cli.recipes import flow_pref, flow_run
    from rlgen_cli.sde.sampling import batches, sample_latents

    run = flow_run.setup(cfg, raw)
    algo = cfg.algo
    pref_state = flow_pref.Preference.build(run)
    positions = run.sampler.positions(algo.sample_batch_size)
    _, prompts, metadata = flow_run.examples_of(
        run.train_set, run.sampler.indices_for_epoch(0, algo.sample_batch_size)
    )
    dpo = algo.pref.loss == "dpo"

    def sampling() -> tuple[Any, ...]:
        with pref_state.reference(run) if dpo else nullcontext():
            x0 = sample_latents(
                run.policy,
                prompts,
                cfg.model.num_steps,
                algo.sample_batch_size,
                cfg.seed,
                spec=flow_run.step_spec(cfg),
                keys=positions,
            )
        parts = list(batches(len(x0), algo.sample_batch_size))
        images = torch.cat([run.policy.decode(x0[p]) for p in parts])
        return x0, images, [flow_run.score(run, images[p], prompts[p], metadata[p]) for p in parts]

    decoded = _decoded_images(run)
    (x0, images, scores), events = _allocations(sampling)
    rollout_all, rollout = peak_above_start(events, [*decoded, images, *_cached(run.policy)])
    samples, _ = flow_pref.gather_samples(run, 0, torch.tensor(positions), x0, scores)
    update_of = flow_pref.dpo_update if dpo else flow_pref.sft_update
    update_of(run, pref_state, 0, samples)  # the moments exist from the first step on
    _, events = _allocations(lambda: update_of(run, pref_state, 0, samples))
    kept = sum(_storages([x0, samples.x0]).values())
    update_all, update = (kept + peak for peak in peak_above_start(events, []))
    private = max(rollout_all, update_all) - max(rollout, update)
    copies = [] if pref_state.reference_copy is None else list(pref_state.reference_copy.shadow)
    return Epoch(_state(run, copies), rollout, update, private)


def _measure_pretrain(cfg: Any, raw: Any) -> Epoch:
    """Pretraining: an evaluation batch (``sample_latents`` over ``model.eval_num_steps``, decoded), and
    ``flow_pretrain.pretrain_step``."""
    from rlgen_cli.recipes import flow_pretrain, flow_run
    from rlgen_cli.sde.sampling import sample_latents

    run = flow_run.setup(cfg, raw)
    flow_pretrain.require_pretrainable(run)
    batch = cfg.algo.sample_batch_size
    prompts = [example.prompt for example in list(run.test_set)[:batch]]
    decoded = _decoded_images(run)

    def evaluation() -> torch.Tensor:
        x0 = sample_latents(run.policy, prompts, cfg.model.eval_num_steps, batch, cfg.seed)
        return run.policy.decode(x0)

    _, events = _allocations(evaluation)
    rollout_all, rollout = peak_above_start(events, [*decoded, *_cached(run.policy)])
    flow_pretrain.pretrain_step(run, 0, 0)  # the moments exist from the first step on
    _, events = _allocations(lambda: flow_pretrain.pretrain_step(run, 0, 1))
    update_all, update = peak_above_start(events, [])
    private = max(rollout_all, update_all) - max(rollout, update)
    return Epoch(_state(run), rollout, update, private)


MEASURES = {"flow_grpo": _measure_grpo, "flow_forward": _measure_forward, "flow_pref": _measure_pref,
            "flow_pretrain": _measure_pretrain}  # fmt: skip


def predicted(args: list[str]) -> Epoch:
    """The plan of the same config, without its prompt caches (see the module docstring)."""
    from rlgen_cli.tasks.plan import plan_run

    cfg, _ = typed(args, "/tmp/unused")
    report = plan_run(cfg)
    caches = sum(row["bytes"] for row in report["rows"] if row["what"] in CACHE_ROWS)
    peaks = {row["what"].split(" peak")[0]: row["bytes"] for row in report["peaks"]}
    update = peaks["training step"]
    # an evaluation's with EMA (the live weights backed up) is not measured, but pretraining's plain one is
    rollout = peaks.get("rollout", peaks.get("evaluation"))
    return Epoch(report["state_bytes"] - caches, rollout, update)


def compare(args: list[str]) -> dict[str, Any]:
    """Predicted and measured epochs and the total's relative error."""
    p, m = predicted(args), measure(args)
    return {"predicted": p, "measured": m, "error": p.total / m.total - 1}


def docs_row(args: list[str]) -> str:
    """A row of docs/plan.md's table: state, rollout and update peaks, total, predicted | measured."""
    result = compare(args)
    p, m = result["predicted"], result["measured"]
    cells = [
        f"{a / MIB:.2f} \\| {b / MIB:.2f}"
        for a, b in zip(
            (p.state, p.rollout, p.update, p.total), (m.state, m.rollout, m.update, m.total), strict=True
        )
    ]
    private = f"{m.private / MIB:.2f}" if m.private else "0"
    return f"| `{' '.join(args)}` | " + " | ".join(cells) + f" | {100 * result['error']:+.1f} % | {private} |"


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(docs_row(sys.argv[1:]))
