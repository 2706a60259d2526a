"""prune.html's data: what the search did to each head, in its order and at its step (report/prune_page.py)."""

from __future__ import annotations

import json

import pytest

from headscope.report.prune_page import FREED, FULL, KEPT, REMOVED, WINDOWED, head_states, prune_page


def pruning(mode: str, heads: list[str]) -> dict:
    """prune.json's fields the page reads: 2 layers of 4 query heads on 2 KV heads, three accepted steps."""
    return {"model": {"name": "m", "architecture": {"layers": 2, "heads": 4, "kv_heads": 2}}, "mode": mode,
            "heads": heads, "total_heads": 8, "curve": [{"heads_removed": n, "loss": 3.0 + n / 100} for n in (0, 2, 4)],
            "corpus": {"path": "/data/texts.txt"}, "budget": 0.1, "clean_loss": 3.0, "pruned_loss": 3.04,
            "window": {"sink": 4, "size": 64} if mode == "window" else None, "seconds": 1.5,
            "search": {"rounds": 2, "stopped": "done", "candidates": 8, "gradient_passes": 3}}  # fmt: skip


def test_each_head_is_placed_by_its_order_and_its_kv_head_by_every_query_head_that_reads_it():
    record = pruning("window", ["0.0", "0.1", "1.3", "0.2"])
    # KV head 0 of layer 0 (query heads 0 and 1) is freed; layer 0's KV head 1 and layer 1's KV head 1 still serve
    # a full query head (0.3 and 1.2)
    policy = {"layers": [{"kv_heads": ["windowed", "full"]}, {"kv_heads": ["full", "full"]}]}
    states = head_states(record, policy)
    assert states["state"] == [FREED, FREED, WINDOWED, FULL, FULL, FULL, FULL, WINDOWED]
    assert states["kv_head"] == [0, 0, 1, 1] * 2
    assert states["order"] == [1, 2, 4, None, None, None, None, 3]
    assert states["step"] == [1, 1, 2, None, None, None, None, 2]  # steps of 2 heads: the 3rd and 4th at step 2
    assert states["loss"] == [3.02, 3.02, 3.04, None, None, None, None, 3.04]


def test_zero_and_mean_heads_are_kept_or_removed():
    states = head_states(pruning("zero", ["1.0", "1.1"]), None)
    assert states["state"] == [KEPT] * 4 + [REMOVED] * 2 + [KEPT] * 2
    assert states["step"] == [None] * 4 + [1, 1] + [None] * 2


def page_data(page: str) -> dict:
    return json.loads(page.split('<script id="data" type="application/json">')[1].split("</script>")[0])


def test_the_page_carries_the_states_colours_and_the_policys_memory():
    record = pruning("window", ["0.0", "0.1"])
    record["curve"] = record["curve"][:2]
    memory = {"longest_text": {"tokens": 100, "full_bytes": 400, "policy_bytes": 300, "freed_share": 0.25}}
    policy = {"layers": [{"kv_heads": ["windowed", "full"]}, {"kv_heads": ["full", "full"]}],
              "query_heads": {"windowed": 2, "total": 8, "share": 0.25},
              "kv_heads": {"windowed": 1, "total": 4, "share": 0.25}, "memory": memory}  # fmt: skip
    page = prune_page(record, policy)
    data = page_data(page)
    assert list(data["states"]) == [FULL, WINDOWED, FREED]
    assert data["policy"]["memory"] == memory and data["heads"]["state"][:2] == [FREED, FREED]
    assert data["curve"] == record["curve"] and data["window"] == {"sink": 4, "size": 64}
    assert "m: 2 of 8 heads windowed on texts.txt" in page
    removed = prune_page(pruning("mean", []), None)
    assert list(page_data(removed)["states"]) == [KEPT, REMOVED] and page_data(removed)["policy"] is None
    assert "m: 0 of 8 heads removed on texts.txt" in removed


@pytest.mark.parametrize("mode", ["zero", "window"])
def test_a_head_outside_the_curve_is_refused_loudly(mode):
    """The order and the curve come from one search: a head past the curve's last count cannot be placed."""
    record = pruning(mode, ["0.0", "0.1", "0.2", "0.3", "1.0"])
    policy = {"layers": [{"kv_heads": ["windowed", "windowed"]}, {"kv_heads": ["full", "full"]}]}
    with pytest.raises(IndexError):
        head_states(record, policy if mode == "window" else None)
