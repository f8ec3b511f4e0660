"""On the Triton examples' PYTHONPATH (bench/triton_examples.py): attrdict, which Triton's
image_client.py imports for HTTP, predates Python 3.10 and imports ``collections.Mapping`` and its
siblings, gone since; they are put back as aliases of ``collections.abc``'s, so the example runs
unchanged on this Python."""

import collections
import collections.abc

for _name in ("Mapping", "MutableMapping", "Sequence", "Hashable", "Iterable"):
    if not hasattr(collections, _name):
        setattr(collections, _name, getattr(collections.abc, _name))
