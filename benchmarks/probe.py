"""The launcher benchmark's workload: join the process group, one barrier, leave."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
