"""Object and dict sync: all_gather_object, broadcast_object, aitoolbox's mp_sync, OML's sync_dicts_ddp.

Here, the tests that need no process; the others are in tests/ranks/test_object_sync.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from ddpkit import (
    WarningDDP,
    merge_list_of_dicts,
    mp_sync,
    mp_sync_dict,
    sync_dicts_ddp,
)

# --- aitoolbox's mp_sync --------------------------------------------------------------------------------


def test_mp_sync_without_a_process_group_is_one_rank() -> None:
    assert mp_sync(2.5).tolist() == [2.5]
    assert mp_sync([1, 2], return_tensor=False) == [1, 2]
    assert mp_sync(torch.tensor(3)).tolist() == [3]
    assert mp_sync_dict({"a": ["x"]}) == {"a": ["x"]}


# --- OML's sync_dicts_ddp / merge_list_of_dicts ---------------------------------------------------------


def test_sync_dicts_ddp_without_a_process_group_warns_and_returns_its_input() -> None:
    outputs = {"a": [1]}
    with pytest.warns(WarningDDP, match="You use 'sync_dicts_ddp' function, but the default process group"):
        assert sync_dicts_ddp(outputs, world_size=2) is outputs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sync_dicts_ddp(outputs, world_size=1) is outputs


def test_merge_list_of_dicts_chains_and_concatenates() -> None:
    merged = merge_list_of_dicts(
        [{"l": [1], "t": (1,), "x": torch.ones(1, 2), "a": np.zeros(2)},
         {"l": [2, 3], "t": (2,), "x": torch.zeros(2, 2), "a": np.ones(1)}],
        device="cpu",
    )  # fmt: skip
    assert merged["l"] == [1, 2, 3]
    assert merged["t"] == (1, 2)
    assert merged["x"].tolist() == [[1, 1], [0, 0], [0, 0]]
    assert merged["a"].tolist() == [0, 0, 1]
    assert merge_list_of_dicts([]) == {}


def test_merge_list_of_dicts_rejects_what_oml_rejects() -> None:
    with pytest.raises(TypeError, match="got int for key 'a' in dict 0"):
        merge_list_of_dicts([{"a": 1}])
    with pytest.raises(ValueError, match="dict 0 has 'a': list, dict 1 has 'a': tuple"):
        merge_list_of_dicts([{"a": [1]}, {"a": (1,)}])
