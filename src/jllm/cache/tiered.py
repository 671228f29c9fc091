"""Two KV tiers behind one store interface: the local disk store (store.py) in front, the shared Redis
tier (shared.py) behind, so the engine calls lookup/load/save as on a KVStore.

lookup asks both; the longer common prefix wins, the local tier on a tie (a disk read beats a network one).
load reads the tier lookup chose (the local one first when there was no lookup, then the shared one); an
entry read from the shared tier is also written into the local tier, on a background thread, so the next
turn on this replica reads it from disk. save writes both tiers (the engine calls it on its own background
thread). Each tier keeps its own cap; a fault of one tier is that tier's miss, never the other's.
"""

from __future__ import annotations

import threading

from jllm.cache.shared import RedisTier
from jllm.cache.store import KVState, KVStore


class TieredStore:
    def __init__(self, local: KVStore, shared: RedisTier):
        self.local, self.shared = local, shared
        self._chosen: dict[str, str] = {}      # entry name -> "local" or "shared", from the last lookup
        self._copying: threading.Thread | None = None

    @property
    def dir(self):
        return self.local.dir

    def lookup(self, tokens: list[int], conv_id: str | None = None) -> tuple[str | None, int]:
        local = self.local.lookup(tokens, conv_id)
        if local[1] == len(tokens):
            self._chosen = {local[0]: "local"}
            return local
        shared = self.shared.lookup(tokens, conv_id)
        best, tier = (shared, "shared") if shared[1] > local[1] else (local, "local")
        self._chosen = {best[0]: tier} if best[0] is not None else {}
        return best

    def load(self, name: str, n_tokens: int) -> KVState | None:
        if self._chosen.get(name) != "shared":
            state = self.local.load(name, n_tokens)
            if state is not None:
                return state
        full = self.shared.load(name)           # all of it, for the local copy
        if full is None or n_tokens > len(full.tokens):
            return None
        self.wait_copies()
        self._copying = threading.Thread(target=self.local.save, args=(name, full), name="jllm-kv-copy")
        self._copying.start()
        return KVState(tokens=full.tokens[:n_tokens],
                       **{k: None if t is None else t[:, :, :n_tokens]
                          for k, t in (("target_k", full.target_k), ("target_v", full.target_v),
                                       ("draft_k", full.draft_k), ("draft_v", full.draft_v))})

    def wait_copies(self) -> None:
        """Wait for the local copy of an entry read from the shared tier (before a save, so that the copy
        of an older state never lands after a newer one)."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None

    def save(self, conv_id: str | None, state: KVState) -> str | None:
        self.wait_copies()
        name = self.local.save(conv_id, state)
        return self.shared.save(conv_id, state) or name

    def entries(self) -> list[dict]:
        """The local tier's entries, then the shared tier's, each row with its "tier"."""
        return [{**row, "tier": "local"} for row in self.local.entries()] + \
               [{**row, "tier": "shared"} for row in self.shared.entries()]

    def remove(self, conv_id: str) -> bool:
        self.wait_copies()
        local = self.local.remove(conv_id)
        return self.shared.remove(conv_id) or local

    def clear(self) -> int:
        self.wait_copies()
        return self.local.clear() + self.shared.clear()

    def stats(self) -> dict:
        """The local tier's stats, with the shared tier's under "shared"."""
        return {**self.local.stats(), "shared": self.shared.stats()}
