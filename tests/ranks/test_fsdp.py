"""Sharded training (``FSDPPlugin``, torch's FSDP2) under TrainLoop on the ranks of the session pool: the same
result as one process on 2 and 3 ranks, each rank holding its shard; checkpoints resumed on another world size;
clipping, bf16, accumulation; the optimizer on the shards; what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit import DDPPlugin, FSDPPlugin
from ddpkit.testing import run_parallel
from tests.helpers import StopAfter
from tests.support.sharded import (
    Stack,
    fit_fp16_poisoned,
    fit_sharded,
    fit_with_a_nan_filler,
    max_difference,
    sharded_loop,
)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_process() -> dict[str, object]:
    return fit_sharded(2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_training_equals_one_process_and_each_rank_holds_its_shard(
    world_size: int, one_process: dict[str, object]
) -> None:
    results = run_parallel(fit_sharded, 2, world_size=world_size, timeout=180)
    first = results[0]
    assert max_difference(first["weights"], one_process["weights"]) < TOLERANCE
    # DDP on as many ranks: the same sums in the same order (a rank with no batch in the last step runs one that
    # counts nothing where DDP's skips its forward), so the same numbers up to the reduction's order
    ddp = run_parallel(fit_sharded, 2, sharded=False, world_size=world_size, timeout=180)[0]
    assert max_difference(first["weights"], ddp["weights"]) <= (0.0 if world_size == 2 else 1e-6)
    assert first["history"]["train_loss"] == pytest.approx(one_process["history"]["train_loss"], rel=1e-5)
    assert first["history"]["validation_loss"] == pytest.approx(one_process["history"]["validation_loss"], rel=1e-5)
    assert all(r["weights"] == {} for r in results[1:]), "only rank 0 gets the whole weights"
    for name, (local, whole) in first["shards"].items():
        rows = next(iter(one_process["weights"][name].shape))
        assert local == -(-rows // world_size) * whole // rows, f"{name}: rank 0 holds its rows of the weight"
    held = sum(r["memory"]["parameters"] for r in results)
    assert held == sum(w.numel() * 4 for w in one_process["weights"].values()), "the shards add up to the model"
    assert results[0]["memory"]["optimizer"] < 0.6 * one_process["memory"]["optimizer"]
    # its state goes to files only: asked for it in memory, every rank refuses (nothing written in the cwd)
    for rank, result in enumerate(results):  # the state in memory: this rank's shards, put back
        assert result["in_memory"]["name"] is None
        assert result["in_memory"]["mark"] == {"rank": rank, "ranks": world_size}
        assert result["in_memory"]["back"], "the weights and the optimizer state came back"
        assert 0.0 < result["in_memory"]["held"] <= 0.5, "its shards, not the whole weights"
    assert sum(r["in_memory"]["held"] for r in results) == pytest.approx(1.0), "the ranks' shards make the weights"
    assert one_process["in_memory"] == {"name": None, "mark": None, "back": True, "held": 1.0}


def test_a_sharded_checkpoint_of_two_ranks_resumes_mid_epoch_on_three(tmp_path: Path, one_process: dict) -> None:
    # 193 items, 24 a step: 9 steps an epoch (the last of 1 item); step 12 is 72 items into epoch 1.
    stopped = run_parallel(
        fit_sharded, 2, str(tmp_path), [StopAfter(step=14)], checkpoint_every=3, world_size=2, timeout=180
    )
    assert stopped[0]["stopped"] == 14
    assert stopped[0]["files"] == ["last-e1-s12-p72.dcp", "last.pt"], "one whole checkpoint: the last one written"
    resumed = run_parallel(fit_sharded, 2, str(tmp_path), world_size=3, timeout=180)
    assert max_difference(resumed[0]["weights"], one_process["weights"]) < TOLERANCE
    assert resumed[0]["history"]["train_loss"] == pytest.approx(one_process["history"]["train_loss"], rel=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-e2-s18-p0.dcp", "last.pt"]


def test_async_sharded_checkpoints_resume_mid_epoch_on_three(tmp_path: Path, one_process: dict) -> None:
    """checkpoint_async=True with FSDPPlugin: torch's async_save writes the shards while training goes on; the
    directory and last.pt are in place once written, and the run resumes from them as from synchronous ones."""
    stopped = run_parallel(fit_sharded, 2, str(tmp_path), [StopAfter(step=14)], checkpoint_every=3,
                           checkpoint_async=True, world_size=2, timeout=180)  # fmt: skip
    assert stopped[0]["stopped"] == 14
    assert stopped[0]["files"] == ["last-e1-s12-p72.dcp", "last.pt"], "the last one written, whole; no temporary"
    resumed = run_parallel(fit_sharded, 2, str(tmp_path), checkpoint_async=True, world_size=3, timeout=180)
    assert max_difference(resumed[0]["weights"], one_process["weights"]) < TOLERANCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-e2-s18-p0.dcp", "last.pt"]


def test_one_process_reads_a_sharded_checkpoint_and_a_sharded_run_reads_a_whole_one(
    tmp_path: Path, one_process: dict
) -> None:
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    run_parallel(fit_sharded, 1, str(sharded), world_size=2, timeout=180)
    assert max_difference(fit_sharded(2, str(sharded))["weights"], one_process["weights"]) < TOLERANCE
    fit_sharded(1, str(whole), sharded=False)  # DDPPlugin in one process: weights and optimizer in last.pt
    resumed = run_parallel(fit_sharded, 2, str(whole), world_size=2, timeout=180)
    assert max_difference(resumed[0]["weights"], one_process["weights"]) < TOLERANCE


def test_clipping_of_the_shards_global_norm_and_accumulation_equal_one_process() -> None:
    single = fit_sharded(1, gradient_clip_norm=0.5)
    sharded = run_parallel(fit_sharded, 1, gradient_clip_norm=0.5, world_size=2, timeout=180)[0]
    assert sharded["norms"] == pytest.approx(single["norms"], rel=1e-4)
    assert max(single["norms"]) > 0.5, "some steps were clipped"
    assert max_difference(sharded["weights"], single["weights"]) < TOLERANCE
    # Accumulating without a global batch (each reduce-scatter skipped but every 2nd): as DDP's no_sync does.
    sharded = run_parallel(fit_sharded, 1, accumulation=2, global_batch_size=None, world_size=2, timeout=180)[0]
    ddp = run_parallel(fit_sharded, 1, accumulation=2, global_batch_size=None, sharded=False, world_size=2)[0]
    assert max_difference(sharded["weights"], ddp["weights"]) < TOLERANCE
    every_step = run_parallel(fit_sharded, 1, global_batch_size=None, world_size=2, timeout=180)[0]
    assert max_difference(every_step["weights"], ddp["weights"]) > 100 * TOLERANCE, "accumulating changed it"


def test_bf16_trains_sharded_within_its_rounding_of_one_process() -> None:
    """precision="bf16-mixed" shards in bf16 (units gather and compute bf16 weights; float32 shards, optimizer and
    gradient reduction): FSDP2's MixedPrecisionPolicy, unless the plugin was given one."""
    single = fit_sharded(2, precision="bf16-mixed")
    sharded = run_parallel(fit_sharded, 2, precision="bf16-mixed", world_size=2, timeout=180)[0]
    assert sharded["compute_dtypes"] == ["torch.bfloat16"]
    assert sharded["parameter_dtypes"] == ["torch.float32"], "the shards and the optimizer stay float32"
    assert single["compute_dtypes"] == ["torch.float32"], "one process: autocast alone, as DDP"
    loss = sharded["history"]["train_loss"]
    assert loss[1] < loss[0], "it learns"
    in_float32 = fit_sharded(2)
    rounding = max_difference(in_float32["weights"], single["weights"])
    assert max_difference(sharded["weights"], single["weights"]) < 2 * rounding


@pytest.mark.parametrize("sharded", [True, False], ids=["FSDPPlugin", "DDPPlugin"])
def test_activation_checkpointing_computes_the_blocks_again_and_trains_as_without_it(sharded: bool) -> None:
    """Each block's forward runs twice per training batch (its forward and its recomputation in the backward),
    the weights equal a run without it (float rounding at most), the state_dict's names are the model's."""
    plain = run_parallel(fit_sharded, 1, sharded=sharded, world_size=2, timeout=180)[0]
    recomputed = run_parallel(fit_sharded, 1, sharded=sharded, recompute=True, world_size=2, timeout=180)[0]
    assert plain["block_forwards"] > 0
    assert recomputed["block_forwards"] == 2 * plain["block_forwards"]
    assert max_difference(recomputed["weights"], plain["weights"]) <= 1e-6
    assert recomputed["state_dict_keys"] == plain["state_dict_keys"]
    assert not any("checkpoint" in key for key in recomputed["state_dict_keys"])
    alone = fit_sharded(1, sharded=sharded, recompute=True)  # one process: applied there too
    assert alone["block_forwards"] == 2 * fit_sharded(1, sharded=sharded)["block_forwards"]


def test_a_checkpoint_written_with_activation_checkpointing_resumes_without_it(
    tmp_path: Path, one_process: dict
) -> None:
    stopped = run_parallel(fit_sharded, 2, str(tmp_path), [StopAfter(step=14)], checkpoint_every=3, recompute=True,
                           world_size=2, timeout=180)  # fmt: skip
    assert stopped[0]["stopped"] == 14
    resumed = run_parallel(fit_sharded, 2, str(tmp_path), world_size=3, timeout=180)
    assert max_difference(resumed[0]["weights"], one_process["weights"]) < TOLERANCE


def test_an_activation_checkpointing_policy_that_chooses_nothing_or_is_no_policy_is_refused() -> None:
    with pytest.raises(TypeError, match=r"activation_checkpointing_policy=\['blocks'\]: give nn.Module classes"):
        FSDPPlugin(activation_checkpointing_policy=["blocks"])  # type: ignore[list-item]
    loop = sharded_loop(sharded=False)
    loop.plugin = DDPPlugin(activation_checkpointing_policy={nn.Conv2d})
    with pytest.raises(ValueError, match=r"chose no submodule of Stack: name the classes of its blocks"):
        loop.fit(1)


def test_a_nan_loss_filler_adds_zero_gradients_and_changes_no_buffer() -> None:
    """The last step of each epoch holds 1 item: rank 1 runs the split's first batch as one that counts nothing,
    its loss nan with derivatives that are not finite (nan gradients from ``loss * 0``). Every weight stays finite and
    equal to the run whose filler's loss is finite, and to one process's; rank 1's buffers (a running mean, as
    BatchNorm's) are the same after that step as before it (rank 0's, which trained the item, changed)."""
    nan = run_parallel(fit_with_a_nan_filler, world_size=2, timeout=180)
    finite = run_parallel(fit_with_a_nan_filler, False, world_size=2, timeout=180)[0]
    alone = fit_with_a_nan_filler()
    assert alone["finite"], "one process runs no filler"
    assert all(r["finite"] for r in nan)
    assert all(torch.equal(nan[0]["weights"][k], finite["weights"][k]) for k in finite["weights"])
    parameters = [name for name in alone["weights"] if name not in ("seen", "running")]  # buffers: each rank's own
    assert max_difference(*({n: w[n] for n in parameters} for w in (nan[0]["weights"], alone["weights"]))) < TOLERANCE
    for last in (8, 17):  # steps 9 and 18: each epoch's last
        before, after = nan[1]["buffers"][last - 1], nan[1]["buffers"][last]
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), "the filler changed no buffer"
        before, after = nan[0]["buffers"][last - 1], nan[0]["buffers"][last]
        assert not all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), "a real batch does"


def _optimizer_on_shards() -> dict[str, object]:
    model = Stack()
    optimizer = torch.optim.SGD(
        [{"params": model.embed.parameters(), "lr": 0.5}, {"params": model.head.parameters()},
         {"params": model.blocks.parameters(), "momentum": 0.9}], lr=0.1,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loop = sharded_loop(model=model, optimizer=optimizer, lr_scheduler=scheduler)
    loop.fit(1)
    return {
        "same_object": loop.optimizer is optimizer,
        "on_shards": [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in _order(model)],
        "dtensors": all(type(p).__name__ == "DTensor" for group in optimizer.param_groups for p in group["params"]),
        "groups": [(len(g["params"]), g["lr"], g["momentum"]) for g in optimizer.param_groups],
        "states": sum(1 for state in optimizer.state.values() if state.get("momentum_buffer") is not None),
    }


def _order(model: Stack) -> list[nn.Parameter]:
    return [*model.embed.parameters(), *model.head.parameters(), *model.blocks.parameters()]


def test_the_optimizer_given_trains_the_shards_with_its_groups_and_scheduler() -> None:
    result = run_parallel(_optimizer_on_shards, world_size=2, timeout=120)[0]
    assert result["same_object"], "the loop's optimizer is the one given"
    assert result["on_shards"], "its groups hold the model's sharded parameters, in their order"
    assert result["dtensors"]
    assert result["groups"] == [(2, 0.25, 0), (2, 0.05, 0), (24, 0.05, 0.9)], "each group's settings, halved once"
    assert result["states"] == 24, "momentum buffers for the shards of the group with momentum"


def _refused(case: str) -> str:
    model = Stack()
    try:
        if case == "stepped":
            optimizer = torch.optim.Adam(model.parameters())
            model(torch.zeros(1, 8, 8)).sum().backward()
            optimizer.step()
            sharded_loop(model=model, optimizer=optimizer).fit(1)
        elif case == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam)
            sharded_loop(model=model, optimizer=zero).fit(1)  # type: ignore[arg-type]
        else:
            model.head.to("meta")
            FSDPPlugin().configure_ddp(model, None)
    except ValueError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.parametrize(
    ("case", "words"),
    [("stepped", "already holds state"), ("zero", "not a ZeroRedundancyOptimizer"), ("devices", "model.to(device)")],
)
def test_what_fsdp_cannot_do_is_refused_on_every_rank_with_the_way_out(case: str, words: str) -> None:
    messages = run_parallel(_refused, case, world_size=2, timeout=60)
    assert all(words in message for message in messages), messages


def test_fp16_sharded_skips_a_step_with_an_inf_in_one_ranks_shard_on_every_rank() -> None:
    """precision="16-mixed" with FSDPPlugin: torch's ShardedGradScaler. Step 3's one inf gradient element lies in
    rank 0's shard alone; every rank skips that step (their found-inf agreed by an all-reduce), as one process does,
    and the weights stay finite and within fp16's rounding of one process's."""
    alone = fit_fp16_poisoned()
    ranks = run_parallel(fit_fp16_poisoned, world_size=2, timeout=180)
    assert [r["scaler"] for r in ranks] == ["ShardedGradScaler"] * 2
    assert alone["scaler"] == "GradScaler"
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == alone["skipped"]
    assert alone["skipped"][0] >= 1, "the poisoned step was skipped"
    assert all(r["finite"] for r in ranks)
    clean = fit_sharded(2)  # float32, no poison: fp16's rounding is the scale of what may differ
    assert max_difference(ranks[0]["weights"], alone["weights"]) < 2 * max_difference(
        clean["weights"], alone["weights"]
    )


def _positions() -> list[str | None]:
    from ddpkit.hangs._state import model_position

    model = Stack(depth=2)
    FSDPPlugin().configure_ddp(model, None)
    seen: list[str | None] = []
    for block in model.blocks:  # inside each block's forward and backward: where the watchdog says it is
        block.mlp.register_forward_hook(lambda *_: seen.append(model_position()))
        block.mlp.register_full_backward_hook(lambda *_: seen.append(model_position()))
    model(torch.randn(2, 8, 8)).sum().backward()
    return [*seen, model_position()]


def test_each_units_forward_and_backward_are_marked_for_hang_reports() -> None:
    seen = run_parallel(_positions, world_size=2, timeout=60)[0]
    assert seen == [
        "FSDP unit 'blocks.0' (forward)", "FSDP unit 'blocks.1' (forward)",
        "FSDP unit 'blocks.1' (backward)", "FSDP unit 'blocks.0' (backward)", "FSDP unit 'blocks.0' (backward)",
    ]  # fmt: skip


def _hybrid(epochs: int) -> dict[str, object]:
    return fit_sharded(epochs, hsdp=2, global_batch_size=32)  # 4 ranks as 2 "nodes" of 2


def test_hsdp_shards_inside_each_node_and_replicates_across_nodes() -> None:
    results = run_parallel(_hybrid, 2, world_size=4, timeout=240)
    assert results[0]["mesh"] == ((2, 2), ("replicate", "shard"))
    assert max_difference(results[0]["weights"], fit_sharded(2, global_batch_size=32)["weights"]) < TOLERANCE
    for result in results:  # each rank holds half of each weight: its node's two ranks share it
        local, whole = result["shards"]["embed.weight"]
        assert local * 2 == whole


def test_a_compiled_sharded_model_trains_as_one_process() -> None:
    single = fit_sharded(1)
    compiled = run_parallel(fit_sharded, 1, compile={"backend": "aot_eager"}, world_size=2, timeout=300)[0]
    assert max_difference(compiled["weights"], single["weights"]) < TOLERANCE
    assert compiled["run_hooks"] == 0, "the fit left its forward counter on the model"


def _shards_while_a_unit_computes() -> dict[str, bool]:
    """A rank's state in memory (what torchft reads in another thread while the model computes) taken inside a
    unit's forward, where FSDP has put the unit's whole weights in its modules, against the same taken between
    steps: whether it is the same shards, and whether the modules held whole weights then (else the test proves
    nothing)."""
    plugin, model = FSDPPlugin(), Stack()
    plugin.configure_ddp(model, None)
    optimizer = plugin.shard_optimizer(torch.optim.Adam(model.parameters()))
    between, _, _ = plugin.checkpoint_state(model, optimizer, None, "between")
    inside: dict[str, object] = {}

    def take(module: nn.Module, args: object) -> None:
        inside["state"] = plugin.checkpoint_state(model, optimizer, None, "inside")[0]
        inside["whole"] = type(module.weight).__name__ != "DTensor"

    hook = model.blocks[1].mlp[0].register_forward_pre_hook(take)  # inside the unit blocks[1], as it computes
    model(torch.zeros(2, 8, 8)).sum().backward()
    hook.remove()
    state = inside["state"]
    assert isinstance(state, dict)
    same = all(torch.equal(state[name], value) for name, value in between.items() if name != "@local_shards")
    return {"same": same and state.keys() == between.keys(), "whole": bool(inside["whole"])}


def test_a_ranks_state_in_memory_is_its_shards_even_while_a_unit_computes() -> None:
    """torchft reads a healthy replica group's state in another thread while the group's forward runs: the state
    comes from the sharded parameters, not from the modules, which hold a computing unit's whole weights."""
    results = run_parallel(_shards_while_a_unit_computes, world_size=2, timeout=60)
    assert all(r["whole"] for r in results), "FSDP put the unit's whole weights in its modules (else nothing tested)"
    assert all(r["same"] for r in results), results
