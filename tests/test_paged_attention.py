"""The torch and cpu backends' paged_attention / write_kv against dense scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference
from kernels.random_batch import random_paged_batch


def _random_batch(gen, block_size, query_lens, cached_lens, num_heads, num_kv_heads, head_dim, backend=None,
                  max_gather_tokens=1 << 30):
    """kernels.random_batch's step as a tuple: everything the kernel and the dense oracle need, the
    metadata built by `backend` (default: torch)."""
    batch = random_paged_batch(gen, block_size, query_lens, cached_lens, num_heads, num_kv_heads, head_dim)
    meta = batch.metadata(backend or kernels.get_backend("torch", "cpu", torch.float32), max_gather_tokens)
    return batch.cache, batch.query, batch.new_k, batch.new_v, meta, batch.keys, batch.values


def _dense_reference(query, keys, values, query_lens, cached_lens, num_heads, scale):
    outs, start = [], 0
    for k, v, q_len, c in zip(keys, values, query_lens, cached_lens):
        q = query[start:start + q_len].transpose(0, 1)  # [H, q, D]
        groups = num_heads // k.shape[1]
        kk = k.repeat_interleave(groups, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        # Query i sits at position c + i and sees keys 0..c+i.
        mask = torch.arange(k.shape[0])[None, :] <= (c + torch.arange(q_len))[:, None]
        outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


BACKENDS = {"torch": ("torch", 1 << 30), "torch-small-groups": ("torch", 64), "cpu-c-kernel": ("cpu", 1 << 30)}


@pytest.mark.parametrize("backend", list(BACKENDS.values()), ids=list(BACKENDS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_matches_dense_sdpa_on_ragged_batches(block_size, seed, backend):
    name, max_gather_tokens = backend
    if name == "cpu":
        from kernels import cpu

        if not cpu.available():
            pytest.skip("no C compiler for the CPU decode kernel")
    attn = kernels.get_backend(name, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 7, (1,), generator=gen))
    # A mix of decodes (1 new token), prefill chunks over cached context, and fresh prompts.
    query_lens = [int(x) for x in torch.randint(1, 40, (num_seqs,), generator=gen)]
    query_lens[0] = 1
    cached_lens = [int(x) for x in torch.randint(0, 70, (num_seqs,), generator=gen)]
    cached_lens[-1] = 0
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    cache, query, new_k, new_v, meta, keys, values = _random_batch(
        gen, block_size, query_lens, cached_lens, num_heads, num_kv_heads, head_dim, attn, max_gather_tokens)
    if name == "torch":
        assert sum(g.token_index.shape[0] for g in meta.groups) == num_seqs
    attn.write_kv(new_k, new_v, cache, meta)
    scale = head_dim ** -0.5
    out = attn.paged_attention(query, new_k, new_v, cache, meta, scale)
    expected = _dense_reference(query, keys, values, query_lens, cached_lens, num_heads, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_puts_each_token_at_its_slot_and_nowhere_else():
    gen = torch.Generator().manual_seed(0)
    cache, query, new_k, new_v, meta, keys, values = _random_batch(
        gen, 16, query_lens=[5, 1], cached_lens=[0, 20], num_heads=2, num_kv_heads=2, head_dim=8)
    before = cache.clone()
    meta.backend.write_kv(new_k, new_v, cache, meta)
    for i, (b, o) in enumerate(zip(meta.slot_blocks.tolist(), meta.slot_offsets.tolist())):
        assert torch.equal(cache[b, 0, o], new_k[i]) and torch.equal(cache[b, 1, o], new_v[i])
        before[b, :, o] = cache[b, :, o]
    assert torch.equal(before, cache), "write_kv touched a slot outside slot_mapping"


def test_decodes_are_not_padded_to_a_long_prefill_chunk():
    meta = reference.build_attention_metadata(
        torch.tensor([1, 1, 300]), torch.tensor([40, 50, 300]),
        torch.zeros(3, 19, dtype=torch.int32), torch.arange(302), 16)
    shapes = sorted(tuple(g.token_index.shape) for g in meta.groups)
    assert shapes == [(1, 300), (2, 1)]
    fresh = [g for g in meta.groups if g.token_index.shape[1] == 300][0]
    assert fresh.block_tables is None and fresh.mask is None  # no gather, no mask: its own K/V


def test_groups_sort_by_context_and_respect_the_gather_budget():
    from kernels.reference import _group_decodes

    groups = _group_decodes([100, 10, 50, 12, 20], [0, 1, 2, 3], max_gather_tokens=100)
    # sorted by length 10, 12, 50, 100; 3 x 50 = 150 > 100 splits after 12
    assert groups == [[1, 3], [2], [0]]
