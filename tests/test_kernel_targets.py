"""Every C kernel compiles cleanly for the x86 targets it has branches for, not only for this CPU.

The kernels choose their vector width and instructions at compile time (`#if __AVX512F__`,
`__AVX512BF16__`, `__AMX_TILE__`): a machine without AVX-512 builds and tests only its AVX2
branches, so an edit to the AVX-512 ones (a changed signature, a variable left unused) would first
show on the machine that runs them. This compiles each source for each target without linking or
running it: the branches' code is checked here, their results where they run.
"""

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kernels.cpu

SOURCES = sorted(Path(kernels.cpu.__file__).parent.glob("*.c"))
# AVX-512 with AMX and bf16 (a Xeon Sapphire Rapids), AVX-512 with bf16 but no AMX (Cooper Lake, as AMD Zen 4),
# AVX-512 without either (Ice Lake), AVX2 and FMA only (AMD Zen 3), and SSE4 only (the kernels'
# scalar fallbacks).
TARGETS = ("sapphirerapids", "cooperlake", "icelake-server", "x86-64-v3", "x86-64-v2")
COMPILER = shutil.which("gcc")

pytestmark = pytest.mark.skipif(
    COMPILER is None or platform.machine() not in ("x86_64", "AMD64"), reason="needs gcc for x86-64")


def _compile(source: Path, target: str, out: Path) -> subprocess.CompletedProcess:
    """`source` compiled for `target` to the object file `out`: the build's own flags, for another
    CPU, with every warning an error; -Wno-psabi: sum16.h's 16-float helpers are inline, so the ABI
    note GCC gives for them without AVX-512 does not apply."""
    flags = [f for f in kernels.cpu._FLAGS if f not in ("-march=native", "-shared")]
    command = [COMPILER, *flags, f"-march={target}", "-Wall", "-Werror", "-Wno-psabi", "-c", str(source)]
    return subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)


def test_the_sources_are_found():
    names = {path.name for path in SOURCES}
    assert {"paged_decode_attention.c", "paged_prefill_attention.c", "packed_gemm.c", "decoder_layer.c"} <= names


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_for_target(target, tmp_path):
    def compile_one(source: Path) -> str | None:
        result = _compile(source, target, tmp_path / f"{source.stem}.o")
        return None if result.returncode == 0 else f"{source.name}:\n{result.stderr[-1500:]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failures = [failure for failure in pool.map(compile_one, SOURCES) if failure]
    assert not failures, f"-march={target}:\n" + "\n".join(failures)


def test_a_broken_branch_fails_the_check(tmp_path):
    # The check sees inside a branch this CPU does not take: an unused variable in an AVX-512-only
    # block fails for the AVX-512 target and passes for AVX2.
    source = tmp_path / "branch.c"
    source.write_text("int f(int x) {\n#if defined(__AVX512F__)\n    int unused = x;\n#endif\n    return x;\n}\n")
    outputs = {target: _compile(source, target, tmp_path / "b.o").returncode
               for target in ("sapphirerapids", "x86-64-v3")}
    assert outputs == {"sapphirerapids": 1, "x86-64-v3": 0}


def test_a_library_built_for_one_cpu_is_not_taken_on_another(tmp_path, monkeypatch):
    # `-march=native` builds for the CPU at hand: a cache folder shared with another CPU (a home
    # directory on several machines, a VM moved to another host) must build again, not load
    # instructions that CPU may lack.
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 7; }\n")
    here = kernels.cpu._build(source)
    assert here is not None and kernels.cpu._build(source) == here  # the same CPU: built once
    monkeypatch.setattr(kernels.cpu, "cpu_signature", lambda: b"flags: another cpu")
    there = kernels.cpu._build(source)
    assert there is not None and there != here and here.exists()
