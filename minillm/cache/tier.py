"""A KV tier beyond the pool (chapter 11): evicted prefix blocks go to disk, a later hit reloads.

Chapter 06's prefix cache forgets a block when the pool needs it back (LRU eviction): the next
request with that prefix recomputes it. With a tier, the evicted block's K/V (every layer) is
written to a file first, named by the block's chained key, so a later request whose prompt
continues past its pool hits can load the next blocks from disk instead of computing them:

    prompt blocks      b0   b1   b2   b3   b4 | rest
    pool (ch. 06)      hit  hit                          find_cached_blocks -> [b0, b1]
    disk tier               ...  file file               lookup -> K/V of b2, b3 (verified)
    computed by the forward                   b4 ...     num_computed_tokens starts at 4 blocks

Loading pays when reading a block is cheaper than recomputing it: a read moves
2 x layers x block_size x kv_heads x head_dim x dtype bytes, recomputing costs the prefill FLOPs
of block_size tokens (which grow with the context before them). Chapter 11 measures the
crossover on this machine. (LMCache and vLLM's KV connectors do this with CPU memory, local disk
and remote stores, asynchronously; here the save and the load are synchronous, on the
scheduler's path, so their cost is visible in the step time.)

A file holds K and V ([layers, block_size, kv_heads, head_dim] each) in safetensors, plus the
block's token ids, its parent's key, the cache salt and a checksum over all of them. A file that
fails to parse, whose checksum disagrees, or whose tokens/parent are not the ones asked for is
never served: it is deleted, counted in `stats.corrupt`, and the block is recomputed. The tier
is bounded (`max_bytes`): the least recently used files are deleted first.
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import xxhash
from safetensors.torch import load_file, save_file

from .prefix import hash_block_tokens, num_cacheable_blocks


@dataclass
class TierStats:
    saves: int = 0              # blocks written
    loads: int = 0              # blocks read and served
    corrupt: int = 0            # files refused (unreadable, checksum, wrong tokens)
    evicted: int = 0            # files deleted to stay under max_bytes
    bytes_written: int = 0
    bytes_read: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0


def _checksum(k: torch.Tensor, v: torch.Tensor, meta: dict) -> str:
    h = xxhash.xxh3_64()
    for t in (k, v):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


class DiskKVTier:
    """Full prefix blocks on disk under `path`, at most `max_bytes` of files, LRU."""

    def __init__(self, path, max_bytes: int, block_size: int):
        if max_bytes < 1:
            raise ValueError(f"the KV tier's max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.block_size = max_bytes, block_size
        self.stats = TierStats()
        self.files: OrderedDict = OrderedDict()     # key -> file size, least recent first
        for f in sorted(self.path.glob("*.safetensors"), key=lambda f: f.stat().st_mtime):
            self.files[int(f.stem, 16)] = f.stat().st_size    # a tier survives a restart

    def _file(self, key: int) -> Path:
        return self.path / f"{key:016x}.safetensors"

    @property
    def num_bytes(self) -> int:
        return sum(self.files.values())

    # --- writing (on eviction from the pool) -----------------------------------------------
    def save(self, key: int, token_ids, parent_key: Optional[int], cache_salt: Optional[str],
             k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one block (k, v: [layers, block_size, kv_heads, head_dim]) under its key."""
        if key in self.files:
            self.files.move_to_end(key)
            return
        t = time.perf_counter()
        meta = {"tokens": list(map(int, token_ids)), "parent": parent_key, "salt": cache_salt}
        k, v = k.contiguous().cpu(), v.contiguous().cpu()
        header = {"meta": json.dumps(meta), "checksum": _checksum(k, v, meta)}
        tmp = self._file(key).with_suffix(".tmp")
        save_file({"k": k, "v": v}, str(tmp), metadata=header)
        os.replace(tmp, self._file(key))              # never a half-written file under the name
        size = self._file(key).stat().st_size
        self.files[key] = size
        self.stats.saves += 1
        self.stats.bytes_written += size
        self.stats.save_seconds += time.perf_counter() - t
        while self.num_bytes > self.max_bytes and len(self.files) > 1:
            self._drop(next(iter(self.files)))
            self.stats.evicted += 1

    def clear(self) -> int:
        """Delete every file (the weights changed: the stored K/V are stale). Returns how many."""
        n = len(self.files)
        for key in list(self.files):
            self._drop(key)
        return n

    def _drop(self, key: int) -> None:
        self.files.pop(key, None)
        self._file(key).unlink(missing_ok=True)

    # --- reading (at admission, after the pool's hits) -------------------------------------
    def read(self, key: int, token_ids, parent_key: Optional[int],
             cache_salt: Optional[str]):
        """(k, v) of the block named `key` if its file is intact and holds exactly these tokens
        after this parent; None otherwise (a bad file is deleted and counted)."""
        if key not in self.files:
            return None
        t = time.perf_counter()
        want = {"tokens": list(map(int, token_ids)), "parent": parent_key, "salt": cache_salt}
        try:
            from safetensors import safe_open
            with safe_open(str(self._file(key)), "pt") as f:
                header = f.metadata() or {}
            tensors = load_file(str(self._file(key)))
            k, v = tensors["k"], tensors["v"]
            ok = (json.loads(header["meta"]) == want
                  and header["checksum"] == _checksum(k, v, want))
        except Exception:          # noqa: BLE001 - any unreadable file is a miss, never served
            ok = False
        if not ok:
            self._drop(key)
            self.stats.corrupt += 1
            return None
        self.files.move_to_end(key)
        self.stats.loads += 1
        self.stats.bytes_read += self.files[key]
        self.stats.load_seconds += time.perf_counter() - t
        return k, v

    def lookup(self, req, token_ids, num_hit_blocks: int) -> tuple:
        """(tokens, [(k, v)]) of the blocks that follow the pool's `num_hit_blocks` hits, as far
        as the tier holds them in a row (never the last prompt token's block: it is computed)."""
        bs, salt = self.block_size, req.cache_salt
        last = num_cacheable_blocks(len(token_ids), bs)
        if num_hit_blocks >= last or not self.files:
            return 0, []
        key = None
        for i in range(num_hit_blocks):               # the chain up to the first block to load
            key = hash_block_tokens(key, token_ids[i * bs:(i + 1) * bs], salt if i == 0 else None)
        loads = []
        for i in range(num_hit_blocks, last):
            block = token_ids[i * bs:(i + 1) * bs]
            parent, key = key, hash_block_tokens(key, block, salt if i == 0 else None)
            kv = self.read(key, block, parent, salt if i == 0 else None)
            if kv is None:
                break
            loads.append(kv)
        return len(loads) * bs, loads

    def request_finished(self, req) -> None:
        """Nothing: the tier saves blocks when the pool evicts them, not when requests end."""


def parse_kv_transfer_config(config: Optional[dict], block_size: int):
    """The KV tier named by `kv_transfer_config` (vLLM's argument name), or None:

        {"kv_connector": "disk", "path": "/tmp/kv", "max_bytes": 2**30}
    """
    if config is None:
        return None
    if not isinstance(config, dict) or config.get("kv_connector") != "disk":
        raise ValueError(f"kv_transfer_config must be a dict with kv_connector 'disk' (and path, "
                         f"max_bytes), got {config!r}")
    unknown = set(config) - {"kv_connector", "path", "max_bytes"}
    if unknown:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(unknown)}; use path and "
                         "max_bytes")
    if "path" not in config:
        raise ValueError("kv_transfer_config needs 'path': a directory for the tier's files")
    return DiskKVTier(config["path"], int(config.get("max_bytes", 2 ** 30)), block_size)


__all__ = ["DiskKVTier", "TierStats", "parse_kv_transfer_config"]
