"""Paged KV cache: a token pool of slots, a req_to_token table, and a free-slot allocator.

Slot 0 is the sink: padded tokens write their KV there, so graphs need no masks. It is never
handed out, so `free_slots == total_slots` whenever no request holds KV.
"""

from __future__ import annotations

import numpy as np
import torch

from specpcg.transfer import runs, to_device

SINK_SLOT = 0


class KVPoolFullError(RuntimeError):
    pass


class TokenAllocator:
    """Free list of KV slots 1..total_slots (slot 0 is the sink)."""

    def __init__(self, total_slots: int):
        self.total_slots = total_slots
        self._free = list(range(total_slots, 0, -1))  # pop() hands out low slots first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, num_tokens: int) -> list:
        if num_tokens > len(self._free):
            raise KVPoolFullError(
                f"KV cache needs {num_tokens} free slots but only {len(self._free)} of "
                f"{self.total_slots} are free; raise mem_fraction_static / max_total_tokens "
                f"or lower max_running_requests")
        out = self._free[-num_tokens:] if num_tokens else []
        del self._free[len(self._free) - num_tokens:]
        return out[::-1]

    def free(self, slots) -> None:
        # Internal callers hand over lists of ints (a request's own slots): no per-slot copy.
        slots = slots if isinstance(slots, list) else [int(s) for s in slots]
        assert SINK_SLOT not in slots, "the sink slot is never allocated"
        self._free.extend(slots)
        assert len(self._free) <= self.total_slots, "double free of KV slots"


class ReqToTokenPool:
    """req_to_token[req_pool_idx, pos] = KV slot of that request's token at `pos`."""

    def __init__(self, max_requests: int, max_context_len: int, device):
        # [max_requests + 1, max_context_len]; the extra row is never handed out
        self.req_to_token = torch.zeros(max_requests + 1, max_context_len, dtype=torch.int32,
                                        device=device)
        self.max_context_len = max_context_len
        # Graph padding requests read this row: every entry is the sink slot, forever.
        self.pad_row = max_requests
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def free_requests(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KVPoolFullError("no free request rows; lower the number of running requests")
        return self._free.pop()

    def free(self, idx: int) -> None:
        self._free.append(idx)


class KVPool:
    """Per-layer K and V buffers of shape [total_slots + 1, num_kv_heads, head_dim]."""

    def __init__(self, total_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (total_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = TokenAllocator(total_slots)
        self.dtype = dtype
        self.device = torch.device(device)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]."""
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)


class KVCache:
    """Owns both pools and keeps each request's req_to_token row in step with its slots."""

    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool):
        self.pool = pool
        self.req_pool = req_pool
        self._slots: dict = {}  # req_pool_idx -> list of slots, position order

    @property
    def total_slots(self) -> int:
        return self.pool.allocator.total_slots

    @property
    def free_slots(self) -> int:
        return self.pool.allocator.free_slots

    def can_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.free_slots and self.req_pool.free_requests > 0

    def new_request(self) -> int:
        idx = self.req_pool.alloc()
        self._slots[idx] = []
        return idx

    def extend(self, req_pool_idx: int, num_tokens: int) -> list:
        """Allocates slots for the next `num_tokens` positions of a request; returns them."""
        return self.extend_many([req_pool_idx], [num_tokens])[0]

    def extend_many(self, req_pool_idxs: list, counts: list, write: bool = True) -> list:
        """extend() for several requests with one req_to_token write (one host-to-device copy).
        write=False leaves req_to_token to the forward that carries the new tokens (its batch
        has rows_pending set): a decode step then skips this copy and its two launches."""
        for idx, n in zip(req_pool_idxs, counts):
            if len(self._slots[idx]) + n > self.req_pool.max_context_len:
                raise KVPoolFullError(
                    f"request needs {len(self._slots[idx]) + n} positions but the context holds "
                    f"{self.req_pool.max_context_len}")
        # One allocation (raising the error that says how many), then each request's share:
        # the same slots per-request allocations would hand out, in order.
        flat = self.pool.allocator.alloc(sum(counts))
        starts, new_all, at = [], [], 0
        for idx, n in zip(req_pool_idxs, counts):
            slots = self._slots[idx]
            new = flat[at:at + n]
            at += n
            starts.append(len(slots))
            slots.extend(new)
            new_all.append(new)
        if flat and write:
            rows = np.repeat(np.asarray(req_pool_idxs, dtype=np.int64), counts)
            packed = to_device(torch.from_numpy(np.stack([rows, runs(starts, counts),
                                                          np.asarray(flat, dtype=np.int64)])),
                               self.req_pool.req_to_token.device)  # [3, n]
            self.req_pool.req_to_token[packed[0], packed[1]] = packed[2].to(torch.int32)
        return new_all

    def write_rows(self, batch) -> None:
        """req_to_token[request, position] = slot for each new token of a batch built with
        rows_pending (make_batch: positions are the columns its slots were appended at), from
        the batch's device tensors: no host copy."""
        rows = batch.req_pool_indices
        if batch.num_tokens != rows.shape[0]:
            rows = rows.repeat_interleave(batch.extend_seq_lens, output_size=batch.num_tokens)
        self.req_pool.req_to_token[rows, batch.positions] = batch.out_cache_loc.to(torch.int32)
        batch.rows_pending = False

    def truncate(self, req_pool_idx: int, keep_len: int) -> None:
        """Frees every slot past `keep_len` (rejected draft tokens, rollback)."""
        slots = self._slots[req_pool_idx]
        self.pool.allocator.free(slots[keep_len:])
        del slots[keep_len:]

    def keep_path(self, req_pool_idx: int, prefix_len: int, nodes: list) -> None:
        """After verifying a tree written at positions prefix_len.., keeps only the `nodes`
        (node offsets, in path order) at positions prefix_len + 0, 1, ...; frees the rest.
        The accepted KV stays where it was written: only req_to_token moves (no data copy)."""
        slots = self._slots[req_pool_idx]
        kept = [slots[prefix_len + n] for n in nodes]
        if nodes == list(range(len(nodes))):  # a chain prefix: already in place
            self.truncate(req_pool_idx, prefix_len + len(nodes))
            return
        kept_set = set(kept)
        self.pool.allocator.free([s for s in slots[prefix_len:] if s not in kept_set])
        del slots[prefix_len:]
        slots.extend(kept)
        row = self.req_pool.req_to_token[req_pool_idx]
        row[prefix_len:prefix_len + len(kept)] = to_device(kept, row.device, torch.int32)

    def reorder(self, req_pool_idx: int, start: int, order: list) -> None:
        """The host's view of a move already made on the device (an overlapped tree step):
        positions start.. now hold the slots that were at start + order[0], start + order[1],
        ...; every slot stays the request's."""
        slots = self._slots[req_pool_idx]
        slots[start:start + len(order)] = [slots[start + i] for i in order]

    def release(self, req_pool_idx: int) -> None:
        self.pool.allocator.free(self._slots.pop(req_pool_idx))
        self.req_pool.free(req_pool_idx)

    def slots_of(self, req_pool_idx: int) -> list:
        return self._slots[req_pool_idx]

    def num_tokens(self, req_pool_idx: int) -> int:
        return len(self._slots[req_pool_idx])

    def info(self) -> dict:
        return {"total_slots": self.total_slots, "free_slots": self.free_slots,
                "max_context_len": self.req_pool.max_context_len,
                "free_request_rows": self.req_pool.free_requests}
