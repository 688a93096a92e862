"""A CPU model's weights moved onto transparent huge pages (2 MiB), in one mapping.

A decode step of a few rows streams every weight from memory once. On 4 KiB pages that stream
takes a page walk every 4 KiB (SmolLM2 fp32: ~140k pages a step); torch's allocator asks for huge
pages only when THP_MEM_ALLOC_ENABLE was set before torch was imported, and then only for tensors
of 2 MiB or more. Measured on this 2-core VM (THP "madvise" mode): SmolLM2's 30 layers of fp32
linear weights at 4 rows, 2 threads, 27.1 ms on 4 KiB pages against 24.7 ms on huge pages (1
thread: 54.7 against 49.3 ms); at 32 rows and more the GEMMs are compute-bound and the pages make
no measurable difference.

So after loading, every weight and buffer of the model is copied into one anonymous mapping
advised MADV_HUGEPAGE and the tensors are re-pointed at it. SmolLM2 fp32 through the offline
API (benchmarks/huge_pages.py): one stream decoded 26.7 tok/s before, 32.3 after; four streams
91.4 before, 99.0 after. Tensors that share a storage (tied embeddings) keep sharing it. Where
the kernel gives no transparent huge pages ("never", or no THP at all) nothing is moved.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

import torch
from torch import nn

from workers.kv_cache import available_memory

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Each storage starts on its own 4 KiB page, so no two storages share a cache line or a page.
STORAGE_ALIGN = 4096
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "unavailable"."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def huge_pages_available() -> bool:
    """Whether a mapping advised MADV_HUGEPAGE gets huge pages here."""
    return transparent_huge_pages() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory starting on a 2 MiB boundary, in a mapping advised MADV_HUGEPAGE
    (the tensor holds the mapping: it is unmapped with its last view)."""
    pages = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_meta and t.numel() > 0


class HugePageMove:
    """Moves the model's CPU parameters and buffers into one huge-page mapping (see the module
    docstring) on a thread of its own, off the start's critical path: on this VM a huge page's
    first touch costs 2-3 ms, 0.5-0.7 s for SmolLM2's 514 MB, where the rest of the load takes
    ~0.4 s. Steps meanwhile run on the weights as loaded (nothing writes them, so the copy reads
    them as the steps do). Once copied, the thread takes `step_lock`, which the caller holds
    around every step, re-points the tensors and lets the old storages go: an idle server does
    not hold the weights twice waiting for a step. A server serves meanwhile; the offline `LLM`
    waits for it (`Worker.wait_for_weights`), and each step reports whether it still ran
    (`StepOutput.weights_moving`)."""

    def __init__(self, model: nn.Module, step_lock: threading.Lock | None = None):
        self.bytes = 0
        self._thread = None
        if not huge_pages_available():
            return
        # (module, name, is a parameter, tensor); a tensor reached through two modules (tied
        # embeddings) is listed at each, and moved once.
        self._slots: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if _movable(p):
                    self._slots.append((module, name, True, p))
            for name, b in module.named_buffers(recurse=False):
                if b is not None and _movable(b):
                    self._slots.append((module, name, False, b))
        # storage address -> (its offset in the mapping, the storage, held alive until moved)
        self._offsets: dict[int, tuple[int, torch.UntypedStorage]] = {}
        for *_, t in self._slots:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._offsets:
                self._offsets[storage.data_ptr()] = (self.bytes, storage)
                self.bytes += -(-storage.nbytes() // STORAGE_ALIGN) * STORAGE_ALIGN
        if self.bytes == 0:
            return
        available = available_memory()
        if available is not None and self.bytes > available // 2:
            # The copy holds the weights twice until it is taken up, and the KV pool still needs room.
            log.warning("weights stay on the pages they were loaded into: a second copy (%d bytes) would take "
                        "over half of this node's available memory (%d bytes)", self.bytes, available)
            self.bytes = 0
            return
        try:
            self._arena = huge_page_bytes(self.bytes)
        except OSError as e:  # the mapping refused: the weights stay where they are
            log.warning("weights stay on the pages they were loaded into: %s", e)
            self.bytes = 0
            return
        self._step_lock = step_lock or threading.Lock()
        # Not a daemon: a process that exits mid-move waits for it (under a second), where a daemon
        # thread still in torch's code as the interpreter finalizes aborts the process.
        self._thread = threading.Thread(target=self._move, name="weights-to-huge-pages")
        self._thread.start()

    def _move(self) -> None:
        try:
            self._copy_and_repoint()
        except Exception:  # the weights stay where they were loaded, and serve as they did
            log.exception("moving the weights onto huge pages failed; they stay where they were loaded")
            self.bytes = 0

    def _copy_and_repoint(self) -> None:
        base = self._arena.data_ptr()
        for offset, storage in self._offsets.values():
            # ctypes.memmove releases the GIL, and starts no torch thread pool on this thread.
            ctypes.memmove(base + offset, storage.data_ptr(), storage.nbytes())
        moved: dict[int, torch.Tensor] = {}  # id(tensor) -> its view of the mapping
        for *_, t in self._slots:
            if id(t) not in moved:
                offset, storage = self._offsets[t.untyped_storage().data_ptr()]
                elements = self._arena[offset:offset + storage.nbytes()].view(t.dtype)
                moved[id(t)] = elements.as_strided(t.shape, t.stride(),
                                                   elements.storage_offset() + t.storage_offset())
        with self._step_lock, torch.no_grad():
            for module, name, is_param, t in self._slots:
                if is_param:
                    t.data = moved[id(t)]  # the same Parameter object: tied modules keep sharing it
                else:
                    module._buffers[name] = moved[id(t)]
        self._slots, self._offsets, self._arena = [], {}, None  # the old storages go with them

    def running(self) -> bool:
        """Whether the copy is still under way."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the move; returns the bytes moved (0 where the kernel has no transparent huge
        pages). Not from inside a step: the move waits for the step lock."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the weights' move to huge pages took over {timeout} s")
        return self.bytes


def move_to_huge_pages(model: nn.Module) -> int:
    """The whole move, waited for (`HugePageMove`); returns the bytes moved."""
    return HugePageMove(model).wait()
