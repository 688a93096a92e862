"""The server's periodic stats line (vLLM's "Avg prompt throughput: ..."): rates over the
interval, queues, KV usage and the interval's prefix hit rate; quiet while idle."""

from __future__ import annotations

import asyncio

from coordinator.stats_logger import StatsLine, log_stats_forever


def _stats(prompt=0, generated=0, running=0, waiting=0, swapped=0, kv_usage=0.0, queries=0, hits=0) -> dict:
    return {"prompt_tokens": prompt, "generation_tokens": generated, "num_requests_running": running,
            "num_requests_waiting": waiting, "num_requests_swapped": swapped, "kv_usage": kv_usage,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def test_the_line_reports_the_interval_and_keeps_quiet_while_idle():
    line = StatsLine()
    assert line.update(_stats(), 0.0) is None  # nothing to compare with yet
    busy = line.update(_stats(prompt=1000, generated=50, running=2, waiting=1, kv_usage=0.25, queries=8, hits=2),
                       10.0)
    assert busy == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 2 reqs, Waiting: 1 reqs, Swapped: 0 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    idle = _stats(prompt=1000, generated=75, queries=8, hits=2)
    assert "Avg generation throughput: 2.5 tokens/s" in line.update(idle, 20.0)  # its last requests finished
    assert "Running: 0 reqs" in line.update(idle, 30.0)  # the first idle interval is reported
    assert line.update(idle, 40.0) is None and line.update(idle, 50.0) is None  # then nothing while idle
    assert "Avg prompt throughput: 0.5 tokens/s" in line.update({**idle, "prompt_tokens": 1005}, 60.0)


def test_the_server_logs_it_every_interval_on_stderr(capsys):
    snapshots = iter([_stats(), _stats(prompt=40, generated=4, running=1), RuntimeError("rebuilding"),
                      _stats(prompt=40, generated=8, running=1)] + [_stats(prompt=40, generated=8)] * 50)

    async def read():
        value = next(snapshots)
        if isinstance(value, Exception):
            raise value
        return value

    async def run():
        task = asyncio.ensure_future(log_stats_forever(read, interval=0.01))
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(run())
    lines = [x for x in capsys.readouterr().err.splitlines() if "Avg prompt throughput" in x]
    assert " INFO pagedserve: Avg prompt throughput: " in lines[0]
    assert "Running: 1 reqs" in lines[0] and "Running: 1 reqs" in lines[1]  # the failed read skipped one
    assert len(lines) == 3  # then one idle line, and no more
