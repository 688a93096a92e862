"""The GPU device check (run by check.sh): kernels against the torch reference, decode attention
bandwidth against a device-to-device copy, and the offline workload end to end against
transformers `generate` on the same GPU, for SmolLM2's shape and Llama-3-8B's (random weights,
bf16). Prints a short table last and writes details under --out.

`--smoke` runs the same code on a CPU with tiny shapes (Triton under TRITON_INTERPRET=1), to check
the script itself where no GPU is at hand; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels.random_batch import shuffled_block_tables  # noqa: E402
from pagedserve.bench.dataset import BenchRequest  # noqa: E402

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab, rope theta)
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 100000.0),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0),
    "tiny": (64, 128, 2, 4, 2, 512, 10000.0),
    "llama-3-8b-2-layers": (1024, 3584, 2, 8, 2, 32000, 500000.0),  # the 8B's head layout, small enough for fp32
}
UNTIED = {"llama-3-8b", "llama-3-8b-2-layers"}  # an LM head of its own, as Llama-3-8B has


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/pagedserve-gpu-check")
    p.add_argument("--quick", action="store_true", help="kernels and decode timing only")
    p.add_argument("--skip-8b", action="store_true", help="no Llama-3-8B-shaped end-to-end run")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks this script")
    p.add_argument("--sections", default="kernels,decode,swap,exact,e2e",
                   help="comma-separated subset of kernels,decode,swap,exact,e2e (to rerun what failed)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds after which no further end-to-end shape starts (0: none)")
    return p.parse_args(argv)


# ---- 1. kernels against the reference ----------------------------------------------------------
def check_kernels(device: str, smoke: bool) -> list[dict]:
    from kernels import triton as tk

    heads, kv_heads, head_dim = (4, 2, 16) if smoke else (32, 8, 128)
    if smoke:
        query_lens, context_lens = [7, 5, 1, 1], [7, 30, 20, 45]
    else:  # a fresh prefill, chunks over cached context, short and long decodes (split-K)
        query_lens = [300, 128, 64] + [1] * 48
        context_lens = [300, 1000, 2100] + [random.Random(i).randint(16, 9000) for i in range(48)]
    reference = kernels.get_backend("torch", device, torch.float32)  # moves its metadata to the device
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block_size in (8, 16, 32):
            num_blocks = sum(-(-c // block_size) for c in context_lens) + 4
            tables, slots = shuffled_block_tables(gen, block_size, query_lens, context_lens, num_blocks)
            slots = torch.tensor(slots, dtype=torch.int64)
            cache = torch.randn((num_blocks, 2, block_size, kv_heads, head_dim), generator=gen).to(dtype)
            t = sum(query_lens)
            q = torch.randn((t, heads, head_dim), generator=gen).to(dtype)
            k, v = (torch.randn((t, kv_heads, head_dim), generator=gen).to(dtype) for _ in range(2))
            ql, cl = torch.tensor(query_lens, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32)
            # The oracle: the torch reference in fp32 on the same values.
            ref_cache = cache.float().to(device)
            ref_meta = reference.build_metadata(ql, cl, tables, slots, block_size)
            reference.write_kv(k.float().to(device), v.float().to(device), ref_cache, ref_meta)
            want = reference.paged_attention(q.float().to(device), k.float().to(device), v.float().to(device),
                                             ref_cache, ref_meta, head_dim ** -0.5)
            tri_cache = cache.to(device)
            meta = tk.build_metadata(ql, cl, tables, slots, device)
            tk.write_kv(k.to(device), v.to(device), tri_cache, meta.slot_mapping)
            write_ok = torch.equal(tri_cache.float(), ref_cache.to(tri_cache.dtype).float())
            rows.append({"kernel": "write_kv", "dtype": str(dtype).split(".")[-1], "block_size": block_size,
                         "rel_err": 0.0 if write_ok else 1.0, "ok": write_ok})
            for decode_kernel in tk.attention.DECODE_KERNELS:
                for splits in (None, 1, 4):
                    meta.num_splits, meta.decode_kernel = splits, decode_kernel
                    got = tk.paged_attention(q.to(device), tri_cache, meta, head_dim ** -0.5).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    ok = err < TOLERANCE[dtype] and not bool(got.isnan().any())
                    rows.append({"kernel": f"paged_attention (decode {decode_kernel}, splits {splits or 'auto'})",
                                 "dtype": str(dtype).split(".")[-1], "block_size": block_size, "rel_err": err,
                                 "ok": ok, "decode": decode_kernel})
    return rows


# ---- 2. decode attention bandwidth ---------------------------------------------------------------
def _time(fn, device: str) -> float:
    """Seconds per call: triton's do_bench on a GPU (median of many), a plain loop on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200) / 1000
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3


def time_decode(device: str, smoke: bool) -> dict:
    from kernels import triton as tk

    heads, kv_heads, head_dim, block_size = (4, 2, 16, 16) if smoke else (32, 8, 128, 16)
    batch, context = (4, 64) if smoke else (64, 4096)
    dtype = torch.bfloat16
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    cache = torch.randn((num_blocks, 2, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device="cpu").view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    meta = tk.build_metadata(torch.ones(batch, dtype=torch.int32), lens, tables,
                             tables[:, -1].long() * block_size + block_size - 1, device)
    q = torch.randn((batch, heads, head_dim), dtype=dtype, device=device)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * cache.element_size()  # K and V read once
    attn = _time(lambda: tk.paged_attention(q, cache, meta, head_dim ** -0.5), device)
    src = torch.empty(kv_bytes // 2, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy = _time(lambda: dst.copy_(src), device)
    copy_gb_s = 2 * kv_bytes / copy / 1e9  # a copy reads and writes every byte
    attn_gb_s = kv_bytes / attn / 1e9
    return {"batch": batch, "context": context, "kv_bytes": kv_bytes, "attention_ms": attn * 1e3,
            "attention_gb_s": attn_gb_s, "copy_gb_s": copy_gb_s, "share_of_copy": attn_gb_s / copy_gb_s,
            "num_splits": tk.attention.choose_num_splits(batch, kv_heads, context),
            "variants": _decode_variants(q, cache, meta, kv_bytes, smoke, device)}


def _decode_variants(q, cache, meta, kv_bytes: int, smoke: bool, device: str) -> list[dict]:
    """Each decode kernel alone (no combine) at other tiles, warps, pipeline stages and splits:
    what to tune, and which kernel to make the default. GB/s of K/V read per variant."""
    import triton

    from kernels.triton import attention as ta

    batch, heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = cache.shape
    rep = heads // kv_heads
    strides = (cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3))
    shapes = {"sum": {"REP_PAD": triton.next_power_of_2(rep)},
              "dot": {"GROUP": max(16, triton.next_power_of_2(rep)), **ta._dot_options(q, cache)}}
    if smoke:
        variants = [("sum", 32, 4, 1, 1), ("dot", 32, 4, 1, 2)]
    else:  # (kernel, BLOCK_N, warps, stages, splits)
        variants = [("sum", 32, 4, 1, 1), ("sum", 16, 4, 4, 1), ("sum", 16, 4, 4, 4),
                    ("dot", 32, 4, 3, 1), ("dot", 64, 4, 3, 1), ("dot", 128, 4, 3, 1), ("dot", 64, 8, 3, 1),
                    ("dot", 32, 4, 3, 4), ("dot", 64, 4, 3, 4), ("dot", 64, 4, 3, 8)]
    rows = []
    for kernel, block_n, warps, stages, splits in variants:
        acc = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=device)
        ml = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=device)
        fn = ta._decode_dot_kernel if kernel == "dot" else ta._decode_kernel

        def launch():
            fn[(batch, kv_heads, splits)](
                q, cache, acc, ml, meta.decode_block_tables, meta.decode_rows, meta.decode_context_lens,
                head_dim ** -0.5, q.stride(0), q.stride(1), *strides, meta.decode_block_tables.stride(0),
                NUM_HEADS=heads, NUM_SPLITS=splits, REP=rep, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **shapes[kernel])
        row = {"kernel": kernel, "block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits}
        try:
            seconds = _time(launch, device)
            rows.append({**row, "ms": seconds * 1e3, "gb_s": kv_bytes / seconds / 1e9})
        except Exception as e:  # a variant that does not compile (registers, shared memory) is a result too
            rows.append({**row, "error": repr(e)[:300]})
    return rows


# ---- 2b. swap through the KV store's segment ------------------------------------------------------
def time_swap(device: str, smoke: bool) -> dict:
    """256 SmolLM2-sized blocks out to the store's page-locked segment and back (kvstore/shm_transport.py
    ShmSwapSpace with kvstore/cuda_transfer.py), checked exact, against a plain device-to-host copy
    of the same bytes into ordinary (pageable) memory."""
    from kvstore.shm_transport import ShmSwapSpace
    from kvstore.store import KVStore

    blocks = 16 if smoke else 256
    cache = torch.randn((blocks, 30, 2, 16, 3, 64), device=device)
    block_bytes = cache[0].numel() * cache.element_size()
    store = KVStore(blocks, 1, block_bytes)
    try:
        space = ShmSwapSpace(store.layout, 0, cache)
        pairs = [(b, b) for b in range(blocks)]

        def out():
            space.swap_out(pairs)
            space.finish()

        def back():
            space.swap_in(pairs, release=False)
            space.finish()

        snapshot = cache.clone()
        t_out = _time(out, "cpu")  # host-synchronized by finish(): wall time is the transfer time
        cache.zero_()
        t_in = _time(back, "cpu")
        exact = bool(torch.equal(cache, snapshot))
        space.close()
    finally:
        store.close()
    pageable = torch.empty(cache.shape, dtype=cache.dtype)
    t_plain = _time(lambda: pageable.copy_(cache), "cpu")
    total = blocks * block_bytes
    return {"bytes": total, "exact": exact, "swap_out_gb_s": total / t_out / 1e9, "swap_in_gb_s": total / t_in / 1e9,
            "pageable_copy_gb_s": total / t_plain / 1e9}


# ---- 3. end to end against transformers ----------------------------------------------------------
def make_random_model(shape: str, folder: Path, dtype: torch.dtype, device: str) -> str:
    """A Llama of the named shape with random weights, and a word-level tokenizer over its whole
    vocabulary (no hub: the prompts are token ids; the tokenizer only has to decode them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, inter, layers, heads, kv_heads, vocab, theta = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         rope_theta=theta, max_position_embeddings=8192, tie_word_embeddings=shape not in UNTIED,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                            pad_token="w0").save_pretrained(folder)
    return str(folder)


def workload(vocab: int, num: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(num)]


def _run_ours(path: str, requests, device: str, smoke: bool, eager: bool, decode_kernel: str) -> dict:
    """The workload through `LLM` (CUDA graphs of decode steps unless `eager`; the Triton decode
    kernel `decode_kernel`): seconds, outputs, stats."""
    from kernels.triton import attention

    saved, attention.DEFAULT_DECODE_KERNEL = attention.DEFAULT_DECODE_KERNEL, decode_kernel
    try:
        return _timed_run(path, requests, device, smoke, eager)
    finally:
        attention.DEFAULT_DECODE_KERNEL = saved


def _timed_run(path: str, requests, device: str, smoke: bool, eager: bool) -> dict:
    from pagedserve import LLM, SamplingParams

    engine = {"device": device, "dtype": "float32" if smoke else "bfloat16", "enforce_eager": eager}
    if not smoke:
        engine.update(gpu_memory_utilization=0.85, max_num_seqs=256, max_num_batched_tokens=8192)
    loading = time.perf_counter()
    with LLM(path, **engine) as llm:
        load_s = time.perf_counter() - loading
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": seconds, "load_s": load_s, "outputs": [o.outputs[0].token_ids for o in outs], "stats": stats}


def end_to_end(shape: str, device: str, smoke: bool, errors: dict) -> dict:
    """pagedserve with CUDA graphs (and, for the small shape, eager too: what graphs buy) against
    transformers. A failed graphs run is recorded in `errors` and the eager run still measured."""
    from pagedserve.bench.hf_baseline import run_transformers

    dtype = torch.float32 if smoke else torch.bfloat16
    num, prompt, output, batch = (6, (8, 24), (4, 8), 3) if smoke else (256, (128, 512), (64, 256), 32)
    requests = workload(SHAPES[shape][5], num, prompt, output)
    useful = sum(r.max_tokens for r in requests)
    # (eager, decode kernel): graphs with each decode kernel; eager too on the small shape
    modes = {"graphs": (False, "sum"), "graphs-dot": (False, "dot")}
    if shape != "llama-3-8b":
        modes["eager"] = (True, "sum")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        made = time.perf_counter()
        path = make_random_model(shape, Path(tmp), dtype, device)
        made = time.perf_counter() - made
        for mode, (eager, decode_kernel) in modes.items():
            try:
                runs[mode] = _run_ours(path, requests, device, smoke, eager, decode_kernel)
            except Exception:
                errors[f"e2e {shape} {mode}"] = traceback.format_exc()
                print(errors[f"e2e {shape} {mode}"], flush=True)
                if mode == "graphs" and "eager" not in modes:
                    runs["eager"] = _run_ours(path, requests, device, smoke, True, "sum")
        hf = run_transformers(path, requests, batch, dtype, device)
    result = {"shape": shape, "requests": num, "output_tokens": useful, "model_write_s": made,
              "transformers_s": hf["seconds"], "transformers_tok_s": hf["output_token_throughput"], "hf_batch": batch}
    for mode, run in runs.items():
        result[mode] = {"seconds": run["seconds"], "tok_s": useful / run["seconds"], "load_s": run["load_s"],
                        "speedup": hf["seconds"] / run["seconds"],
                        "identical_greedy_outputs": sum(a == b for a, b in zip(run["outputs"], hf["outputs"])),
                        **_agreement(run["outputs"], hf["outputs"]),
                        "kv_blocks_total": run["stats"]["kv_blocks_total"],
                        "kv_blocks_peak_used": run["stats"]["kv_blocks_peak_used"]}
    best = result.get("graphs") or result.get("eager")
    if best:  # the headline figures: graphs when they ran
        result.update(pagedserve_s=best["seconds"], pagedserve_tok_s=best["tok_s"], speedup=best["speedup"],
                      identical_greedy_outputs=best["identical_greedy_outputs"])
    return result


def exactness(device: str, smoke: bool) -> dict:
    """Greedy outputs token for token against transformers in fp32 on the same device (the GPU's
    matmuls without TF32, the kernels' dots in IEEE fp32): random bf16 weights leave near-ties
    that rounding flips, fp32 ones far fewer. The 8B's head layout (4 query heads per KV head,
    head dim 128, untied head, RoPE theta 5e5) on 2 layers, and SmolLM2's shape."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.hf_baseline import run_transformers

    shapes = ["tiny"] if smoke else ["llama-3-8b-2-layers", "smollm2-135m"]
    results = {}
    for shape in shapes:
        requests = workload(SHAPES[shape][5], 16, (64, 200), (32, 32), seed=1)
        with tempfile.TemporaryDirectory() as tmp:
            path = make_random_model(shape, Path(tmp), torch.float32, device)
            engine = {"device": device, "dtype": "float32", "max_num_seqs": 16}
            if not smoke:
                engine["gpu_memory_utilization"] = 0.5
            with LLM(path, **engine) as llm:
                outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests],
                                    [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                                     for r in requests], use_tqdm=False)
            gc.collect()
            hf = run_transformers(path, requests, 16, torch.float32, device)["outputs"]
        ours = [o.outputs[0].token_ids for o in outs]
        results[shape] = {"requests": len(requests), "identical": sum(a == b for a, b in zip(ours, hf)),
                          **_agreement(ours, hf)}
    return results


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far greedy outputs agree before they part. Random bf16 weights give nearly flat logits,
    where the two engines' different (equally valid) rounding flips near-ties: whole-output
    identity then says little, the first token and the shared prefix more."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(ours, theirs)]
    return {"same_first_token": sum(bool(x) and bool(y) and x[0] == y[0] for x, y in zip(ours, theirs)),
            "mean_shared_prefix": sum(prefixes) / max(len(prefixes), 1)}


def _section(results: dict, out: Path, name: str, fn):
    """Run one part of the check; a failure is recorded (and printed) and the rest still runs."""
    start = time.perf_counter()
    try:
        value = fn()
    except Exception:
        results["errors"][name] = traceback.format_exc()
        print(results["errors"][name], flush=True)
        value = None
    results["seconds"][name] = round(time.perf_counter() - start, 1)
    print(f"[{name}: {results['seconds'][name]} s]", flush=True)
    (out / "details.json").write_text(json.dumps(results, indent=2))
    return value


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on a CPU (TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    print("environment:", env, flush=True)
    began = time.perf_counter()
    sections = set(args.sections.split(","))
    results = {"environment": env, "errors": {}, "seconds": {}}
    if "kernels" in sections:
        results["kernels"] = _section(results, out, "kernels", lambda: check_kernels(device, args.smoke)) or []
    if "decode" in sections:
        results["decode"] = _section(results, out, "decode", lambda: time_decode(device, args.smoke))
    if "swap" in sections:
        results["swap"] = _section(results, out, "swap", lambda: time_swap(device, args.smoke))
    if "exact" in sections and not args.quick:
        results["exact"] = _section(results, out, "exact", lambda: exactness(device, args.smoke))
    if "e2e" in sections and not args.quick:
        shapes = ["tiny"] if args.smoke else ["smollm2-135m"] + ([] if args.skip_8b else ["llama-3-8b"])
        results["end_to_end"] = []
        for shape in shapes:
            if args.deadline and time.perf_counter() - began > args.deadline:
                results["errors"][f"e2e {shape}"] = f"skipped: past the {args.deadline:.0f} s deadline"
                continue
            e = _section(results, out, f"e2e {shape}",
                         lambda: end_to_end(shape, device, args.smoke, results["errors"]))
            if e:
                results["end_to_end"].append(e)
                print("end to end:", e, flush=True)
            (out / "details.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    bad = [r for r in results.get("kernels", []) if not r["ok"]]
    swap = results.get("swap")
    print(f"\nkernel checks failed: {len(bad)} of {len(results.get('kernels', []))}; "
          f"sections that raised: {sorted(results['errors']) or 'none'}; details: {out / 'details.json'}")
    return 1 if bad or results["errors"] or (swap and not swap["exact"]) else 0


def print_table(results: dict) -> None:
    worst = {}
    for r in results.get("kernels", []):
        key = (r["kernel"].split(" ")[0] + (f" (decode {r['decode']})" if "decode" in r else ""), r["dtype"])
        worst[key] = max(worst.get(key, 0.0), r["rel_err"])
    print()
    print("| check | figure | target |")
    print("|---|---|---|")
    for (kernel, dtype), err in sorted(worst.items()):
        target = TOLERANCE[getattr(torch, dtype)]
        splits = ", splits auto/1/4" if kernel.startswith("paged") else ""
        print(f"| {kernel} {dtype} (block 8/16/32{splits}) | max relative error {err:.2e} | < {target:g} |")
    decode = results.get("decode")
    if decode:
        print(f"| decode attention, {decode['batch']} x {decode['context']} tokens, bf16 | "
              f"{decode['attention_gb_s']:.0f} GB/s = {100 * decode['share_of_copy']:.0f}% of copy "
              f"({decode['copy_gb_s']:.0f} GB/s) | >= 70% |")
        for v in decode.get("variants", []):
            figure = f"{v['gb_s']:.0f} GB/s ({v['ms']:.3f} ms)" if "gb_s" in v else v["error"][:60]
            print(f"| decode kernel {v['kernel']} alone, BLOCK_N {v['block_n']}, {v['num_warps']} warps, "
                  f"{v['num_stages']} stages, {v['splits']} splits | {figure} | - |")
    swap = results.get("swap")
    if swap:
        print(f"| swap, {swap['bytes'] / 1e6:.0f} MB, page-locked segment, side stream | out "
              f"{swap['swap_out_gb_s']:.1f} GB/s, in {swap['swap_in_gb_s']:.1f} GB/s (pageable copy "
              f"{swap['pageable_copy_gb_s']:.1f}); exact {swap['exact']} | - |")
    for shape, e in (results.get("exact") or {}).items():
        print(f"| greedy fp32 vs transformers, {shape}, {e['requests']} x 32 tokens | {e['identical']}/"
              f"{e['requests']} identical (first token {e['same_first_token']}, shared prefix "
              f"{e['mean_shared_prefix']:.1f}) | all identical |")
    for e in results.get("end_to_end", []):
        for mode in ("graphs", "graphs-dot", "eager"):
            if mode in e:
                m = e[mode]
                print(f"| {e['shape']} end to end, {e['requests']} req, {mode} | {m['tok_s']:.0f} vs "
                      f"{e['transformers_tok_s']:.0f} output tok/s = {m['speedup']:.1f}x "
                      f"({m['identical_greedy_outputs']}/{e['requests']} same, {m['same_first_token']} same first "
                      f"token, shared prefix {m['mean_shared_prefix']:.0f}) | >= 10x |")


if __name__ == "__main__":
    sys.exit(main())
