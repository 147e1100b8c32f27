"""The bytes of the second tier: host slots shaped like the device pool's blocks, and the copies.

The device pool is one tensor `(layers, 2, kv_heads * num_blocks, block_size, head_dim)` whose
row `head * num_blocks + block` holds one head of one block; viewed as `(layers, 2, kv_heads,
num_blocks, block_size, head_dim)`, a block is one index along dimension 3. The host store is
the same shape with `num_slots` in that place, in host memory (pinned when the pool is on a GPU)
or, given a path, in a memory-mapped file (the disk tier). Copies are synchronous and timed:
each load feeds the `TransferCostModel` that decides whether the next one pays.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from infercloud.cache.transfer_cost import TransferCostModel


def host_slots_for_bytes(device_pool: torch.Tensor, num_blocks: int, num_bytes: int) -> int:
    """How many blocks of the pool's layout fit in `num_bytes`."""
    return num_bytes // (device_pool.nbytes // num_blocks)


class HostKVStore:
    """Implements `BlockMover` between a device pool and `num_slots` host slots."""

    def __init__(
        self,
        device_pool: torch.Tensor,
        num_blocks: int,
        num_slots: int,
        cost: TransferCostModel,
        path: Path | None = None,
    ) -> None:
        layers, two, rows, block_size, head_dim = device_pool.shape
        kv_heads = rows // num_blocks
        self._device = device_pool.view(layers, two, kv_heads, num_blocks, block_size, head_dim)
        shape = (layers, two, kv_heads, num_slots, block_size, head_dim)
        if path is not None:
            numel = layers * two * kv_heads * num_slots * block_size * head_dim
            path.parent.mkdir(parents=True, exist_ok=True)
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=device_pool.dtype)
            self.host = flat.view(shape)
        else:
            pin = device_pool.device.type == "cuda"
            self.host = torch.zeros(shape, dtype=device_pool.dtype, pin_memory=pin)
        self.num_slots = num_slots
        self.cost = cost

    @torch.inference_mode()
    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        blocks = torch.tensor(device_blocks, dtype=torch.long, device=self._device.device)
        slots = torch.tensor(host_slots, dtype=torch.long)
        self.host.index_copy_(3, slots, self._device.index_select(3, blocks).to("cpu"))

    @torch.inference_mode()
    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        start = time.perf_counter()
        blocks = torch.tensor(device_blocks, dtype=torch.long, device=self._device.device)
        slots = torch.tensor(host_slots, dtype=torch.long)
        data = self.host.index_select(3, slots).to(self._device.device)
        self._device.index_copy_(3, blocks, data)
        if self._device.device.type == "cuda":
            torch.cuda.synchronize(self._device.device)
        self.cost.observe_copy(len(device_blocks), time.perf_counter() - start)

    def calibrate(self, num_blocks: int = 8) -> None:
        """Time one load before serving, so the first decision rests on a measurement.

        Run before any request: it copies host slots over the first device blocks, which hold
        nothing yet, then zeroes them again (the pool's padding relies on zeros).
        """
        n = min(num_blocks, self.num_slots, self._device.shape[3])
        self.load(list(range(n)), list(range(n)))
        with torch.inference_mode():
            self._device[:, :, :, :n].zero_()
