"""MemoryLedger: bytes held by this rank, by category and tier, current and peak.

Categories follow the ZeRO paper's split of training memory: model states (params, grads, optimizer)
and residual states (activations, buffers: temporary copies such as the parameters ZeRO-3 gathers for
compute). Tiers are where the bytes live: device, cpu or disk (offload). Engines `set` what they hold;
activations come live from the autograd engine's meter, so the peak is the true high-water mark of the
step, not a sum of separate peaks. Temporary buffers that come and go within a step (ZeRO-3's gathered
parameters, a gradient bucket) come live the same way, from `buffer_meter`. A ledger subscribes to
the three meters when made and unsubscribes on `close()` (or at the end of a `with` block, or when it is
garbage collected): any number of ledgers may listen, none displaces another.
Lesson: lessons/04_zero.md.
"""

from __future__ import annotations

import weakref
from collections import Counter

from minipar.core import autograd
from minipar.core.hooks import HookList, RemovableHandle

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
TIERS = ("device", "cpu", "disk")

# The same live counter as autograd's activation meter, for temporary buffers: an engine `add`s the
# bytes when it allocates one and `release`s them when it drops it.
buffer_meter = autograd.ActivationMeter()


class TierMeter:
    """Live bytes of a model-state category in a tier, for engines whose model states move between
    tiers during a step (memory/offload.py): the ledger listens, so its peaks include every move."""

    def __init__(self):
        self.listeners = HookList()

    def subscribe(self, listener, first: bool = False) -> RemovableHandle:
        """Call `listener(category, nbytes, tier)` on every `set`, in order (`first`: ahead of the others)."""
        return self.listeners.add(listener, first)

    def set(self, category: str, nbytes: int, tier: str):
        self.listeners.call_all(category, nbytes, tier)


tier_meter = TierMeter()


class MemoryLedger:
    def __init__(self):
        self.current = {(c, t): 0 for c in CATEGORIES for t in TIERS}
        self.peak = dict(self.current)
        self.held_peak = dict.fromkeys(CATEGORIES, 0)  # of each category summed over the tiers
        self.device_peak = 0
        self._device_total = 0  # the sum of current device bytes, kept up to date by set: set runs on
        # every saved activation, hundreds of times a step, and must not re-add fifteen numbers each time
        self._held = dict.fromkeys(CATEGORIES, 0)  # each category summed over the tiers, kept the same way
        self.buffer_sizes = Counter()  # size -> temporary buffers allocated this window (fragmentation)
        self.subscriptions = [listen_weakly(autograd.activation_meter, self._activations_changed),
                              listen_weakly(buffer_meter, self._buffers_changed),
                              listen_weakly(tier_meter, self.set)]
        weakref.finalize(self, close_all, list(self.subscriptions))  # a ledger dropped unclosed leaves too
        self.listeners = HookList()  # told of every change (a trace's counters, trainer/trace.py)

    def subscribe(self, listener) -> RemovableHandle:
        """Call `listener(category, held_bytes)` whenever a category's bytes change, held_bytes summed
        over the tiers (`held`): every saved activation, every offload move. None without --trace."""
        return self.listeners.add(listener)

    def close(self):
        """Stop listening to the meters: what the ledger holds stays readable, but it records no more."""
        close_all(self.subscriptions)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def set(self, category: str, nbytes: int, tier: str = "device"):
        """Record that this rank now holds `nbytes` of `category` in `tier`."""
        key, nbytes = (category, tier), int(nbytes)
        grown = nbytes - self.current[key]
        if tier == "device":
            self._device_total += grown
        held = self._held[category] = self._held[category] + grown
        self.current[key] = nbytes
        if nbytes > self.peak[key]:
            self.peak[key] = nbytes
        if held > self.held_peak[category]:
            self.held_peak[category] = held
        if self._device_total > self.device_peak:
            self.device_peak = self._device_total
        if self.listeners:
            self.listeners.call_all(category, held)

    def add(self, category: str, nbytes: int, tier: str = "device"):
        self.set(category, self.current[(category, tier)] + nbytes, tier)

    def _activations_changed(self, nbytes: int):
        self.set("activations", nbytes)

    def _buffers_changed(self, nbytes: int):
        grown = nbytes - self.current[("buffers", "device")]
        if grown > 0:  # one buffer_meter.add: a temporary buffer of `grown` bytes was allocated
            self.buffer_sizes[grown] += 1
        self.set("buffers", nbytes)

    def held(self, category: str) -> int:
        """Bytes of `category` in all tiers (offload moves them between tiers: the sum is what is held)."""
        return self._held[category]

    def device_total(self) -> int:
        return self._device_total

    def reset_peaks(self):
        """Start a new window (a step): peaks restart from what is held now."""
        self.peak = dict(self.current)
        self.held_peak = {category: self.held(category) for category in CATEGORIES}
        self.device_peak = self.device_total()
        self.buffer_sizes = Counter()

    def report(self) -> dict:
        """The `mem` object of the train log: this rank's bytes for the window since reset_peaks."""
        return {
            "params": self.held("params"),
            "grads": self.held_peak["grads"],
            "optimizer": self.held("optimizer"),
            "activations_peak": self.peak[("activations", "device")],
            "buffers_peak": self.held_peak["buffers"],
            "buffer_allocations": sum(self.buffer_sizes.values()),  # temporary buffers allocated,
            "buffer_sizes": len(self.buffer_sizes),  # of how many sizes (many sizes fragment memory)
            "device_peak": self.device_peak,
            "by_tier": {t: sum(self.current[(c, t)] for c in CATEGORIES) for t in TIERS},
        }


def model_states(mem: dict) -> int:
    """The model-state bytes of a `mem` object (MemoryLedger.report, a train log's record): parameters,
    gradients and optimizer states, what ZeRO partitions."""
    return mem["params"] + mem["grads"] + mem["optimizer"]


def listen_weakly(meter, method) -> RemovableHandle:
    """Subscribe a bound method of a ledger without keeping the ledger alive (the meters are global)."""
    method = weakref.WeakMethod(method)

    def listener(*args):
        alive = method()
        if alive is not None:
            alive(*args)

    return meter.subscribe(listener)


def close_all(handles):
    for handle in handles:
        handle.remove()
