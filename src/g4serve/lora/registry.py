"""The served LoRA adapters by name, each pinned to one slot of ``LoRAWeights`` while loaded.

Requests hold a reference on their adapter's slot from admission to finish. Unloading takes the name away
at once (new requests get "no such model"), and the slot is cleared and reused only once its last request
has finished: a running request never sees its adapter change under it.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from g4serve.layers.lora import LoRAWeights
from g4serve.lora.adapter import LoRAAdapter

# What an adapter may be called (it is a ``model`` name on the wire): no spaces or control characters.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass
class _Loaded:
    name: str
    slot: int
    uid: int  # distinct per load: a reloaded name never matches cached prefixes of the adapter it replaced
    refs: int = 0


class LoRARegistry:
    def __init__(self, weights: LoRAWeights):
        self.weights = weights
        self._by_name: dict[str, _Loaded] = {}
        self._slots: list[_Loaded | None] = [None] * weights.max_loras  # includes unloaded, still referenced
        self._uids = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return self.weights.max_loras

    def names(self) -> list[str]:
        return list(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def check_name(self, name: str) -> None:
        """Whether an adapter could be loaded under ``name`` now: a usable name, not taken, and a free slot
        (ValueError saying which not). The engines call it before they read the adapter's files, so a full
        server refuses a load without reading a byte (up to ~1.9 GB at rank 64 for 31B); ``add`` checks
        again, as a load may have taken the name or the last slot since."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            shown = repr(name) if len(repr(name)) <= 60 else f"{repr(name)[:57]}..."
            raise ValueError(
                f"lora_name: {shown} is not a usable name (1-128 letters, digits and ._:/@+-, "
                "starting with a letter or digit)"
            )
        if name in self._by_name:
            raise ValueError(f"lora_name: an adapter named '{name}' is already loaded")
        if self._free_slot() is None:
            raise ValueError(
                f"lora_name: all {self.max_loras} adapter slots are in use (--max-loras); unload one first"
            )

    def _free_slot(self) -> int | None:
        """A slot holding no adapter: no loaded one, and none still finishing requests after its unload."""
        return next((i for i, entry in enumerate(self._slots) if entry is None), None)

    def add(self, name: str, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` under ``name`` into a free slot; ValueError as ``check_name``."""
        self.check_name(name)
        slot = self._free_slot()
        assert slot is not None  # check_name found one
        self.weights.load(slot, adapter.weights)
        entry = _Loaded(name, slot, next(self._uids))
        self._slots[slot] = self._by_name[name] = entry

    def remove(self, name: str) -> None:
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise KeyError(name)
        if entry.refs == 0:
            self._free(entry)

    def acquire(self, name: str) -> tuple[int, int]:
        """(slot, uid) of the adapter a new request uses, now referenced; ValueError if not loaded."""
        entry = self._by_name.get(name)
        if entry is None:
            raise ValueError(f"model: no LoRA adapter named '{name}' is loaded")
        entry.refs += 1
        return entry.slot, entry.uid

    def release(self, slot: int) -> None:
        entry = self._slots[slot]
        assert entry is not None and entry.refs > 0, "released a slot nobody holds"
        entry.refs -= 1
        if entry.refs == 0 and self._by_name.get(entry.name) is not entry:
            self._free(entry)

    def _free(self, entry: _Loaded) -> None:
        self.weights.clear(entry.slot)
        self._slots[entry.slot] = None


__all__ = ["LoRARegistry"]
