"""The offline benchmark's ceiling (benchmarks/offline_throughput.py): besides the linear layers'
FLOPs, the K/V bytes its decode steps must read."""

from benchmarks.offline_throughput import Request, decode_kv_bytes


def test_each_generated_token_after_the_first_reads_its_whole_context_once():
    # A 3-token prompt and 4 outputs: the first output is sampled by the prompt's step; the next
    # three are decoded over 4, 5 and 6 cached tokens. One output: no decode step at all.
    requests = [Request(prompt_ids=[5, 6, 7], max_tokens=4), Request(prompt_ids=[1] * 10, max_tokens=1)]
    assert decode_kv_bytes(requests, bytes_per_token_slot=100) == 100 * (4 + 5 + 6)
    assert decode_kv_bytes([Request(prompt_ids=[1] * 10, max_tokens=2)], bytes_per_token_slot=8) == 8 * 11
