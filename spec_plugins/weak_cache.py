"""A weakly keyed cache that copies and pickles as empty.

Caches keyed by a live object (a draft model's proposers per target runtime, a tree sizer per
proposer) must not keep the key alive, so they are weak dictionaries; but they sit on objects
users copy and pickle (a draft model after ``generate()``, ``torch.save``), and a weak dictionary
does not pickle. What they hold is built again on first use, so a copy or an unpickled object
starts with the cache empty.
"""

from __future__ import annotations

import weakref


class WeakCache(weakref.WeakKeyDictionary):
    """A ``WeakKeyDictionary`` whose copies and pickles start empty."""

    def __reduce__(self) -> tuple:
        return type(self), ()

    def __deepcopy__(self, memo: dict) -> "WeakCache":
        return type(self)()

    def __copy__(self) -> "WeakCache":
        return type(self)()

