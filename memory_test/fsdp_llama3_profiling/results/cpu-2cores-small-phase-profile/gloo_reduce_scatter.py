import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
for numel in (1<<20, 4<<20):
    x = torch.randn(numel); out = torch.empty(numel // w)
    for _ in range(3): dist.reduce_scatter_tensor(out, x)
    ts=[]
    for _ in range(10):
        dist.barrier(); t=time.perf_counter(); dist.reduce_scatter_tensor(out, x); ts.append((time.perf_counter()-t)*1e3)
    if r==0: print(numel*4/2**20, "MiB RS", sorted(ts)[5], "ms median")
dist.destroy_process_group()
