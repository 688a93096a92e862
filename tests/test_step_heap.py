"""A bf16 CPU worker keeps freed activations in glibc's heap for the next step
(workers/step_heap.py): a block that glibc would map afresh and unmap on every step (above its
32 MiB mmap ceiling, or at the heap's top beyond its trim threshold) is reused, without a page
fault per 4 KiB; an fp32 worker keeps glibc's defaults.

Each case runs in an interpreter of its own: the settings are process-wide."""

import ast
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's heap")

STEPS_MIB = (48, 40, 36, 34)
# Faults of each step after SETUP: a step of 48 MiB of activations, then smaller ones, each freed
# at its end. Unset, glibc maps every block above 32 MiB afresh and unmaps it when freed.
SCRIPT = r"""
import resource, torch
SETUP
def faults_of_a_step(mib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(mib << 18, dtype=torch.float32)
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print("faults:", [faults_of_a_step(mib) for mib in STEPS_MIB], flush=True)
""".replace("STEPS_MIB", repr(STEPS_MIB))


def _pages(mib: int) -> int:
    return (mib << 20) // 4096


def _faults(setup: str, **env) -> list[int]:
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("SETUP", setup)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("faults:"))
    return ast.literal_eval(line.split(":", 1)[1].strip())


def test_without_it_every_step_faults_its_activations_in_afresh():
    assert all(count >= _pages(mib) * 0.9 for mib, count in zip(STEPS_MIB, _faults("")))


def test_with_it_a_step_reuses_the_pages_the_last_one_freed():
    setup = ("from workers.step_heap import keep_freed_memory_for_steps\n"
             "assert keep_freed_memory_for_steps()")
    first, *rest = _faults(setup)
    assert first >= _pages(STEPS_MIB[0]) * 0.9  # the heap grows once
    assert all(count < _pages(STEPS_MIB[0]) * 0.05 for count in rest), rest


def test_a_process_whose_environment_tunes_glibc_keeps_its_own_settings():
    setup = ("from workers.step_heap import keep_freed_memory_for_steps\n"
             "assert not keep_freed_memory_for_steps()")
    # glibc's own variable (a trim threshold), which leaves its mmap threshold as it was
    faults = _faults(setup, MALLOC_TRIM_THRESHOLD_=str(8 << 20))
    assert all(count >= _pages(mib) * 0.9 for mib, count in zip(STEPS_MIB, faults))


@pytest.mark.parametrize("dtype, kept", [("bfloat16", True), ("float32", False)])
def test_a_bf16_cpu_worker_sets_it_once_its_cache_is_allocated(tiny_llama, dtype, kept):
    setup = (f"from pagedserve import LLM\n"
             f"llm = LLM({tiny_llama!r}, dtype={dtype!r}, kv_cache_memory=1 << 22,\n"
             f"          distributed_executor_backend='uni')\n"
             f"llm.generate(['hello'])")
    _first, *rest = _faults(setup)
    if kept:
        assert all(count < _pages(STEPS_MIB[0]) * 0.05 for count in rest), rest
    else:
        assert all(count >= _pages(mib) * 0.9 for mib, count in zip(STEPS_MIB[1:], rest)), rest
