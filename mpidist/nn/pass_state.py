"""What a pass's objects hold, taken at one moment: pinned while a CUDA graph uses it, put back after a
refused capture.

A captured pass reads and writes arrays the pass's objects (its layers, its
loss, the model's workspace) held while it was captured, and arrays made
before the capture are not the graph's own: an evaluation's cached row
indices or a workspace array of another shape, replaced later, would go
back to cupy's pool while the graph still writes them.  :class:`PassState`
keeps a reference to every value those objects hold (their attributes, and
one level into the dicts, lists and tuples among them), so nothing the
graph may use is freed while the graph is kept.  One level: an object held
deeper (a cuDNN plan in a layer's dict of plans) is kept whole, and what it
holds is safe as long as it never rebinds its arrays (a plan keeps its
workspace for its life); a helper that rebinds arrays it holds must be one
of the pass's objects itself.

The same record undoes a capture that failed half way: arrays made during
it exist but were never computed (a buffer whose zero borders were never
filled), and :meth:`PassState.restore` puts every attribute and the items
of every dict and list back as they were, so the eager pass that follows
makes them anew.
"""


class PassState:
    """The attributes of ``objects`` (and the items of their dicts and lists) as they are now.

    Args:
        objects: the objects a pass changes (layers, the loss, the workspace).
    """

    def __init__(self, objects):
        self.saved = []
        for obj in objects:
            attributes = dict(vars(obj))
            items = {
                name: type(value)(value) for name, value in attributes.items() if type(value) in (dict, list)
            }
            self.saved.append((obj, attributes, items))

    def pinned(self):
        """Every value held (a list to keep: nothing in it is freed while it is kept)."""
        values = []
        for _, attributes, items in self.saved:
            for value in attributes.values():
                values.append(value)
                if isinstance(value, (list, tuple)):
                    values.extend(value)
            for contents in items.values():
                values.extend(contents.values() if isinstance(contents, dict) else contents)
        return values

    def restore(self):
        """Put every attribute back as it was (those set since removed), and every dict's and list's items."""
        for obj, attributes, items in self.saved:
            state = vars(obj)
            for name in [name for name in state if name not in attributes]:
                del state[name]
            state.update(attributes)
            for name, contents in items.items():
                held = attributes[name]
                if isinstance(held, dict):
                    held.clear()
                    held.update(contents)
                else:
                    held[:] = contents
