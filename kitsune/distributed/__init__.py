"""kitsune over torch.distributed: sharded optimizer state (ZeRO stages 1 and 2, `kitsune.distributed.zero`),
FSDP2/DTensor params (`kitsune.distributed.fsdp`) and distributed Muon (`kitsune.distributed.muon`).

Everything here runs on torch.distributed's own collectives (NCCL on GPUs, gloo on CPUs).
"""

from kitsune.distributed.shard_state import consolidated_state_dict, state_numel

__all__ = ["consolidated_state_dict", "state_numel"]
