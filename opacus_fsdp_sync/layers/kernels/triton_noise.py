"""A Triton kernel for the noised gradient: ``out = factor * g + std * z``, ``z`` drawn inside.

Imported only where Triton imports (:mod:`opacus_fsdp_sync.optimizers.noise_kernel` decides).
The DP step's noise otherwise takes a draw into a buffer the size of every local gradient (4.9 GB
in fp32 for Llama-3.2-1B on one GPU) and an add that reads it back; here each program draws its
normals in registers and writes the noised gradient once, reading the gradient once.

One launch covers a list of same-dtype tensors: a table of their data pointers, and per program
the tensor and the first element it handles (``BLOCK`` elements of one tensor), so a tensor's
tail never shares a program with the next tensor. The output is one flat buffer in the tensors'
order.

The normals: Philox-4x32-10 (``tl.philox``, the generator torch's CUDA ``normal_`` also builds
on) keyed by a 62-bit key, its 128-bit counter the program's index times ``BLOCK / 4`` plus the
lane (two words: unique within a launch) and a 62-bit nonce (the other two words). Key and
nonce are read from device memory (no host synchronisation); the caller draws both at every
launch, so two launches share noise only if 124 random bits repeat. Each counter's four 32-bit
words make two pairs, each turned into two normals by Box-Muller as curand (torch's CUDA
``normal_``) does: ``u1 = (x1 + 0.5) / 2^32`` in ``(0, 1]`` (fp32), so ``|z| <= sqrt(2 ln
2^33) = 6.76`` on both paths, and ``u2 = x2 / 2^32`` for the angle. The noise of an element
depends on the key, the nonce, the tensors' sizes and ``BLOCK``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_linear import _to

#: Elements per program on CUDA / under the CPU interpreter (four times a power of two: four
#: normals per Philox counter, ``tl.arange`` over a quarter).
BLOCK_CUDA = 4096
INTERPRETER_BLOCK = 256


@triton.jit
def _normal_pair(x1, x2):
    """Two standard normals from two uint32 words (Box-Muller, ``u1`` in ``(0, 1]``)."""
    u1 = (x1.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    u2 = x2.to(tl.float32) * 2.3283064365386963e-10
    r = tl.sqrt(-2.0 * tl.log(u1))
    theta = 6.283185307179586 * u2
    return r * tl.cos(theta), r * tl.sin(theta)


@triton.jit
def _noised_quarter(
    g_ptr, out_ptr, start, first, n, part, lane, z, factor, std,
    UPCAST: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """Writes quarter ``part`` of a program's elements: ``factor * g + std * z``."""
    offs = first + part * Q + lane
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * factor + z * std
    tl.store(out_ptr + start + offs, _to(y, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _noised_kernel(
    ptrs_ptr, starts_ptr, blk_tensor_ptr, blk_first_ptr, seed_ptr, out_ptr, factor, std,
    BLOCK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    Q: tl.constexpr = BLOCK // 4
    pid = tl.program_id(0)
    k = tl.load(blk_tensor_ptr + pid)
    first = tl.load(blk_first_ptr + pid)
    start = tl.load(starts_ptr + k)
    n = tl.load(starts_ptr + k + 1) - start
    g_ptr = tl.load(ptrs_ptr + k).to(out_ptr.dtype)
    lane = tl.arange(0, Q)
    counter = pid.to(tl.int64) * Q + lane
    nonce = tl.load(seed_ptr + 1)
    c0 = counter.to(tl.uint32)  # the low word
    zero = c0 * 0
    c1 = (counter >> 32).to(tl.uint32)
    c2 = zero + (nonce & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + (nonce >> 32).to(tl.uint32)
    x0, x1, x2, x3 = tl.philox(tl.load(seed_ptr), c0, c1, c2, c3)
    z0, z1 = _normal_pair(x0, x1)
    z2, z3 = _normal_pair(x2, x3)
    _noised_quarter(g_ptr, out_ptr, start, first, n, 0, lane, z0, factor, std, UPCAST, Q)
    _noised_quarter(g_ptr, out_ptr, start, first, n, 1, lane, z1, factor, std, UPCAST, Q)
    _noised_quarter(g_ptr, out_ptr, start, first, n, 2, lane, z2, factor, std, UPCAST, Q)
    _noised_quarter(g_ptr, out_ptr, start, first, n, 3, lane, z3, factor, std, UPCAST, Q)


def block_size(device: torch.device) -> int:
    """Elements per program on ``device`` (:data:`BLOCK_CUDA`, or the interpreter's)."""
    return BLOCK_CUDA if device.type == "cuda" else INTERPRETER_BLOCK


def block_table(
    numels: list[int], block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch's block table for tensors of ``numels`` elements.

    Args:
        numels: Each tensor's elements, in order.
        block: Elements per program.
        device: Where the table goes.

    Returns:
        ``(starts, blk_tensor, blk_first)`` on ``device``: int64 ``(K + 1,)`` offsets of each
        tensor in the flat output; per program (``block`` elements of one tensor) its tensor
        (int32) and its first element (int64).
    """
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    starts = torch.zeros(len(numels) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(numels, dtype=torch.int64).cumsum(0)
    blk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    before = torch.zeros_like(counts)
    before[1:] = counts.cumsum(0)[:-1]
    index = torch.arange(int(counts.sum()), dtype=torch.int64)
    blk_first = (index - before.repeat_interleave(counts)) * block
    return starts.to(device), blk_tensor.to(device), blk_first.to(device)


#: Pointer tables by addresses (the gradients of a step usually reuse the previous step's
#: memory): at most :data:`_KEPT_TABLES`, the oldest dropped first.
_POINTERS: dict[tuple[int, ...], torch.Tensor] = {}
_KEPT_TABLES = 8


def pointer_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' data addresses as int64 ``(K,)`` on ``device``, without a synchronisation.

    A copy from pageable host memory synchronises the stream first (the host waited for the GPU
    to drain, 4 ms a step on one H100); from pinned memory it is queued like a kernel. Tables are
    kept and reused while the addresses stay the same.

    Args:
        tensors: The tensors (their ``data_ptr()``, storage offsets included).
        device: Where the kernel runs.

    Returns:
        The table (recorded on the current stream when on CUDA).
    """
    addresses = tuple(t.data_ptr() for t in tensors)
    table = _POINTERS.get(addresses)
    if table is None or table.device != device:
        host = torch.tensor(addresses, dtype=torch.int64)
        if device.type == "cuda":
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host.to(device)
        if len(_POINTERS) >= _KEPT_TABLES:
            del _POINTERS[next(iter(_POINTERS))]
        _POINTERS[addresses] = table
    return table


def _on_current_stream(*tensors: torch.Tensor) -> None:
    """Marks cached tables as used by the current CUDA stream (their memory waits for it)."""
    for t in tensors:
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))


def noised(
    grads: list[torch.Tensor],
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    seed: torch.Tensor,
    factor: float,
    std: float,
    block: int,
) -> torch.Tensor:
    """The flat ``factor * g + std * z`` of contiguous same-dtype ``grads``, in their order.

    Args:
        grads: Contiguous tensors of one dtype (fp32, bf16 or fp16) on one device.
        table: :func:`block_table` of their sizes at ``block``.
        seed: int64 ``(2,)`` on their device: Philox's key and the counter's nonce.
        factor: The gradients' scale.
        std: The noise's standard deviation.
        block: Elements per program (:data:`BLOCK_CUDA` or :data:`INTERPRETER_BLOCK`).

    Returns:
        A new flat tensor of their total size and dtype.
    """
    starts, blk_tensor, blk_first = table
    device = grads[0].device
    out = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=device)
    programs = blk_tensor.numel()
    if programs == 0:
        return out
    ptrs = pointer_table(grads, device)
    _on_current_stream(ptrs, *table)
    on_cuda = device.type == "cuda"
    _noised_kernel[(programs,)](
        ptrs, starts, blk_tensor, blk_first, seed, out, float(factor), float(std),
        BLOCK=block, UPCAST=not on_cuda, num_warps=8 if on_cuda else 1,
    )  # fmt: skip
    return out
