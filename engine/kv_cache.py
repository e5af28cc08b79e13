"""Paged KV cache: fixed-size blocks of positions, a budget, reference counts and a prefix index.

Each layer's keys and values live in pools of ``num_blocks`` blocks ``[KV, block_size, D]``; a
sequence owns a *block table* (the block of each ``block_size`` positions), so memory follows
the tokens in use, and sequences that start with the same tokens share the blocks that hold them.

A block whose positions all hold known tokens is *registered* in the prefix index under
``(parent content id, its tokens)``: the chain of content ids from the first block identifies
every token before it, like a radix tree with one edge per block. When a sequence ends, its last,
partly filled block is registered too, as a leaf a later prompt can copy from. Blocks nobody uses
stay in the index, ordered least recently used first, and are evicted (unregistered and reused)
only when no free block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
import torch

DEFAULT_BLOCK_SIZE = 64


class KVPool:
    """Block storage for one model's keys and values, with allocation and the prefix index.

    ``caches[layer] = (k, v)``, each ``[num_blocks, kv_heads, block_size, head_dim]``.
    """

    ROOT = 0

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, kv_heads, block_size, head_dim)
        # never read before written: pages are only committed as blocks come into use
        self.caches = [(torch.empty(shape, dtype=dtype, device=device),
                        torch.empty(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._unused: OrderedDict[int, None] = OrderedDict()  # registered, ref 0: LRU first
        self._next_id = 1
        self._full: dict[tuple[int, tuple[int, ...]], int] = {}
        self._children: dict[int, set[int]] = {}
        self._meta: dict[int, tuple[int, tuple[int, ...], int | None]] = {}
        """block -> (parent content id, tokens, own content id or None for a partial leaf)."""
        self.evictions = 0

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def available(self) -> int:
        """Blocks that can be allocated now (free, or unused and evictable)."""
        return len(self._free) + len(self._unused)

    def exclusive(self, block: int) -> bool:
        """Whether ``block`` has exactly one user (no other request shares it)."""
        return self._ref[block] == 1

    def in_use(self) -> int:
        return sum(1 for r in self._ref if r > 0)

    # ----------------------------------------------------------------------- allocation

    def allocate(self) -> int | None:
        """A block for exclusive use (ref 1), evicting the least recently used unused one if
        no block is free; None when every block is in use."""
        if self._free:
            block = self._free.pop()
        elif self._unused:
            block, _ = self._unused.popitem(last=False)
            self._unregister(block)
            self.evictions += 1
        else:
            return None
        self._ref[block] = 1
        return block

    def take(self, blocks: Sequence[int]) -> None:
        """Share ``blocks`` (from `match`): one more reference each."""
        for block in blocks:
            if self._ref[block] == 0:
                self._unused.pop(block, None)
            self._ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``; unused registered blocks stay cached, the
        last ones of a table first in line for eviction."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._meta:
                    self._unused[block] = None
                    self._unused.move_to_end(block)
                else:
                    self._free.append(block)

    def copy_positions(self, src: int, dst: int, count: int) -> None:
        """Copy the first ``count`` positions of block ``src`` into block ``dst`` (all layers)."""
        for k, v in self.caches:
            k[dst, :, :count] = k[src, :, :count]
            v[dst, :, :count] = v[src, :, :count]

    # --------------------------------------------------------------------- prefix index

    def match(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int, int | None, int]:
        """The cached prefix of ``tokens[:limit]``: ``(whole blocks, their last content id,
        partial block or None, tokens to copy from it)``. Nothing is taken yet."""
        bs = self.block_size
        blocks: list[int] = []
        chain = self.ROOT
        i = 0
        while i + bs <= limit:
            block = self._full.get((chain, tuple(tokens[i:i + bs])))
            if block is None:
                break
            blocks.append(block)
            chain = self._meta[block][2]
            i += bs
        best, best_n = None, 0
        rest = tokens[i:min(limit, i + bs)]
        for block in self._children.get(chain, ()):
            cached = self._meta[block][1]
            n = 0
            for a, b in zip(cached, rest):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = block, n
        return blocks, chain, best, best_n

    def register(self, block: int, chain: int, tokens: Sequence[int]) -> int:
        """Index a full block holding ``tokens`` after the chain ``chain``; returns the content id
        the next block chains from (an identical block already indexed keeps its place)."""
        key = (chain, tuple(tokens))
        existing = self._full.get(key)
        if existing is not None:
            return self._meta[existing][2]
        if block in self._meta:  # already indexed under another key (cannot happen for owners)
            return self._meta[block][2]
        cid = self._next_id
        self._next_id += 1
        self._full[key] = block
        self._meta[block] = (chain, key[1], cid)
        self._children.setdefault(chain, set()).add(block)
        return cid

    def register_partial(self, block: int, chain: int, tokens: Sequence[int]) -> None:
        """Index the last, partly filled block of a finished sequence as a leaf to copy from."""
        if not tokens or block in self._meta:
            return
        self._meta[block] = (chain, tuple(tokens), None)
        self._children.setdefault(chain, set()).add(block)

    def _unregister(self, block: int) -> None:
        chain, tokens, cid = self._meta.pop(block)
        if cid is not None:
            self._full.pop((chain, tokens), None)
        siblings = self._children.get(chain)
        if siblings is not None:
            siblings.discard(block)
            if not siblings:
                del self._children[chain]

    def forget(self) -> None:
        """Empty the prefix index: every block not in use becomes free (only while no indexed
        block is in use; a block held outside the index stays its holder's)."""
        held = [b for b in self._meta if self._ref[b] > 0]
        if held:
            raise ValueError(f"cannot empty the prefix index: {len(held)} indexed blocks are in use")
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if self._ref[b] == 0]
        self._unused.clear()
        self._full.clear()
        self._children.clear()
        self._meta.clear()

    def cached_blocks(self) -> int:
        """Blocks in the prefix index (in use or not)."""
        return len(self._meta)
