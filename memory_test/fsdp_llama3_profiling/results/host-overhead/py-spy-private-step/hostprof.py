"""Steps of ``bench.host_overhead``'s model for py-spy: ``hostprof.py PRIVATE STEPS``.

Run as one gloo rank (``RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=<free>
GLOO_SOCKET_IFNAME=lo``) under ``py-spy record -r 250 -f raw -o OUT -- python hostprof.py 1 150``.
"""

import os
import sys
import time

import torch

from opacus_fsdp_sync.bench.accelerator_ops import accelerator_contraction
from opacus_fsdp_sync.bench.host_overhead import HostOverheadConfig, _vocab
from opacus_fsdp_sync.bench.ledger import _prepare, _step
from opacus_fsdp_sync.distributed.env import init_distributed

private, steps = sys.argv[1] == "1", int(sys.argv[2])
cfg = HostOverheadConfig(steps=steps)
_, world, device = init_distributed()
torch.set_num_threads(1)
with accelerator_contraction():
    lcfg = cfg.ledger_config()
    model, opt, crit = _prepare(lcfg, private, device, world)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, _vocab(lcfg), (cfg.batch_size, cfg.seq_length), generator=g)
    for _ in range(3):
        _step(model, opt, crit, ids, private)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, crit, ids, private)
    print("ms/step", (time.perf_counter() - start) / steps * 1e3, flush=True)
os._exit(0)  # teardown after FSDP can abort
