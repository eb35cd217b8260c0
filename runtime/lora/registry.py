"""The adapters an engine serves, by name: registered at start (--lora-paths) or at run time
(load/unload), their weights held in memory for at most max_loaded_loras adapters, least recently
used first out (an evicted adapter is read again from its folder when a request names it)."""

from __future__ import annotations

import collections
import itertools
import threading

import torch

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.lora.adapter import LoraWeights, ModuleSlot, read_adapter

MAX_NAME_LEN = 256


class LoraRegistry:
    def __init__(self, slots: dict[str, ModuleSlot], dtype: torch.dtype,
                 device: torch.device | str, max_loaded: int | None = None):
        self.slots, self.dtype, self.device, self.max_loaded = slots, dtype, device, max_loaded
        self._lock = threading.Lock()
        self._uids = itertools.count(1)
        self._folders: dict[str, tuple[str, int]] = {}  # name -> (folder, uid)
        self._resident: collections.OrderedDict[str, LoraWeights] = collections.OrderedDict()

    def load(self, name: str, folder: str) -> LoraWeights:
        """Register adapter `name` from `folder`, reading it now (so a bad folder is refused
        here, naming what is wrong). A name already loaded is refused: unload it first."""
        _check_name(name)
        with self._lock:
            if name in self._folders:
                raise InvalidArgumentError("lora_name", name, "an adapter of that name is "
                                           "already loaded (unload it first)")
            uid = next(self._uids)
        weights = read_adapter(folder, name, uid, self.slots, self.dtype, self.device)
        with self._lock:
            if name in self._folders:  # loaded meanwhile by another caller
                raise InvalidArgumentError("lora_name", name, "an adapter of that name is "
                                           "already loaded (unload it first)")
            self._folders[name] = (str(folder), uid)
            self._keep(weights)
        return weights

    def unload(self, name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with it. A request
        naming it afterwards is refused."""
        with self._lock:
            if self._folders.pop(name, None) is None:
                raise InvalidArgumentError("lora_name", name, self._unknown())
            self._resident.pop(name, None)

    def resolve(self, name: str) -> LoraWeights:
        """The weights of adapter `name` for a request (read again if they were evicted)."""
        with self._lock:
            entry = self._folders.get(name)
            if entry is None:
                raise InvalidArgumentError("lora_path", name, self._unknown())
            weights = self._resident.get(name)
            if weights is not None:
                self._resident.move_to_end(name)
                return weights
        folder, uid = entry
        weights = read_adapter(folder, name, uid, self.slots, self.dtype, self.device)
        with self._lock:
            if self._folders.get(name) == entry:
                self._keep(weights)
        return weights

    def names(self) -> list[str]:
        with self._lock:
            return list(self._folders)

    def folders(self) -> dict[str, str]:
        with self._lock:
            return {name: folder for name, (folder, _) in self._folders.items()}

    def resident_names(self) -> list[str]:
        """Adapters whose weights are in memory now, least recently used first."""
        with self._lock:
            return list(self._resident)

    def _keep(self, weights: LoraWeights) -> None:
        """Hold `weights` as the most recently used; evict beyond max_loaded (lock held)."""
        self._resident[weights.name] = weights
        self._resident.move_to_end(weights.name)
        while self.max_loaded is not None and len(self._resident) > self.max_loaded:
            self._resident.popitem(last=False)

    def _unknown(self) -> str:
        loaded = ", ".join(sorted(self._folders)) or "none"
        return f"no adapter of that name is loaded (loaded: {loaded})"


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise InvalidArgumentError("lora_name", name,
                                   f"expected a non-empty string of at most {MAX_NAME_LEN} chars")
