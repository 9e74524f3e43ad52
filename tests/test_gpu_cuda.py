"""CUDA-only checks; they run on the device machine (pytest -m gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from kvcached.backends.cuda import CudaBackend
from kvcached.conformance import ConformanceSuite

pytestmark = pytest.mark.gpu

if CudaBackend.unavailable_reason() is not None:
    pytest.skip(f"cuda: {CudaBackend.unavailable_reason()}", allow_module_level=True)


class TestCudaConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self) -> Callable[..., CudaBackend]:
        return CudaBackend

    @pytest.fixture
    def exhaustible_backend(self):  # the real device is filled
        backend = CudaBackend()
        yield backend
        backend.close()


_FORK_PROGRAM = textwrap.dedent(
    """
    import os, sys
    import kvcached
    from kvcached import registry
    PARENT_INIT = sys.argv[1] == "init-in-parent"
    assert registry.resolve_name() == "cuda"      # detection runs in the parent
    if PARENT_INIT:
        from cuda.bindings import driver
        driver.cuInit(0)                           # what detection must never do
    pid = os.fork()
    if pid == 0:
        try:
            backend = kvcached.get_backend()
            g = backend.granularity
            with backend.reserve(2 * g) as r, backend.create(g) as p:
                backend.map(r, 0, p)
                import torch
                view = backend.view(r, 0, (g,), "uint8")
                view.fill_(7)
                torch.cuda.synchronize()
                ok = int(view.sum().item()) == 7 * g
                backend.unmap(r, 0, g)
            os._exit(0 if ok else 3)
        except BaseException as exc:
            print("child failed:", repr(exc), flush=True)
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status))
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def _fork_run(mode: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVCACHED_BACKEND="")
    return subprocess.run(
        [sys.executable, "-c", _FORK_PROGRAM, mode], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


def test_import_and_detection_in_parent_leave_forked_child_able_to_use_cuda() -> None:
    result = _fork_run("detect-only")
    assert result.returncode == 0, result.stdout + result.stderr


def test_fork_check_detects_a_parent_that_initialised_cuda() -> None:
    """Control: the same program fails when the parent calls cuInit, so the check above
    really exercises the fork hazard."""
    result = _fork_run("init-in-parent")
    assert result.returncode != 0, result.stdout + result.stderr


def test_views_are_on_the_selected_device() -> None:
    import torch

    with CudaBackend() as backend:
        g = backend.granularity
        with backend.reserve(2 * g) as r, backend.create(2 * g) as p:
            backend.map(r, 0, p)
            view = backend.view(r, 0, (g // 2, 2), torch.bfloat16)
            assert view.device == torch.device(backend.device)
            assert view.data_ptr() == r.address
            view.copy_(torch.ones_like(view))
            assert float(view.float().sum()) == g
            backend.unmap(r, 0, 2 * g)


def test_a_part_on_the_device_places_absolute_storage_offsets_inside_itself() -> None:
    # vLLM 0.26 views a Gated DeltaNet layer's state in its buffer with
    # torch.as_strided(buffer, ..., storage_offset=k): k counts from the buffer's own
    # storage. On the device a part must start its storage where it lies, so such a view
    # of the second part lands in the second part, not in the first
    import torch

    from kvcached.allocator import PageAllocator
    from kvcached.backing import BackingBuffer

    with CudaBackend() as backend:
        g = backend.granularity
        blocks = 4
        with BackingBuffer(
            backend, nbytes=2 * blocks * g, num_blocks=blocks, block_bytes=g,
            segment_offsets=[0, blocks * g],
        ) as buf:  # fmt: skip
            alloc = PageAllocator(
                buf.group, extent_bytes=g, pool_low=0, pool_high=0, background=False
            )
            assert alloc.alloc(blocks) == list(range(blocks))  # every block mapped
            first, second = buf.part(0, blocks * g), buf.part(blocks * g, blocks * g)
            assert second.device == torch.device(backend.device)
            assert second.storage_offset() == 0
            assert second.data_ptr() == buf.raw("int8").data_ptr() + blocks * g
            first.zero_()
            second.zero_()
            placed = torch.as_strided(second, (16,), (1,), storage_offset=g)
            placed.fill_(7)
            torch.cuda.synchronize()
            assert int(second[g : g + 16].sum()) == 7 * 16  # where the offset says
            assert int(first.abs().sum()) == 0  # the first part untouched
            alloc.close()
