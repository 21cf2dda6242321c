"""Latent KV cache for one request: paged with page_size 1, tree append, post-verify commit.

    cache = LatentCache(cfg, num_slots=1024, mode="compact")       # or mode="remap"
    slots = cache.pending(q)        # physical slots for q new rows at positions s .. s+q-1 (tree: flat order)
    cache.write(layer, slots, rows) # rows [q, kv_lora + rope]
    cache.commit()                  # prefill / AR decode: keep every pending row in order
    cache.commit_path(paths, lengths)  # tree verify: keep the accepted nodes (path, root first) only

Storage: `kv [num_layers, num_slots, kv_lora + rope]` (layer-major: each layer's pool is one
contiguous [num_slots, 576] array, the layout the tree-verify kernels read) and the token table
`req_to_token [1, max_ctx]` (logical position -> slot, as SGLang's `req_to_token`; one table for
every layer). After a verify the accepted nodes must sit at logical positions s .. s+len-1
(survey §5.1). Two ways, both through `kdlib.ops` (numpy reference on CPU, CuPy kernels on CUDA):

  * "compact": slots equal positions; the tree is appended at slots s .. s+n and
    `ops.compact_kv_batch` moves row s+path[i] to s+i (ascending, safe in place), one launch for
    all layers (the layers are the batch: layer l's rows start at l * num_slots);
  * "remap" (what page_size 1 allows): tree rows go to free slots anywhere in the pool and
    `ops.remap_slots` points req_to_token[s+i] at the slot of path[i]; the rejected slots return
    to the free list. No KV bytes move.
"""

from __future__ import annotations

import torch

from kdlib import ops
from kdlib.engine.config import ModelConfig
from kdlib.engine.model import check_int

MODES = ("compact", "remap")


class CacheFullError(ValueError):
    """More rows were asked for than the cache has slots (or positions)."""


class LatentCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, *, mode: str = "compact", max_ctx: int | None = None,
                 device=None, dtype=torch.float32):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.cfg, self.mode = cfg, mode
        self.num_slots = check_int("num_slots", num_slots, 1)
        self.max_ctx = self.num_slots if max_ctx is None else check_int("max_ctx", max_ctx, 1)
        self.device = torch.device(device or "cpu")
        self.kv = torch.zeros(cfg.num_hidden_layers, self.num_slots, cfg.latent_dim, device=self.device,
                              dtype=dtype)  # [L, S, kv_lora + rope]
        # [1, max_ctx]
        self.req_to_token = torch.full((1, self.max_ctx), -1, dtype=torch.int64, device=self.device)
        self.length = 0  # committed tokens (s)
        self._pending: torch.Tensor | None = None
        self._free = list(range(self.num_slots - 1, -1, -1))  # remap mode: a stack, lowest slot on top

    # ---- allocation
    def pending(self, q: int) -> torch.Tensor:
        """Slots [q] for the next q rows (positions s .. s+q-1); replaces any uncommitted rows."""
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ValueError(f"pending takes a row count >= 0, got {q!r}")
        self.discard()
        if self.length + q > self.max_ctx:
            raise CacheFullError(f"{self.length} committed + {q} new rows exceed max_ctx {self.max_ctx}")
        if self.mode == "compact":
            if self.length + q > self.num_slots:
                raise CacheFullError(f"{self.length} + {q} rows exceed the {self.num_slots} slots")
            slots = torch.arange(self.length, self.length + q, device=self.device)
        else:
            if q > len(self._free):
                raise CacheFullError(f"{q} rows asked, {len(self._free)} slots free")
            slots = torch.tensor([self._free.pop() for _ in range(q)], dtype=torch.int64, device=self.device)
        self._pending = slots
        return slots

    def discard(self) -> None:
        """Drop uncommitted rows (their slots return to the pool)."""
        if self._pending is not None and self.mode == "remap":
            self._free.extend(reversed(self._pending.tolist()))
        self._pending = None

    def key_slots(self, new_slots: torch.Tensor) -> torch.Tensor:
        """[s + q] slots a query attends to: the committed prefix, then the new rows."""
        return torch.cat([self.req_to_token[0, : self.length], new_slots])

    # ---- data
    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.kv[layer, slots] = rows.to(self.kv.dtype)

    def write_all(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [q, num_layers, kv_lora + rope] (a prefill's latents) into slots [q]."""
        self.kv[:, slots] = rows.transpose(0, 1).to(self.kv.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv[layer, slots]

    def prefix_table(self) -> torch.Tensor:
        """[1, s] int64: the slots of the committed positions (the kernels' page table, page_size 1)."""
        return self.req_to_token[:, : self.length]

    # ---- commit
    def commit(self) -> None:
        """Keep every pending row in order (prefill, AR decode)."""
        slots = self._take()
        self.req_to_token[0, self.length : self.length + slots.shape[0]] = slots
        self.length += int(slots.shape[0])

    def commit_path(self, paths: torch.Tensor, lengths: torch.Tensor) -> int:
        """Keep the pending rows of the accepted path as positions s, s+1, ...; returns its length.

        paths [1, W] int64 (tree indices, root first, strictly increasing, padded -1), lengths [1]
        int64: the `accept_*_batch` outputs, on the cache's device.
        """
        if self._pending is None:
            raise ValueError("nothing pending to commit")
        slots, q = self._pending, self._pending.shape[0]
        # checked up front (the ops check compact mode's path against the whole pool, not the tree)
        if paths.ndim != 2 or paths.shape[0] != 1 or tuple(lengths.shape) != (1,):
            raise ValueError(f"paths must be [1, W] and lengths [1], got {tuple(paths.shape)} and "
                             f"{tuple(lengths.shape)}")
        n, *row = torch.cat([lengths, paths[0]]).tolist()  # one device read for both checks
        n = int(n)  # float inputs are the ops' to refuse, after these checks
        if not 1 <= n <= min(q, paths.shape[1]):
            raise ValueError(f"path length {n} must be in [1, {min(q, paths.shape[1])}]")
        path = row[:n]
        if path[0] < 0 or path[-1] >= q or any(b <= a for a, b in zip(path, path[1:], strict=False)):
            raise ValueError(f"paths[0] must be strictly increasing in [0, {q}) (the pending rows), "
                             f"got {path}")
        s = self.length
        starts = torch.tensor([s], dtype=torch.int64, device=self.device)
        if self.mode == "compact":
            # a row move is dtype-blind: 2-byte floats travel as int16 (DLPack/CuPy lack bfloat16)
            rows = self.kv.view(torch.int16) if self.kv.element_size() == 2 else self.kv
            L = self.kv.shape[0]
            layer_starts = torch.arange(L, device=self.device) * self.num_slots + s  # [L]
            ops.compact_kv_batch(
                rows.view(L * self.num_slots, -1),
                layer_starts,
                paths.expand(L, -1).contiguous(),
                lengths.expand(L).contiguous(),
            )
            self.req_to_token[0, s : s + n] = torch.arange(s, s + n, device=self.device)
        else:
            freed = ops.remap_slots(self.req_to_token, starts, slots[None], paths, lengths)
            self._free.extend(reversed(torch.as_tensor(freed).tolist()))
        self._pending = None  # taken only now: a call the ops refuse keeps the pending slots
        self.length += n
        return n

    def _take(self) -> torch.Tensor:
        if self._pending is None:
            raise ValueError("nothing pending to commit")
        slots, self._pending = self._pending, None
        return slots

    def committed_rows(self) -> torch.Tensor:
        """[s, num_layers, kv_lora + rope]: the committed latents in position order (for checks)."""
        return self.kv[:, self.req_to_token[0, : self.length]].transpose(0, 1)
