"""A transformers GPT-2 as its users write it (dict batches, no step overridden) on several ranks, with DDP and
FSDP: the weights of one process, the language-model metrics of one process, the model's own blocks as FSDP units,
and a sharded checkpoint exported to the weights the loop gathers.

Here, the tests that run on the ranks of the session pool; tests/unit/test_default_steps.py has the default steps
in one process, tests/e2e/test_hf_models.py the example under ``ddpkit run``.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.testing import run_parallel

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

LENGTH, VOCAB = 16, 64


def _gpt2(dropout: float = 0.0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _items(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=generator)
    strides = torch.randint(1, 4, (n, 1), generator=generator)
    sequences = (starts + strides * torch.arange(LENGTH)) % VOCAB  # a pattern to learn: each token from the last two
    items = []
    for sequence in sequences:
        labels = sequence.clone()
        labels[:3] = -100  # a prompt that counts in no loss
        items.append({"input_ids": sequence, "attention_mask": torch.ones(LENGTH, dtype=torch.int64), "labels": labels})
    return items


def _loop(plugin: str, directory: str | None = None, validation: int = 13) -> ddpkit.TrainLoop:
    model = _gpt2()
    return ddpkit.TrainLoop(
        model,
        DataLoader(_items(48), batch_size=24 // ddpkit.get_world_size(), shuffle=True),
        DataLoader(_items(validation, seed=1), batch_size=2),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6),
        plugin=ddpkit.FSDPPlugin() if plugin == "fsdp" else ddpkit.DDPPlugin(),
        global_batch_size=24,
        checkpoint_dir=directory,
        progress=False,
    )


def _train(plugin: str) -> tuple[dict[str, torch.Tensor], dict[str, list[float]], str]:
    """4 epochs of 2 steps; the whole weights (rank 0's), the history and what rank 0 printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loop = _loop(plugin)
        history = loop.fit(4)
        weights = loop.full_state_dict() if plugin == "fsdp" else loop.model.state_dict()
    return {k: v.detach().clone() for k, v in weights.items()}, history, printed.getvalue()


def _difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_a_gpt2_with_dict_batches_and_no_override_trains_on_two_ranks_as_one_process(plugin: str) -> None:
    two = run_parallel(_train, plugin, world_size=2, timeout=120)[0]
    one = _train("ddp")
    assert _difference(two[0], one[0]) < 1e-5
    assert _difference(one[0], _gpt2().state_dict()) > 1e-2, "it trained"
    for name in ("validation_loss", "validation_perplexity", "validation_token_accuracy"):
        assert two[1][name] == pytest.approx(one[1][name], rel=1e-5), name
    assert one[1]["validation_loss"][-1] < one[1]["validation_loss"][0], "the model learned"
    if plugin == "fsdp":
        assert "FSDPPlugin: 2 units of their own (GPT2Block: transformer.h.0, transformer.h.1; from the model's " \
               "_no_split_modules)" in two[2]  # fmt: skip


def _evaluate(plugin: str) -> dict[str, float]:
    loop = _loop(plugin, validation=13)
    with contextlib.redirect_stdout(io.StringIO()):
        return loop.evaluate(loop.validation_loader)


def test_language_model_metrics_on_three_ranks_of_an_uneven_split_equal_one_processs() -> None:
    """13 sequences over 3 ranks in batches of 2: shards of 5, 4, 4; a sharded model's ranks run as many forwards."""
    one = _evaluate("ddp")
    for plugin in ("ddp", "fsdp"):
        three = run_parallel(_evaluate, plugin, world_size=3, timeout=120)
        assert all(result == three[0] for result in three), "every rank has the same numbers"
        assert three[0]["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert three[0]["perplexity"] == pytest.approx(one["perplexity"], rel=1e-6)
        assert three[0]["token_accuracy"] == one["token_accuracy"]
    assert sorted(one) == ["loss", "perplexity", "token_accuracy"]


def _checkpointed(directory: str) -> dict[str, torch.Tensor]:
    loop = _loop("fsdp", directory)
    with contextlib.redirect_stdout(io.StringIO()):
        loop.fit(max_steps=3)
    return loop.full_state_dict()


def test_a_sharded_checkpoint_exports_to_the_gathered_weights_and_to_save_pretrained(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    gathered = run_parallel(_checkpointed, str(tmp_path / "run"), world_size=2, timeout=120)[0]
    written = ddpkit.checkpoint.export(tmp_path / "run", tmp_path / "model.pt")
    assert written == tmp_path / "model.pt"
    exported: dict[str, Any] = torch.load(written, weights_only=True)
    assert _difference(exported, gathered) == 0.0
    assert _difference(exported, _gpt2().state_dict()) > 1e-3, "the trained weights, not the initial ones"
    ddpkit.checkpoint.export(tmp_path / "run", tmp_path / "pretrained", model=_gpt2())
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained").state_dict()
    assert _difference(loaded, gathered) == 0.0
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nowhere: give a checkpoint directory"):
        ddpkit.checkpoint.export(tmp_path / "nowhere", tmp_path / "x.pt")


def test_the_plugin_lists_the_models_own_blocks_as_units_and_otherwise_the_layers_of_its_stacks() -> None:
    model = _gpt2()
    assert ddpkit.FSDPPlugin().units(model) == ["transformer.h.0", "transformer.h.1"]
    assert ddpkit.FSDPPlugin(auto_wrap_policy={torch.nn.Embedding}).units(model) == ["transformer.wte",
                                                                                      "transformer.wpe"]  # fmt: skip
    model._no_split_modules = []  # type: ignore[assignment]  # no hint: the layers of its stacks (h is a ModuleList)
    assert ddpkit.FSDPPlugin().units(model) == ["transformer.h.0", "transformer.h.1"]
    model._no_split_modules = ["GPT2MLP"]  # type: ignore[assignment]
    assert ddpkit.FSDPPlugin().units(model) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
