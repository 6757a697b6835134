"""Device and backend choice and process-group setup, in one place."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def pick_device_and_backend() -> tuple[str, str]:
    """Returns ``("cuda", "nccl")`` when CUDA is available, else ``("cpu", "gloo")``."""
    if torch.cuda.is_available():
        return "cuda", "nccl"
    return "cpu", "gloo"


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Initialises the default process group from torchrun-style environment variables.

    Works without torchrun too (one process, world size 1, a free port). On CPU it sets
    ``GLOO_SOCKET_IFNAME=lo`` unless the user set it.

    Returns:
        ``(rank, world_size, device)``.
    """
    device_type, backend = pick_device_and_backend()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")
