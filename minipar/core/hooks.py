"""Hooks with removable handles: how one object lets others act at its moments without patching it.

A technique that needs to run at a module's forward or backward (ZeRO gathers parameters before a
unit's forward and reduce-scatters its gradients as backward leaves it), or a ledger that wants to hear
every change of a memory meter, registers a function in a `HookList` and gets a `RemovableHandle`
back, the shape PyTorch gives `register_forward_hook`. Nobody reassigns anybody's methods, so several
listeners coexist in a known order, each can leave without knowing the others, and `type(m).forward`
is always what runs. Lesson: lessons/01_autograd.md.
"""

from __future__ import annotations

import itertools

_keys = itertools.count()


class RemovableHandle:
    """Takes one hook out of the list it was added to. `remove()` twice is harmless; as a context
    manager the hook lives for the `with` block."""

    def __init__(self, hooks: HookList, key: int):
        self.hooks, self.key = hooks, key

    def remove(self):
        self.hooks.discard(self.key)

    def __eq__(self, other):
        return isinstance(other, RemovableHandle) and (self.hooks, self.key) == (other.hooks, other.key)

    def __hash__(self):
        return hash(self.key)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.remove()


class HookList:
    """Functions called in the order they were added (`first=True`: ahead of all the others)."""

    def __init__(self):
        self._hooks: dict[int, object] = {}  # insertion-ordered: the call order

    def add(self, hook, first: bool = False) -> RemovableHandle:
        key = next(_keys)
        self._hooks = {key: hook, **self._hooks} if first else {**self._hooks, key: hook}
        return RemovableHandle(self, key)

    def discard(self, key: int):
        self._hooks.pop(key, None)

    def handles(self) -> list[RemovableHandle]:
        """A handle for each hook still in the list, in call order."""
        return [RemovableHandle(self, key) for key in self._hooks]

    def last(self, default=None):
        """The hook added last (not one added with `first=True` ahead of others), or `default`."""
        return next(reversed(self._hooks.values()), default)

    def __iter__(self):
        return iter(list(self._hooks.values()))  # a copy: a hook may remove itself (or others) when called

    def __len__(self):
        return len(self._hooks)

    def __bool__(self):
        return bool(self._hooks)

    def call_all(self, *args):
        """Call every hook with `args`, in order (listeners: their results are not used)."""
        if not self._hooks:  # the common case on the hot path (every saved activation), made cheap
            return
        for hook in self:
            hook(*args)
