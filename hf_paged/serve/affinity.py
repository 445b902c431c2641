"""Which replica serves a request: prefix affinity, balanced by load (`hf-paged serve --data-parallel-size N`).

Each replica has its own prefix cache, so a prompt is cheapest where its first blocks were computed last. The
policy keeps, for the hash of every full-block prefix of the prompts it routed (the first block, the first two ...,
up to `max_blocks`), the replica that last served it, in one least-recently-used map (`capacity` entries; this is
SGLang's cache-aware router's prefix tree per worker, flattened into vLLM-style chained block hashes). A request goes
to the replica holding its longest known prefix when that prefix covers more than `min_match` of the prompt's full
blocks (SGLang's cache threshold: a short shared head, such as a common system prompt, does not pull every request
to one replica) and that replica has at most `imbalance` more requests outstanding than the least loaded one;
otherwise it goes to the least loaded replica (ties in turn, so that idle replicas share sequential requests).
Either way its prefixes now point at the chosen replica.

An affinity key (the `X-HF-Paged-Affinity` request header: a conversation or user id an orchestrator already hashes
on) pins: the first request of a key goes to the least loaded replica, and the key's later requests follow it while
that replica is up, whatever its load.

Pure Python and not thread-safe: the router calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["AffinityPolicy", "prefix_hashes"]


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: element `k` identifies `token_ids[:(k + 1) * block_size]`. Python
    hashes ints and tuples of ints the same way in every process (no hash randomisation), which a restart needs."""
    out: list[int] = []
    h = 0
    for k in range(min(len(token_ids) // block_size, max_blocks)):
        h = hash((h, tuple(token_ids[k * block_size:(k + 1) * block_size])))
        out.append(h)
    return out


class AffinityPolicy:
    """Prefix / key affinity with a least-load fallback (see the module docstring)."""

    def __init__(self, num_replicas: int, block_size: int, *, imbalance: int = 8, min_match: float = 0.5,
                 max_blocks: int = 64, capacity: int = 200_000) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        if not 0.0 <= min_match < 1.0:
            raise ValueError(f"min_match must be in [0, 1), got {min_match}")
        self.num_replicas, self.block_size, self.imbalance = num_replicas, block_size, imbalance
        self.min_match = min_match
        self.max_blocks, self.capacity = max_blocks, capacity
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self._keys: OrderedDict[str, int] = OrderedDict()  # affinity key -> replica
        self._turn = 0
        self.prefix_hits = 0  # requests sent where a known prefix of theirs was
        self.key_hits = 0  # requests sent where their affinity key was pinned
        self.balanced = 0  # requests with a known prefix sent elsewhere because of the load

    def choose(self, token_ids: Sequence[int], loads: Sequence[int | None], key: str | None = None) -> int:
        """The replica for a prompt. `loads[i]`: replica i's outstanding requests, None while it is down (never
        chosen). Raises LookupError when every replica is down."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"loads has {len(loads)} entries for {self.num_replicas} replicas")
        up = [i for i, load in enumerate(loads) if load is not None]
        if not up:
            raise LookupError("no replica is up")
        n = self.num_replicas
        least = min(up, key=lambda i: (loads[i], (i - self._turn) % n))
        self._turn = (least + 1) % n
        if key is not None:
            pinned = self._keys.get(key)
            if pinned is not None and loads[pinned] is not None:
                self._keys.move_to_end(key)
                self.key_hits += 1
                return pinned
            self._remember(self._keys, key, least)
            return least
        hashes = prefix_hashes(token_ids, self.block_size, self.max_blocks)
        chosen = least
        for k in range(len(hashes) - 1, -1, -1):  # the longest known prefix first
            owner = self._prefixes.get(hashes[k])
            if owner is None or loads[owner] is None:
                continue
            if (k + 1) / len(hashes) <= self.min_match:
                break  # too short a match to be worth more than the load
            if loads[owner] - loads[least] <= self.imbalance:
                chosen = owner
                self.prefix_hits += 1
            else:
                self.balanced += 1
            break
        for h in hashes:
            self._remember(self._prefixes, h, chosen)
        return chosen

    def _remember(self, table: OrderedDict, key, replica: int) -> None:
        table[key] = replica
        table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)
