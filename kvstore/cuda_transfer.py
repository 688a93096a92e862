"""GPU side of swaps: the store's shared-memory segment page-locked for DMA (CuPy registers it:
torch has no call for registering memory it did not allocate), and the copies on a side CUDA
stream, so that they are asynchronous to the host and the step's own work is queued meanwhile.

Ordering: the side stream first waits for the compute stream (the blocks it reads were written by
earlier forward passes), and the compute stream waits for the side stream before the step's
forward pass (a swapped-out block may be reused, and a swapped-in one read, in the same step).
`finish()` blocks the host until the copies are done; the worker calls it before returning the
step, so the store's data is complete whenever the coordinator sees the step as executed.
"""

from __future__ import annotations

import torch


class PinnedTransfers:
    def __init__(self, host_buffer):
        import cupy

        self._pointer = host_buffer.ctypes.data if hasattr(host_buffer, "ctypes") else host_buffer
        self._size = host_buffer.nbytes
        cupy.cuda.runtime.hostRegister(self._pointer, self._size, 0)  # cudaHostRegisterDefault
        self.stream = torch.cuda.Stream()
        self._event = None

    def __enter__(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        self._context = torch.cuda.stream(self.stream)
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        torch.cuda.current_stream().wait_stream(self.stream)  # the forward pass comes after
        self._event = self.stream.record_event()
        return False

    def finish(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def close(self) -> None:
        import cupy

        self.finish()
        cupy.cuda.runtime.hostUnregister(self._pointer)
