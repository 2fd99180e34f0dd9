"""Paged KV block allocator with reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one sequence (for every layer: see
engine/kv_cache.py for the tensor layout). Full blocks are content-addressed by a chained hash
``hash((parent_hash, tokens))`` so two requests with the same prefix share the blocks. A block whose
reference count drops to zero goes back to the free queue but keeps its hash: until it is handed out
again it can still be revived by a prefix-cache hit (LRU eviction, oldest freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import DEFAULT_WEIGHT_VERSION

NO_HASH = None


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = NO_HASH
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions on a hit


@dataclass
class StoredRun:
    """Consecutive blocks of one request that entered the prefix cache together, told in full for the KV events
    published outside the cluster (vLLM's BlockStored: wire/kv_events.py, node/kv_event_publisher.py). Made only
    where such events are on (``BlockManager.describe_stored``)."""

    block_hashes: list[int]
    parent_hash: int | None  # the block before the first; None where the first is the request's first block
    token_ids: list[int]
    first_token: int  # where the run starts in the request's tokens (its images' places are relative to it)
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_inputs: tuple = ()  # the request's images ({"offset", "length", "digest", ...}), for their extra keys
    prompt_embeds_keys: tuple[bytes, ...] = ()  # the request's block keys from its rows (block_keys), likewise


def block_hash_root(params) -> int | None:
    """The parent hash of a request's first block (``params``: its SamplingParams): None for the base model
    without a cache salt or images, else a digest of its LoRA adapter's name and content digest, its ``cache_salt``
    and its images' digests and places.
    An adapter changes the KV a prompt makes, and a salt keeps one tenant's cached prompts from another's (vLLM's cache_salt:
    a hit's speed would tell a guessed prompt), so such blocks hash apart in the prefix cache, the offload
    tiers and the router's KV index. An image's placeholder tokens are the same whatever the image: its digest
    keeps two prompts that differ only in their images apart (engine/multimodal/); a prompt given as embeddings keys
    each block by its rows instead (``block_keys``). A request under updated weights
    (``weight_version`` other than the start-up weights': engine/weight_update.py) chains from a digest of its
    version over all that: KV of other weights is never a hit."""
    root = _content_root(params)
    version = params.weight_version
    if version is None or version == DEFAULT_WEIGHT_VERSION:
        return root
    digest = hashlib.blake2b(b"weights\0" + version.encode() + b"\0"  # KV of other weights: another chain
                             + (b"" if root is None else root.to_bytes(8, "little", signed=True)), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _content_root(params) -> int | None:
    """block_hash_root's part from what the request holds (adapter, salt, images), whatever the weights."""
    lora_name, salt, images = params.lora_name, params.cache_salt, params.mm_inputs
    if lora_name is None and salt is None and not images:
        return None
    if lora_name is not None and params.lora_digest is not None:  # an adapter reloaded under its name: new KV
        lora_name = f"{lora_name}\0{params.lora_digest}"
    if salt is None and lora_name is not None:
        digest = hashlib.blake2b(b"lora\0" + lora_name.encode(), digest_size=8).digest()
    elif salt is not None:
        digest = hashlib.blake2b(b"salt\0" + salt.encode() + b"\0lora\0" + (lora_name or "").encode()
                                 + (b"\1" if lora_name is not None else b"\0"), digest_size=8).digest()
    else:
        digest = b""
    if images:
        digest = hashlib.blake2b(b"images\0" + digest + "".join(
            f"{item['offset']}:{item['length']}:{item['digest']};" for item in images).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def block_keys(params, block_size: int, first_block: int = 0) -> list[bytes]:
    """What a request's blocks from ``first_block`` hash besides their token ids: the digest of each block's rows
    where its prompt was given as embeddings (engine/prompt_embeds.py: the placeholder ids are the same whatever the
    rows), as vLLM hashes them; empty otherwise (and past the rows)."""
    embeds = params.prompt_embeds
    return [] if embeds is None else embeds.block_keys(block_size)[first_block:]


def chained_block_hashes(token_ids: list[int], block_size: int, parent: int | None = None,
                         keys: list[bytes] = ()) -> list[int]:
    """Hash of every *full* block of ``token_ids``; each hash covers the whole prefix up to its end. ``keys``: the
    blocks' extra keys in order (``block_keys``), for as many blocks as it has.

    A 64-bit BLAKE2b digest, not Python's ``hash()``: the value must be the same in every process and
    every run (``hash(None)`` is not on Python 3.11), because it names a block to the router's global
    index (KV events) and names the block's file in the disk tier (engine/kv_offload/)."""
    hashes = []
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        digest = hashlib.blake2b(digest_size=8)
        digest.update(b"" if parent is None else parent.to_bytes(8, "little", signed=True))
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        if i < len(keys):
            digest.update(keys[i])
        parent = int.from_bytes(digest.digest(), "little", signed=True)
        hashes.append(parent)
    return hashes


class BlockManager:
    """``on_evict(block_id, block_hash, out_of_stream)`` runs when a cached block is handed to a new owner, while
    its KV is still in place (the offload tiers copy it out: engine/kv_offload/); ``out_of_stream``: the new owner
    writes it outside the steps' queue (allocate_slots). ``on_event(kind, hashes)``
    reports blocks entering ("stored") and leaving ("removed") the prefix cache, for KV events; with
    ``describe_stored`` a store is ``on_event("stored", hashes, runs)``, ``runs`` the StoredRuns of those hashes.
    ``on_cached(block_ids, hashes)`` runs when blocks enter the prefix cache, their KV written (the shared offload
    tier writes them through: engine/kv_offload/manager.py)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[int, int, bool], None] | None = None,
                 on_event: Callable[[str, list[int]], None] | None = None,
                 on_cached: Callable[[list[int], list[int]], None] | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.on_evict = on_evict
        self.on_event = on_event
        self.on_cached = on_cached
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = eviction order. O(1) removal when a cached free block is revived.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block_id: dict[int, int] = {}
        # Per request: hashes of its blocks that are already registered in the prefix cache.
        self._req_hashes: dict[str, list[int]] = {}
        # Free blocks that a step still in flight may write (async scheduling: freed while the request's
        # next step runs) -> that step's index. The scheduler's own next step runs after it on the same
        # device queue, so it may take them; writers outside that queue (a KV transfer landing, an
        # offload load) may not until ``lift_fences`` says the step finished.
        self._fenced: dict[int, int] = {}
        self.describe_stored = False  # set by an engine publishing vLLM's KV events (engine/llm_engine.py)

    # ---- questions -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_free_blocks_for(self, out_of_stream: bool) -> int:
        """Free blocks a writer may take: all, or for one outside the steps' queue, the unfenced."""
        return len(self._free) - (len(self._fenced) if out_of_stream else 0)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block in the prefix cache (in use or free)."""
        return list(self._hash_to_block_id)

    def usable_block_hashes(self, request: Request) -> list[int]:
        """Hashes of the full blocks a prefix hit may cover: every token but the last is usable, so the
        step that follows produces logits. None without prefix caching (nothing is hashed then)."""
        if not self.enable_prefix_caching:
            return []
        params = request.sampling_params
        return chained_block_hashes(request.all_token_ids[: request.num_tokens - 1], self.block_size,
                                    block_hash_root(params), block_keys(params, self.block_size))

    def find_cached_prefix(self, request: Request, block_hashes: list[int] | None = None) -> list[int]:
        """Block ids of the longest cached prefix of the request's committed tokens (at least one token is
        always left to compute). ``block_hashes``: ``usable_block_hashes(request)``, when the caller has them."""
        if not self.enable_prefix_caching:
            return []
        usable = request.all_token_ids[: request.num_tokens - 1]
        if block_hashes is None:
            block_hashes = self.usable_block_hashes(request)
        block_ids = []
        for i, h in enumerate(block_hashes):
            block_id = self._hash_to_block_id.get(h)
            if block_id is None:
                break
            chunk = tuple(usable[i * self.block_size : (i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != chunk:
                break
            block_ids.append(block_id)
        return block_ids

    # ---- actions ----------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_block_ids: list[int] | None = None,
        out_of_stream: bool = False,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``
        (plus ``cached_block_ids`` taken over from the prefix cache). Returns False, changing nothing,
        when the pool is too small. ``out_of_stream``: the new blocks are written outside the steps'
        device queue (a KV transfer, an offload load): no fenced block is handed out."""
        if not cached_block_ids and len(request.block_ids) * self.block_size >= request.num_computed_tokens + num_new_tokens:
            return True  # a decode step inside its last block: most rows of most steps
        cached_block_ids = cached_block_ids or []
        num_cached_tokens = len(cached_block_ids) * self.block_size
        total_tokens = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(total_tokens) - len(request.block_ids) - len(cached_block_ids)
        # Reviving a cached block with ref 0 also takes it out of the free queue.
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        num_free = self.num_free_blocks
        if out_of_stream and self._fenced:
            # Fenced blocks are not for this writer, but a revived one is: it is full and cached, no
            # step writes it any more.
            num_free -= len(self._fenced) - sum(1 for b in cached_block_ids
                                                if self.blocks[b].ref_count == 0 and b in self._fenced)
        if num_new_blocks + num_revived > num_free:
            return False
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._fenced.pop(block_id, None)
            block.ref_count += 1
            request.block_ids.append(block_id)
        if cached_block_ids:
            self._req_hashes[request.request_id] = [self.blocks[b].block_hash for b in cached_block_ids]
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._pop_free_block(out_of_stream))
        return True

    def reserve(self, request: Request, num_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        """Blocks for the first ``num_tokens`` tokens of a request whose KV will arrive from elsewhere
        (decode side of a KV transfer, written outside the steps' queue): ``cached_block_ids`` (its
        prefix-cache hit) taken by reference, fresh unfenced ones for the rest."""
        assert not request.block_ids, "reserve() is for requests that hold no blocks yet"
        cached_block_ids = cached_block_ids or []
        return self.allocate_slots(request, num_tokens - len(cached_block_ids) * self.block_size, cached_block_ids,
                                   out_of_stream=True)

    def cache_full_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register the request's full, computed blocks in the prefix cache. ``num_computed_tokens``: the
        tokens whose KV is written (default the request's count, which async scheduling runs ahead of)."""
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        known = self._req_hashes.get(request.request_id)
        # Called for every row of every step, and most steps complete no block: that answer first, without the
        # request's num_tokens (a property) or a list for a request with none yet (num_full <= this bound).
        if num_computed_tokens // self.block_size <= (len(known) if known is not None else 0):
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if known is None:
            known = self._req_hashes[request.request_id] = []
        if num_full <= len(known):
            return
        token_ids = request.all_token_ids
        parent = known[-1] if known else block_hash_root(request.sampling_params)
        start_block = len(known)
        new_hashes = chained_block_hashes(
            token_ids[start_block * self.block_size : num_full * self.block_size], self.block_size, parent,
            block_keys(request.sampling_params, self.block_size, start_block)
        )
        stored = []
        runs: list[StoredRun] | None = [] if self.describe_stored else None
        for i, h in enumerate(new_hashes):
            block_index = start_block + i
            block = self.blocks[request.block_ids[block_index]]
            known.append(h)
            if block.block_hash is not None:
                continue  # already a cached block (shared prefix)
            if h in self._hash_to_block_id:
                continue  # same content cached in another block; keep the first
            block.block_hash = h
            block.token_ids = tuple(token_ids[block_index * self.block_size : (block_index + 1) * self.block_size])
            self._hash_to_block_id[h] = block.block_id
            stored.append(h)
            if runs is not None:
                self._add_to_run(runs, request, block_index, h, known[block_index - 1] if block_index else None,
                                 block.token_ids)
        self._tell_stored(stored, runs)
        if stored and self.on_cached is not None:
            self.on_cached([self._hash_to_block_id[h] for h in stored], stored)

    def _tell_stored(self, stored: list[int], runs: list[StoredRun] | None) -> None:
        if stored and self.on_event is not None:
            if runs is None:
                self.on_event("stored", stored)
            else:
                self.on_event("stored", stored, runs)

    def _add_to_run(self, runs: list[StoredRun], request: Request, block_index: int, block_hash: int,
                    parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        """The block at ``block_index`` of ``request`` onto the last run where it follows it, else a new run."""
        first_token = block_index * self.block_size
        last = runs[-1] if runs else None
        if last is not None and last.first_token + len(last.token_ids) == first_token:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        params = request.sampling_params
        runs.append(StoredRun([block_hash], parent_hash, list(token_ids), first_token, params.lora_name,
                              params.cache_salt, tuple(params.mm_inputs or ()),
                              tuple(block_keys(params, self.block_size))))

    def cache_loaded_blocks(self, block_ids: list[int], block_hashes: list[int],
                            token_chunks: list[tuple[int, ...]], request: Request | None = None,
                            first_block: int = 0) -> None:
        """Register blocks whose KV was loaded from a lower tier (engine/kv_offload/) in the prefix cache,
        as if computed here: the request that loaded them finds them like any cached prefix. ``request`` and
        ``first_block`` (the request's block the first of them is) tell them in full (``describe_stored``)."""
        stored = []
        runs: list[StoredRun] | None = [] if self.describe_stored and request is not None else None
        parent = None
        if runs is not None and first_block:
            bs = self.block_size
            params = request.sampling_params
            parent = chained_block_hashes(request.all_token_ids[: first_block * bs], bs, block_hash_root(params),
                                          block_keys(params, bs))[-1]
        for i, (block_id, h, chunk) in enumerate(zip(block_ids, block_hashes, token_chunks)):
            block = self.blocks[block_id]
            if block.block_hash is None and h not in self._hash_to_block_id:  # else cached meanwhile elsewhere
                block.block_hash, block.token_ids = h, tuple(chunk)
                self._hash_to_block_id[h] = block_id
                stored.append(h)
                if runs is not None:
                    self._add_to_run(runs, request, first_block + i, h, parent, block.token_ids)
            parent = h
        self._tell_stored(stored, runs)

    def free(self, request: Request, fence: int | None = None) -> None:
        """Drop the request's references. Tail blocks go to the free queue first so the shared prefix
        stays cached longest. Each block of a request is freed exactly once. ``fence``: the newest step
        that may still write the request's blocks (async scheduling; None when none is in flight)."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id} (request {request.request_id})"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if fence is not None:
                    self._fenced[block_id] = fence
        request.block_ids = []
        self._req_hashes.pop(request.request_id, None)

    def lift_fences(self, step_index: int) -> None:
        """Steps up to ``step_index`` finished: the blocks they fenced may go to any writer."""
        if self._fenced:
            self._fenced = {b: s for b, s in self._fenced.items() if s > step_index}

    @property
    def fenced_block_ids(self) -> set[int]:
        return set(self._fenced)

    def reset_prefix_cache(self, evict: bool = False) -> None:
        """Forget every block's hash. ``evict``: each cached block goes through ``on_evict`` first, as if handed to a
        new owner (the offload tiers keep a copy: a sleep's release of the pool, engine/sleep.py)."""
        if evict and self.on_evict is not None:
            for block_hash, block_id in list(self._hash_to_block_id.items()):
                self.on_evict(block_id, block_hash, False)
        if self.on_event is not None and self._hash_to_block_id:
            self.on_event("removed", list(self._hash_to_block_id))
        for block in self.blocks:
            block.block_hash, block.token_ids = NO_HASH, ()
        self._hash_to_block_id.clear()

    def _pop_free_block(self, out_of_stream: bool = False) -> int:
        if out_of_stream and self._fenced:
            # Fenced blocks were freed last, so they sit at the queue's end: the scan is short.
            block_id = next(b for b in self._free if b not in self._fenced)
            del self._free[block_id]
        else:
            block_id, _ = self._free.popitem(last=False)
            self._fenced.pop(block_id, None)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} in free queue with ref_count {block.ref_count}"
        if block.block_hash is not None:
            if self._hash_to_block_id.get(block.block_hash) == block_id:
                del self._hash_to_block_id[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash, out_of_stream)
                if self.on_event is not None:
                    self.on_event("removed", [block.block_hash])
            block.block_hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id
