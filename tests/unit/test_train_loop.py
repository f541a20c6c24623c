"""TrainLoop: DDP equals one process (item and batch samplers), exact metrics, bit-identical resume.

Here, the tests that need no process; the others are in tests/ranks/test_train_loop.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import Callback, TrainLoop
from ddpkit.examples.digits import digits_datasets, load_digits
from tests.support.train_loop import _model

# --- run in the workers (top level: pickled by reference) -----------------------------------


# --- behaviour ---------------------------------------------------------------------------------


class _Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_train_begin(self, train_loop: Any) -> None:
        self.events.append("train_begin")

    def on_epoch_begin(self, train_loop: Any) -> None:
        self.events.append(f"epoch_begin {train_loop.epoch}")

    def on_batch_end(self, train_loop: Any) -> None:
        self.events.append(f"step {train_loop.global_step}")

    def on_epoch_end(self, train_loop: Any) -> None:
        self.events.append(f"epoch_end {train_loop.epoch} {len(train_loop.history['train_loss'])}")

    def on_train_end(self, train_loop: Any) -> None:
        self.events.append("train_end")


def test_callbacks_see_every_event_in_order_and_the_handler_refuses_others() -> None:
    images, labels = load_digits()
    data = TensorDataset(torch.from_numpy(images)[:10], torch.from_numpy(labels)[:10])
    loop = TrainLoop(_model(), DataLoader(data, batch_size=4), progress=False)
    recorder = _Recorder()
    loop.fit(2, grad_accumulation=2, callbacks=[recorder])
    assert recorder.events == [
        "train_begin",
        "epoch_begin 0", "step 1", "step 2", "epoch_end 0 1",
        "epoch_begin 1", "step 3", "step 4", "epoch_end 1 2",
        "train_end",
    ]  # fmt: skip
    with pytest.raises(TypeError, match=r"must be ddpkit\.Callback instances, got builtin_function_or_method"):
        loop.callbacks_handler.register_callbacks([print])  # type: ignore[list-item]


def test_the_handler_calls_only_what_a_callback_overrides_and_sees_callbacks_added_later() -> None:
    calls: list[str] = []
    handler = TrainLoop(_model(), DataLoader(TensorDataset(torch.zeros(4, 64)))).callbacks_handler
    recorder, plain, patched = _Recorder(), Callback(), Callback()
    patched.on_batch_end = lambda train_loop: calls.append("patched")  # type: ignore[method-assign]
    handler.register_callbacks([plain, recorder])
    handler.execute("on_batch_end")
    assert recorder.events == ["step 0"]
    assert calls == []
    handler.callbacks.append(patched)  # a list of its own: added without register_callbacks
    handler.execute("on_batch_end")
    assert recorder.events == ["step 0", "step 0"]
    assert calls == ["patched"]
    handler.callbacks.remove(recorder)
    handler.execute("on_batch_end")
    assert recorder.events == ["step 0", "step 0"]
    assert calls == ["patched", "patched"]


def test_bad_arguments_are_refused_with_the_values() -> None:
    train, _ = digits_datasets(seed=0)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=64))
    with pytest.raises(ValueError, match="num_epochs=0 and grad_accumulation=1 must be >= 1"):
        loop.fit(0)
    with pytest.raises(ValueError, match="grad_accumulation=0"):
        loop.fit(1, grad_accumulation=0)
    with pytest.raises(ValueError, match="evaluate\\(\\) needs a loader"):
        loop.evaluate()
    with pytest.raises(ValueError, match="checkpoint_every=0 must be >= 1"):
        TrainLoop(_model(), DataLoader(train), checkpoint_every=0)


def test_a_step_budget_bounds_the_epochs_and_an_epoch_ending_at_an_evaluation_reuses_it() -> None:
    """max_steps with num_epochs: whichever comes first. Epochs of 10 steps (640 items in batches of 64):
    evaluate_every=5 evaluates after steps 5, 10, 15 and 20, and each epoch's validation metrics are its last
    step's (the same weights, evaluated once)."""
    from torch.utils.data import Subset

    train, val = digits_datasets(seed=0)
    evaluations: list[int] = []

    class Counting(TrainLoop):
        def evaluate(self, loader: Any = None) -> dict[str, float]:
            evaluations.append(self.global_step)
            return super().evaluate(loader)

    def loop(**arguments: Any) -> TrainLoop:
        model = _model()
        return Counting(model, DataLoader(Subset(train, range(640)), batch_size=64), DataLoader(val, batch_size=100),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False, **arguments)  # fmt: skip

    bounded = loop()
    bounded.fit(5, max_steps=13)
    assert (bounded.global_step, bounded.epoch) == (13, 1), "max_steps came first"
    assert evaluations == [10]
    evaluations.clear()
    epochs_first = loop(evaluate_every=5)
    history = epochs_first.fit(2, max_steps=1000)
    assert (epochs_first.global_step, epochs_first.epoch) == (20, 2), "num_epochs came first"
    assert evaluations == [5, 10, 15, 20], "epochs ending at steps 10 and 20 reuse those steps' evaluations"
    assert history["eval_step"] == [5.0, 10.0, 15.0, 20.0]
    assert history["validation_loss"] == [history["eval_loss"][1], history["eval_loss"][3]]
    assert history["eval_loss"][0] != history["eval_loss"][1]
    steps_only = loop()
    assert "train_loss" in steps_only.fit(max_steps=25)
    assert steps_only.global_step == 25
    assert steps_only.epoch == 2, "two whole epochs, then five steps of the third"


def test_bad_budgets_are_refused_with_the_values() -> None:
    train, val = digits_datasets(seed=0)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=64), progress=False)
    with pytest.raises(ValueError, match="fit needs num_epochs or max_steps"):
        loop.fit()
    with pytest.raises(ValueError, match=r"max_steps=0 must be >= 1 optimizer steps"):
        loop.fit(max_steps=0)
    with pytest.raises(ValueError, match=r"num_epochs=0 and grad_accumulation=1 must be >= 1"):
        loop.fit(0, max_steps=5)
    with pytest.raises(ValueError, match=r"max_steps=-1 must be >= 1"):
        loop.fit_distributed(2, max_steps=-1)
    with pytest.raises(ValueError, match=r"evaluate_every=0 must be >= 1 optimizer steps"):
        TrainLoop(_model(), DataLoader(train), DataLoader(val), evaluate_every=0)
    with pytest.raises(ValueError, match=r"evaluate_every=5 evaluates the validation split: pass a validation_loader"):
        TrainLoop(_model(), DataLoader(train), evaluate_every=5)
    assert loop.global_step == 0


def test_an_async_checkpoint_is_written_while_the_next_steps_train(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint_async: step 3's checkpoint is written in the background while steps 4 and 5 train (its write
    waits for step 5 to end, which a synchronous write would never see); fit returns with the last one on disk,
    resumable; a write that fails raises from fit."""
    import threading

    from ddpkit.training import TrainState

    train, _ = digits_datasets(seed=0)
    trained_on = threading.Event()
    seen: list[tuple[int, bool]] = []
    real_save = TrainState.save

    def slow_save(self: TrainState, path: Any) -> None:
        if self.global_step == 3:
            seen.append((self.global_step, trained_on.wait(timeout=10)))
        real_save(self, path)

    class Watch(Callback):
        def on_batch_end(self, train_loop: Any) -> None:
            if train_loop.global_step == 5:
                trained_on.set()

    monkeypatch.setattr(TrainState, "save", slow_save)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=256), progress=False, checkpoint_dir=tmp_path,
                     checkpoint_every=3, checkpoint_async=True)  # fmt: skip
    loop.fit(1, callbacks=[Watch()])
    assert seen == [(3, True)], "steps 4 and 5 trained while step 3's checkpoint was written"
    assert TrainState.load(tmp_path / "last.pt").global_step == loop.global_step == 6, "the epoch's end, on disk"

    def failing_save(self: TrainState, path: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TrainState, "save", failing_save)
    again = TrainLoop(_model(), DataLoader(train, batch_size=256), progress=False, checkpoint_dir=tmp_path / "b",
                      checkpoint_every=3, checkpoint_async=True)  # fmt: skip
    with pytest.raises(OSError, match="No space left on device"):
        again.fit(1)
    assert again.global_step == 6, "the failure came out at the next checkpoint (the epoch's end), not at once"


def test_an_async_checkpoint_holds_the_weights_of_its_step_though_they_are_copied_while_the_next_one_trains(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint_async copies the parameters and the optimizer's state in its thread, during the next step's
    forward and backward: with that thread late by 0.3 s, the next optimizer step waits for the copy, so step 3's
    checkpoint holds step 3's weights and momentum (not step 4's), and the run's weights are those of a run
    without checkpoints."""
    import time

    from ddpkit.training import TrainState
    from ddpkit.training._async_save import AsyncWrites

    train, _ = digits_datasets(seed=0)
    real_write, real_save = AsyncWrites._write, TrainState.save

    def late_write(self: AsyncWrites, *args: Any) -> None:
        time.sleep(0.3)
        real_write(self, *args)

    at_step: dict[int, dict[str, Any]] = {}
    written: dict[int, dict[str, Any]] = {}

    class Weights(Callback):
        def on_batch_end(self, train_loop: Any) -> None:
            state = {k: v.clone() for k, v in train_loop.model.state_dict().items()}
            momentum = train_loop.optimizer.state_dict()["state"]
            at_step[train_loop.global_step] = {**state, "momentum": momentum[0]["momentum_buffer"].clone()}

    def kept_save(self: TrainState, path: Any) -> None:
        momentum = self.optimizer["state"][0]["momentum_buffer"]
        written[self.global_step] = {**{k: v.clone() for k, v in self.model.items()}, "momentum": momentum.clone()}
        real_save(self, path)

    monkeypatch.setattr(AsyncWrites, "_write", late_write)
    monkeypatch.setattr(TrainState, "save", kept_save)

    def fit(checkpoints: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _model()
        loop = TrainLoop(model, DataLoader(train, batch_size=256), progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         checkpoint_dir=tmp_path if checkpoints else None, checkpoint_every=3,
                         checkpoint_async=True)  # fmt: skip
        loop.fit(1, callbacks=[Weights()])
        return model

    plain = fit(False).state_dict()
    model = fit(True)
    assert sorted(written) == [3, 6]
    for step in (3, 6):
        for name, value in written[step].items():
            assert torch.equal(value, at_step[step][name]), f"step {step}'s checkpoint holds {name} of step {step}"
    assert not torch.equal(written[3]["0.weight"], at_step[4]["0.weight"]), "a step changes the weights"
    for name, value in model.state_dict().items():
        assert torch.equal(value, plain[name]), "the run trained as one without checkpoints"


# --- failures inside the loop -------------------------------------------------------------------------------


def test_evaluate_puts_the_model_back_in_train_mode_when_it_raises() -> None:
    class Broken(TrainLoop):
        def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            raise RuntimeError("bad batch")

    _, val = digits_datasets(seed=0)
    model = _model()
    loop = Broken(model, DataLoader(val, batch_size=64), progress=False)
    with pytest.raises(RuntimeError, match="bad batch"):
        loop.evaluate(DataLoader(val, batch_size=64))
    assert model.training
