"""Compile every Triton kernel for a Hopper GPU (sm_90) on a machine without one: the checks a
device run would otherwise spend its minutes on (syntax the interpreter lets through, shared
memory per block), for Llama-3-8B's heads and SmolLM2's, bf16 and fp32. Run with TRITON_INTERPRET
unset; prints one line per kernel and exits 1 on the first failure.

    python benchmarks/gpu/compile_check.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHARED_MEMORY_PER_SM = 228 * 1024  # an H100/H200's
HEAD_LAYOUTS = {"llama-3-8b": (4, 128), "smollm2-135m": (3, 64)}  # (query heads per KV head, head dim)


def _signature(kernel, pointer: str, constants: dict, **types) -> dict:
    """Every argument typed: pointers to the activations' dtype unless `types` says otherwise,
    strides i32 (the block stride i64: a cache passes 2**31 elements), the scale fp32."""
    out = {}
    for name in kernel.arg_names:
        if name in constants:
            out[name] = "constexpr"
        elif name in types:
            out[name] = types[name]
        elif name.endswith("_ptr"):
            out[name] = pointer
        else:
            out[name] = "fp32" if name == "scale" else "i64" if name == "stride_block" else "i32"
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton.attention import _decode_dot_kernel, _decode_kernel, _prefill_kernel
    from kernels.triton.write_kv import _write_kv_kernel

    tables = {"tables_ptr": "*i32", "query_start_ptr": "*i32", "query_lens_ptr": "*i32", "context_lens_ptr": "*i32",
              "rows_ptr": "*i64", "slot_ptr": "*i64", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    for dtype in ("bf16", "fp32"):
        precision = "ieee" if dtype == "fp32" else "tf32"
        for layout, (rep, head_dim) in HEAD_LAYOUTS.items():
            shape = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, D_PAD=head_dim)
            dots = dict(DOT_PRECISION=precision, DOT_IN_FP32=False)
            for kernel, constants in [
                (_prefill_kernel, dict(REP=rep, BLOCK_M=16, BLOCK_N=32, **dots, **shape)),
                (_decode_kernel, dict(NUM_HEADS=8 * rep, NUM_SPLITS=4, REP=rep, REP_PAD=4, BLOCK_N=32, **shape)),
                (_decode_dot_kernel, dict(NUM_HEADS=8 * rep, NUM_SPLITS=4, REP=rep, GROUP=16, BLOCK_N=64, **dots,
                                          **shape)),
                (_write_kv_kernel, dict(BLOCK_SIZE=16, ROW=8 * head_dim, ROW_PAD=8 * head_dim)),
            ]:
                name = f"{kernel.__name__} {dtype} {layout}"
                try:
                    compiled = triton.compile(ASTSource(kernel, _signature(kernel, f"*{dtype}", constants, **tables),
                                                        constants), target=GPUTarget("cuda", 90, 32))
                except Exception as e:
                    print(f"FAILED {name}: {e!r}")
                    return 1
                shared = compiled.metadata.shared
                if ".target sm_90" not in compiled.asm["ptx"] or shared > SHARED_MEMORY_PER_SM:
                    print(f"FAILED {name}: shared memory {shared} bytes, or not built for sm_90")
                    return 1
                print(f"compiled {name}: shared memory {shared} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
