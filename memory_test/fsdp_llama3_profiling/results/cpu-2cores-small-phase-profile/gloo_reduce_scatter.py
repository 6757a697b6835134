"""Times gloo's reduce-scatter alone at 4 and 16 MiB (run with torchrun, 2 ranks)."""

import time

import torch
import torch.distributed as dist


def main() -> None:
    """Prints rank 0's median time of ten reduce-scatters per payload."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for numel in (1 << 20, 4 << 20):
        x = torch.randn(numel)
        out = torch.empty(numel // world)
        for _ in range(3):
            dist.reduce_scatter_tensor(out, x)
        times = []
        for _ in range(10):
            dist.barrier()
            start = time.perf_counter()
            dist.reduce_scatter_tensor(out, x)
            times.append((time.perf_counter() - start) * 1e3)
        if rank == 0:
            print(f"{numel * 4 / 2**20:.0f} MiB reduce-scatter: {sorted(times)[5]:.1f} ms median")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
