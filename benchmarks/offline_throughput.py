"""Offline throughput: pagedserve's LLM.generate against Hugging Face `generate` on static batches.

One run, one synthetic workload (seeded): prompts are windows of real English text (docstrings of
stdlib modules, tokenized with the model's tokenizer), output lengths are drawn per request, and
EOS is ignored so every request generates exactly its max_tokens. Both engines are timed on it;
only each request's own prompt and own max_tokens count as useful tokens. The run also reports
how much of the KV memory each engine held was wasted, and how close each got to this CPU's
matmul ceiling (the linear layers' FLOPs at its matmul rate), alone and with the decode
attention's K/V reads added at its memory read rate: a decode step reads every running
sequence's cache, which no FLOP count shows.

    .venv/bin/python benchmarks/offline_throughput.py                 # full size (minutes)
    .venv/bin/python benchmarks/offline_throughput.py --num-requests 4 --prompt-len-max 60 \
        --output-len-max 8                                            # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

# The GGUF dequantizing bar is plain tqdm, which reads this only when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from kernels.cpu import mkl_packed, packed_gemm  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench import hf_baseline as bench_hf  # noqa: E402
from pagedserve.bench.dataset import BenchRequest, corpus_text  # noqa: E402
from pagedserve.bench.hf_baseline import batches, hf_generate  # noqa: E402
from pagedserve.config import resolve_model  # noqa: E402
from workers.models import llama  # noqa: E402

MODEL = "smollm2-135m-instruct"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


Request = BenchRequest  # prompt_ids, max_tokens


# ---- arguments -----------------------------------------------------------------------------------
def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and engine flags every benchmark here shares."""
    p.add_argument("--num-requests", type=int, default=64)
    # A min left unset follows a max set below it, so a smoke test needs only the max flags.
    p.add_argument("--prompt-len-min", type=int, default=None, help="default 20")
    p.add_argument("--prompt-len-max", type=int, default=600)
    p.add_argument("--output-len-min", type=int, default=None, help="default 16")
    p.add_argument("--output-len-max", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES),
                   help="weights and KV dtype of every engine")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="pagedserve KV pool bytes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.prompt_len_min is None:
        args.prompt_len_min = min(20, args.prompt_len_max)
    if args.output_len_min is None:
        args.output_len_min = min(16, args.output_len_max)
    if not 1 <= args.prompt_len_min <= args.prompt_len_max:
        p.error("need 1 <= --prompt-len-min <= --prompt-len-max")
    if not 1 <= args.output_len_min <= args.output_len_max:
        p.error("need 1 <= --output-len-min <= --output-len-max")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--batch-size", type=int, default=16, help="static batch of the HF baseline")
    p.add_argument("--skip-baseline", action="store_true", help="time pagedserve only")
    p.add_argument("--result-json", default="benchmarks/results/offline_throughput.json")
    return check_workload_args(p, p.parse_args(argv))


# ---- timing --------------------------------------------------------------------------------------
def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have run since boot (Linux), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Stopwatch:
    """Wall time of a section, and the share of the cores other processes took meanwhile: on a
    shared machine, torch's threads then wait on each other and a run can come out many times
    too slow, so every timing carries its own contention figure."""

    def __enter__(self):
        self._busy, self._own, self.start = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        busy = _busy_cpu_seconds()
        self.other_cpu_share = None
        if busy is not None and self._busy is not None:
            other = (busy - self._busy) - (time.process_time() - self._own)
            self.other_cpu_share = max(0.0, other) / (self.seconds * os.cpu_count())
        return False


# ---- workload ------------------------------------------------------------------------------------
def make_workload(tokenizer, args) -> list[Request]:
    corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if len(corpus) < args.prompt_len_max:
        raise SystemExit(f"corpus has {len(corpus)} tokens; --prompt-len-max must not exceed it")
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        length = rng.randint(args.prompt_len_min, args.prompt_len_max)
        start = rng.randint(0, len(corpus) - length)
        max_tokens = rng.randint(args.output_len_min, args.output_len_max)
        requests.append(Request(corpus[start:start + length], max_tokens))
    return requests


def useful_tokens(requests: list[Request]) -> tuple[int, int]:
    return sum(len(r.prompt_ids) for r in requests), sum(r.max_tokens for r in requests)


# ---- the CPU ceiling -----------------------------------------------------------------------------
def matmul_gflops(dtype: torch.dtype, seconds: float = 2.0) -> tuple[float, Stopwatch]:
    """Sustained rate of a matmul shaped like the model's MLP (a 2048-token step): the fastest of
    torch's GEMM (MKL), oneDNN's on a weight packed once, and for fp32 MKL's and pagedserve's own
    on a weight packed once (the GEMMs pagedserve's fp32 layers choose from; each is the fastest on
    some CPUs, so the ceiling must count them all), `seconds` each."""
    a = torch.randn(2048, 576, dtype=dtype)
    b = torch.randn(576, 1536, dtype=dtype)
    kernels = [lambda: torch.mm(a, b)]
    # oneDNN packs bf16 weights only on a CPU with bf16 instructions
    if torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16 or llama._mkldnn_bf16()):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    if dtype == torch.float32 and mkl_packed.available():
        mkl_weight = mkl_packed.PackedWeight(b.t().contiguous())
        kernels.append(lambda: mkl_packed.linear(a, mkl_weight))
    if dtype == torch.float32 and packed_gemm.available():
        panels = packed_gemm.PackedWeight(b.t().contiguous())
        kernels.append(lambda: packed_gemm.linear(a, panels))
    flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    best = (0.0, None)
    for kernel in kernels:
        for _ in range(3):  # warm the allocator and the BLAS thread pool
            kernel()
        reps = 0
        with Stopwatch() as watch:
            while time.perf_counter() - watch.start < seconds:
                kernel()
                reps += 1
        best = max(best, (reps * flop / watch.seconds / 1e9, watch), key=lambda rate_watch: rate_watch[0])
    return best


def memory_read_gbps(seconds: float = 1.0) -> float:
    """Sustained rate at which torch's threads read memory, GB/s: sums over a 512 MiB buffer,
    beyond any cache (the fastest pass of `seconds`)."""
    buffer = torch.ones(512 << 20 >> 2)
    buffer.sum()  # first touch
    best, until = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        start = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def decode_kv_bytes(requests: list[Request], bytes_per_token_slot: int) -> int:
    """The K/V bytes the workload's decode steps read at the least: every generated token but the
    first (which the prompt's last step samples) attends to its prompt and to the tokens generated
    before it, itself included, reading each one's K and V in every layer once."""
    return bytes_per_token_slot * sum(sum(range(len(r.prompt_ids) + 1, len(r.prompt_ids) + r.max_tokens))
                                      for r in requests)


def linear_flops_per_token(hf_config) -> tuple[float, float]:
    """FLOPs of the linear layers for a prompt token and for a generated token (which also pays
    the LM head). Attention score FLOPs are left out: small at these lengths."""
    h, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q_dim = hf_config.num_attention_heads * head_dim
    kv_dim = hf_config.num_key_value_heads * head_dim
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter
    body = 2.0 * layers * per_layer
    return body, body + 2.0 * h * hf_config.vocab_size


# ---- pagedserve ----------------------------------------------------------------------------------
class KVTrace:
    """Per-step KV occupancy, read right after each forward pass: the moment the engine's own
    peak is taken. Costs a pass over the running sequences' table tails per step."""

    def __init__(self, engine):
        self.scheduler, self.samples = engine.scheduler, []
        executor = engine.executor
        self._execute = executor.execute
        executor.execute = self._traced

    def _traced(self, plan):
        out = self._execute(plan)
        # The step's new K/V are written now; the sequences count them once the step is processed.
        kv = self.scheduler.kv
        filled = kv.num_filled_slots(self.scheduler.running) + plan.num_tokens
        self.samples.append((time.perf_counter(), kv.pool.num_used, filled))
        return out

    def summary(self, block_size: int, start: float) -> dict:
        if not self.samples:
            return {}
        _, used_peak, filled_peak = max(self.samples, key=lambda s: (s[1], s[2]))
        allocated_time = filled_time = 0.0
        prev = start
        for t, used, filled in self.samples:  # weight each step by how long it lasted
            allocated_time += used * block_size * (t - prev)
            filled_time += filled * (t - prev)
            prev = t
        return {
            "peak_blocks": used_peak,
            "peak_slots": used_peak * block_size,
            "peak_filled_slots": filled_peak,
            "waste_at_peak": 1.0 - filled_peak / (used_peak * block_size),
            "waste_time_avg": 1.0 - filled_time / allocated_time if allocated_time else 0.0,
            "steps": len(self.samples),
        }


def run_pagedserve(args, requests: list[Request]) -> dict:
    llm = LLM(model=MODEL, dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], warm, use_tqdm=False)  # first-call costs
    before = llm.stats()
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    trace = KVTrace(llm.engine)
    with Stopwatch() as watch:
        outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    for r, toks in zip(requests, outputs):
        assert len(toks) == r.max_tokens, f"ignore_eos broken: {len(toks)} != {r.max_tokens}"
    block_bytes = llm.engine.executor.block_bytes()
    kv = trace.summary(args.block_size, watch.start)
    kv.update(engine_peak_blocks=stats["kv_blocks_peak_used"], pool_blocks=stats["kv_blocks_total"],
              peak_bytes=stats["kv_blocks_peak_used"] * block_bytes,
              pool_bytes=stats["kv_blocks_total"] * block_bytes,
              bytes_per_token_slot=block_bytes // args.block_size)
    engine = {k: stats[k] - before[k] for k in ("num_steps", "prefix_cache_hits", "num_preemptions")}
    del llm
    gc.collect()
    return {"watch": watch, "outputs": outputs, "kv": kv, "engine": engine}


# ---- transformers --------------------------------------------------------------------------------
def load_hf_model(dtype: torch.dtype):
    return bench_hf.load_hf_model(MODEL, dtype)


def hf_kv(requests: list[Request], batch_size: int, bytes_per_slot: int) -> dict:
    """A static batch's cache ends at batch x (longest prompt + longest output) slots per layer;
    each request needed only its own prompt + own output."""
    slots, needed = [], []
    for batch in batches(requests, batch_size):
        width = max(len(r.prompt_ids) for r in batch) + max(r.max_tokens for r in batch)
        slots.append(len(batch) * width)
        needed.append(sum(len(r.prompt_ids) + r.max_tokens for r in batch))
    peak = max(range(len(slots)), key=slots.__getitem__)
    return {"peak_slots": slots[peak], "peak_filled_slots": needed[peak],
            "waste_at_peak": 1.0 - needed[peak] / slots[peak],
            "waste_all_batches": 1.0 - sum(needed) / sum(slots),
            "peak_bytes": slots[peak] * bytes_per_slot, "batches": len(slots)}


def run_transformers(args, requests: list[Request]) -> dict:
    model, tokenizer = load_hf_model(TORCH_DTYPES[args.dtype])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        hf_generate(model, [Request([1, 2, 3], 2), Request([4, 5], 2)], pad_id)  # first-call costs
        outputs = []
        with Stopwatch() as watch:
            for batch in batches(requests, args.batch_size):
                outputs += hf_generate(model, batch, pad_id)
    del model
    gc.collect()
    return {"watch": watch, "outputs": outputs}


# ---- report --------------------------------------------------------------------------------------
def throughput(watch: Stopwatch, prompt: int, generated: int, ceiling_s: float, kv_floor_s: float) -> dict:
    seconds = watch.seconds
    return {"seconds": seconds, "other_cpu_share": watch.other_cpu_share,
            "prompt_tokens": prompt, "generated_tokens": generated,
            "total_tokens_per_s": (prompt + generated) / seconds,
            "generated_tokens_per_s": generated / seconds,
            "ceiling_fraction": ceiling_s / seconds,
            "ceiling_with_kv_reads_fraction": (ceiling_s + kv_floor_s) / seconds}


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How alike the two engines' greedy outputs are: fp32 reductions in another order can flip
    a near-tie, after which the continuations diverge, so exact equality is not expected."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return {"identical_requests": same, "requests": len(a),
            "mean_common_prefix_fraction": sum(p / len(x) for p, x in zip(prefix, a)) / len(a)}


_BUSY = 0.05  # other processes' share of the cores above which the timings are suspect


def _fmt(fmt: str, value) -> str:
    return "n/a" if value is None else fmt.format(value)


def print_report(res: dict) -> None:
    w, ps, hf = res["workload"], res["pagedserve"], res.get("transformers")
    print(f"\nworkload: {w['num_requests']} requests, {w['prompt_tokens']} prompt + "
          f"{w['generated_tokens']} generated tokens (seed {w['seed']}, {res['dtype']})")
    rates = (f"{res['matmul_gflops_dtype']:.1f} GFLOP/s {res['dtype']} matmul"
             + ("" if res["dtype"] == "float32" else f", {res['matmul_gflops_fp32']:.1f} fp32 (the faster counts)"))
    print(f"CPU ceiling: {rates}, {res['flops']['total'] / 1e12:.2f} TFLOP of linear layers "
          f"-> {res['ceiling_seconds']:.1f} s")
    print(f"decode attention's K/V reads: {res['kv_read_bytes'] / 1e9:.1f} GB at {res['memory_read_gbps']:.1f} GB/s "
          f"(memory read rate) -> {res['kv_floor_seconds']:.1f} s more")
    cols = [("pagedserve", ps)] + ([("transformers", hf)] if hf else [])
    print(f"\n{'':24}" + "".join(f"{name:>16}" for name, _ in cols))
    rows = [("seconds", "seconds", "{:.2f}"), ("total tokens/s", "total_tokens_per_s", "{:.1f}"),
            ("generated tokens/s", "generated_tokens_per_s", "{:.1f}"),
            ("of CPU ceiling", "ceiling_fraction", "{:.1%}"),
            ("  with the K/V reads", "ceiling_with_kv_reads_fraction", "{:.1%}"),
            ("other processes' CPU", "other_cpu_share", "{:.0%}")]
    for label, key, fmt in rows:
        print(f"{label:24}" + "".join(f"{_fmt(fmt, r[key]):>16}" for _, r in cols))
    kv_rows = [("KV peak slots", "peak_slots", "{:d}"), ("KV peak MiB", "peak_bytes", "{:.1f}"),
               ("KV waste at peak", "waste_at_peak", "{:.1%}")]
    for label, key, fmt in kv_rows:
        vals = [r["kv"][key] / (1 << 20) if key == "peak_bytes" else r["kv"][key] for _, r in cols]
        print(f"{label:24}" + "".join(f"{fmt.format(v):>16}" for v in vals))
    line = f"{'KV waste, whole run':24}{ps['kv']['waste_time_avg']:>16.1%}"
    print(line + (f"{hf['kv']['waste_all_batches']:>16.1%}" if hf else ""))
    print("  (pagedserve: slot-time weighted over steps; transformers: summed over its batches)")
    print(f"pagedserve pool: {ps['kv']['pool_blocks']} blocks = {ps['kv']['pool_bytes'] / (1 << 20):.0f} MiB "
          f"reserved; steps {ps['engine']['num_steps']}, preemptions {ps['engine']['num_preemptions']}, "
          f"prefix-cache hit tokens {ps['engine']['prefix_cache_hits']}")
    shares = [res["matmul_other_cpu_share"]] + [r["other_cpu_share"] for _, r in cols]
    if any(x is not None and x > _BUSY for x in shares):
        print(f"\nWARNING: other processes took over {_BUSY:.0%} of the cores during a timed section; "
              "torch's threads then wait on each other, so these timings can be many times too slow")
    if hf:
        agree = res["greedy_agreement"]
        print(f"\nspeedup pagedserve / transformers (total tokens/s): {res['speedup']:.2f}x")
        print(f"greedy outputs identical: {agree['identical_requests']}/{agree['requests']} requests, "
              f"mean common prefix {agree['mean_common_prefix_fraction']:.0%}")


def load_tokenizer_and_config():
    """The workload needs the model's tokenizer before any engine exists; the FLOP count needs
    its shapes."""
    from workers.gguf_cache import load_tokenizer
    from workers.model_config import load_hf_config

    src = resolve_model(MODEL)
    return load_tokenizer(src), load_hf_config(src)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars would bury the report
    # Before any model is loaded. The ceiling is the faster of the model dtype's matmul and
    # fp32's: a CPU without bf16 arithmetic computes bf16 layers fastest in fp32 (as pagedserve
    # does), so fp32's rate bounds them there.
    dtype_gflops, matmul_watch = matmul_gflops(TORCH_DTYPES[args.dtype])
    fp32_gflops = dtype_gflops if args.dtype == "float32" else matmul_gflops(torch.float32)[0]
    gflops = max(dtype_gflops, fp32_gflops)
    read_gbps = memory_read_gbps()
    tokenizer, hf_config = load_tokenizer_and_config()
    requests = make_workload(tokenizer, args)
    prompt, generated = useful_tokens(requests)
    per_prompt, per_generated = linear_flops_per_token(hf_config)
    total_flops = prompt * per_prompt + generated * per_generated
    ceiling_s = total_flops / (gflops * 1e9)

    res = {"args": vars(args), "dtype": args.dtype, "model": MODEL,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
           "workload": {"num_requests": len(requests), "prompt_tokens": prompt,
                        "generated_tokens": generated, "seed": args.seed,
                        "prompt_lens": [len(r.prompt_ids) for r in requests],
                        "output_lens": [r.max_tokens for r in requests]},
           "matmul_gflops": gflops, "matmul_gflops_dtype": dtype_gflops, "matmul_gflops_fp32": fp32_gflops,
           "matmul_other_cpu_share": matmul_watch.other_cpu_share,
           "ceiling_seconds": ceiling_s,
           "flops": {"per_prompt_token": per_prompt, "per_generated_token": per_generated,
                     "total": total_flops}}
    ps = run_pagedserve(args, requests)
    # Both engines keep K/V in the model dtype, so they read the same bytes a cached token.
    kv_read = decode_kv_bytes(requests, ps["kv"]["bytes_per_token_slot"])
    kv_floor_s = kv_read / (read_gbps * 1e9)
    res.update(memory_read_gbps=read_gbps, kv_read_bytes=kv_read, kv_floor_seconds=kv_floor_s)
    res["pagedserve"] = {**throughput(ps["watch"], prompt, generated, ceiling_s, kv_floor_s),
                         "kv": ps["kv"], "engine": ps["engine"]}
    if not args.skip_baseline:
        hf = run_transformers(args, requests)
        res["transformers"] = {**throughput(hf["watch"], prompt, generated, ceiling_s, kv_floor_s),
                               # same model and dtype, so the same bytes per cached token
                               "kv": hf_kv(requests, args.batch_size, ps["kv"]["bytes_per_token_slot"])}
        res["speedup"] = (res["pagedserve"]["total_tokens_per_s"]
                          / res["transformers"]["total_tokens_per_s"])
        res["greedy_agreement"] = greedy_agreement(ps["outputs"], hf["outputs"])
    print_report(res)
    write_json(res, args.result_json)


def write_json(res: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
