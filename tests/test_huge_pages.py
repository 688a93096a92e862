"""A CPU model's weights moved onto one huge-page mapping (workers/huge_pages.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from workers import huge_pages
from workers.huge_pages import HUGE_PAGE, HugePageMove, huge_pages_available, move_to_huge_pages, transparent_huge_pages


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry holding `address`: its range and fields."""
    with open("/proc/self/smaps") as f:
        entry = None
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {"start": start, "end": end} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        self.head = nn.Linear(256, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's LM head
        self.fused = nn.Linear(256, 768)
        self.norm = nn.Parameter(torch.ones(256))
        self.register_buffer("cos", torch.randn(4096, 32), persistent=False)


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages")
def test_weights_move_to_one_huge_page_mapping_with_the_same_values_and_sharing():
    model = Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(3, 256)
    out_before = model.head(x) + model.fused(x).sum()
    moved = move_to_huge_pages(model)
    assert moved >= sum(t.numel() * t.element_size() for t in model.parameters()) + model.cos.nbytes
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model.head(x) + model.fused(x).sum(), out_before)
    # One storage still serves both tied modules, and the moved tensors are still parameters.
    assert model.head.weight is model.embed.weight and isinstance(model.norm, nn.Parameter)
    tensors = [*model.parameters(), model.cos]
    mapping = _mapping_of(tensors[0].data_ptr())
    assert all(mapping["start"] <= t.data_ptr() < mapping["end"] for t in tensors)
    assert min(t.data_ptr() for t in tensors) % HUGE_PAGE == 0
    assert "hg" in mapping["VmFlags"].split()  # advised MADV_HUGEPAGE
    assert mapping["THPeligible"] == "1"
    model.embed.weight.data[0, 0] = 5.0  # writable, as the weights they replaced
    assert model.head.weight[0, 0] == 5.0


def test_nothing_moves_where_the_kernel_gives_no_huge_pages(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", str(setting))
    assert transparent_huge_pages() == "never"
    model = Tied()
    address = model.fused.weight.data_ptr()
    assert move_to_huge_pages(model) == 0 and model.fused.weight.data_ptr() == address
    monkeypatch.setattr(huge_pages, "THP_SETTING", str(tmp_path / "missing"))
    assert transparent_huge_pages() == "unavailable" and move_to_huge_pages(model) == 0


def test_nothing_moves_where_a_second_copy_would_crowd_the_nodes_memory(monkeypatch, caplog):
    model = Tied()
    size = sum(t.nbytes for t in model.parameters()) + model.cos.nbytes
    monkeypatch.setattr(huge_pages, "available_memory", lambda: size)  # a copy would take over half
    address = model.fused.weight.data_ptr()
    with caplog.at_level("WARNING", logger="workers.huge_pages"):
        assert move_to_huge_pages(model) == 0
    assert model.fused.weight.data_ptr() == address
    assert "would take over half of this node's available memory" in caplog.text


def test_an_engine_moves_its_weights_beside_its_start_and_its_tokens_do_not_change(tiny_llama, monkeypatch):
    """The worker copies its weights on a thread and re-points them between steps, with no step
    needed (an idle server does not hold them twice); its tokens before and after the move are
    those of an engine that moves nothing."""
    from pagedserve import LLM, SamplingParams

    thp = huge_pages_available()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2]}, {"prompt_token_ids": list(range(3, 40))}]

    llm = LLM(tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=4)
    worker = llm.engine.executor.worker
    embed = worker.model.embed_tokens.weight
    assert (worker._weights_move.wait(60) > 0) == thp
    if thp:  # moved with no step run
        mapping = _mapping_of(embed.data_ptr())
        assert "hg" in mapping["VmFlags"].split()
        assert all(mapping["start"] <= p.data_ptr() < mapping["end"] for p in worker.model.parameters())
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()

    monkeypatch.setattr(huge_pages, "THP_SETTING", "/nonexistent")
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=4)
    assert llm.engine.executor.worker._weights_move.wait(60) == 0  # nothing moves
    unmoved = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert after == unmoved


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages")
def test_the_tensors_are_re_pointed_only_while_no_step_holds_the_step_lock():
    """Steps run on the weights as loaded until the copy is done; the move then waits for the
    lock the worker holds around each step."""
    step_lock = threading.Lock()
    model = Tied()
    loaded_at = model.embed.weight.data_ptr()
    with step_lock:  # as a running step
        move = HugePageMove(model, step_lock)
        with pytest.raises(TimeoutError):
            move.wait(2)
        assert model.embed.weight.data_ptr() == loaded_at
    assert move.wait(60) > 0
    assert model.embed.weight.data_ptr() != loaded_at and model.head.weight is model.embed.weight


def test_the_engine_reports_steps_that_ran_while_the_weights_were_still_moving(tiny_llama, monkeypatch):
    """`weights_moving_to_huge_pages` is 1 after a step that ran beside the copy (held here until
    released) and 0 after one that ran once it was done: what a benchmark of a server waits for.
    The offline `LLM` itself returns only once the copy is done."""
    import threading

    from coordinator.engine import LLMEngine
    from pagedserve import LLM, SamplingParams
    from pagedserve.config import EngineConfig

    release = threading.Event()
    copy = huge_pages.HugePageMove._copy_and_repoint

    def held_copy(self):
        release.wait(60)
        copy(self)

    monkeypatch.setattr(huge_pages.HugePageMove, "_copy_and_repoint", held_copy)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine = LLMEngine.from_config(EngineConfig(model=tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=4))

    def one_request(request_id):
        engine.add_request(request_id, None, [5, 9, 13], params)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.stats()["weights_moving_to_huge_pages"]

    try:
        assert engine.stats()["weights_moving_to_huge_pages"] == 0  # no step yet
        assert one_request("during") == int(huge_pages_available())
        release.set()
        engine.executor.collective_rpc("wait_for_weights")
        assert one_request("after") == 0
    finally:
        release.set()
        engine.shutdown()

    release.clear()
    threading.Timer(1.0, release.set).start()
    llm = LLM(tiny_llama, kv_cache_memory=1 << 22, max_num_seqs=4)
    try:
        assert not llm.engine.executor.worker._weights_move.running()
        assert release.is_set() or not huge_pages_available()
    finally:
        release.set()
        llm.shutdown()
