"""Convolutions on a GPU through cuDNN's graph API (NVIDIA's cudnn frontend), where it is installed.

CuPy 14 dropped its cuDNN bindings; NVIDIA's ``cudnn`` package (the
``nvidia-cudnn-frontend`` wheel, in the ``gpu`` extra, over
``nvidia-cudnn-cu13``) describes a convolution as a small graph that cuDNN
plans and runs.  On a GPU a convolution's forward pass, its input gradient
and its weight gradient each become one such graph, built once per shape
(:class:`Plans`): where mpidist's own path gathers windows into a column
matrix and multiplies (on an H200 the ``cnn`` ran at 0.31-0.45 of torch,
which calls cuDNN), cuDNN picks its own kernel.

Everything is in the layer's memory order: the input as it comes (NCHW, or
the channels-last view a convolution before handed on), the output and the
input gradient channels-last, the filters as the parameters hold them.  In
float32, plans that would compute in TF32, non-deterministically or by
down-converting are left out, so the numbers are float32's (torch's
``allow_tf32 = False``); 16-bit types may use tensor cores.

Where the package is missing, the type is float64 or a plan cannot be made,
the layer keeps its own path (:func:`refused` says why, and :data:`PATHS`
counts which path each shape took: ``gpu/bench.py`` prints them);
``MPIDIST_CUDNN=0`` turns this path off.
"""

import collections
import dataclasses

import numpy as np

from ..runtime.xp import capturing, turned_off

#: shapes per path: ``{"cudnn": count, "im2col: <why>": count}``
PATHS = collections.Counter()


class Unsupported(Exception):
    """cuDNN cannot run this convolution here (the message says why)."""


def refused(dtype):
    """Why cuDNN will not run convolutions of ``dtype`` on this process, or None where it may."""
    if turned_off("MPIDIST_CUDNN"):
        return "MPIDIST_CUDNN=0"
    if np.dtype(dtype).name not in _TYPE_NAMES:
        return f"cuDNN's graphs take float32, float16 and bfloat16, not {np.dtype(dtype).name}"
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return "the cudnn frontend is not installed (pip install 'mpidist[gpu]')"
    return None


_TYPE_NAMES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Dims and strides (in elements) of one convolution's tensors, as cuDNN is told them.

    >>> g = Geometry.of((8, 3, 10, 10), (300, 100, 10, 1), 16, (3, 3), 1, ((1, 1), (1, 1)), (10, 10))
    >>> g.y_stride, g.w_stride, g.dx_stride
    ((1600, 1, 160, 16), (27, 9, 3, 1), (300, 1, 30, 3))
    """

    x_dim: tuple
    x_stride: tuple
    w_dim: tuple
    w_stride: tuple
    y_dim: tuple
    y_stride: tuple
    dx_stride: tuple
    pre: tuple
    post: tuple
    stride: tuple

    @classmethod
    def of(cls, x_shape, x_strides, filters, kernel_hw, stride, pads_hw, out_hw):
        """From the input's shape and strides (elements), the filters, kernel, stride, ``((top, bottom),
        (left, right))`` padding and output size."""
        n, c, (kh, kw), (ho, wo), f = x_shape[0], x_shape[1], kernel_hw, out_hw, filters
        ((top, bottom), (left, right)) = pads_hw
        return cls(
            x_dim=tuple(x_shape),
            x_stride=unit_strides(x_shape, x_strides),
            w_dim=(f, c, kh, kw),
            w_stride=unit_strides((f, c, kh, kw), (c * kh * kw, kh * kw, kw, 1)),
            y_dim=(n, f, ho, wo),
            y_stride=unit_strides((n, f, ho, wo), channels_last((n, f, ho, wo))),
            dx_stride=unit_strides(x_shape, channels_last(x_shape)),
            pre=(top, left),
            post=(bottom, right),
            stride=(stride, stride),
        )


def channels_last(shape):
    """The strides (elements) of an ``(N, C, H, W)`` array stored as ``(N, H, W, C)``."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def unit_strides(shape, strides):
    """``strides`` (of ``(N, C, H, W)``) with each axis of extent 1 given the stride it has in the array's
    own layout, packed: the product of the extents inside it.

    A kernel never reads such a stride, but cuDNN tells layouts (NCHW,
    channels-last) by the strides' order, and a view's (0, where an axis was
    added: a Conv1D's height) or an arbitrary one fits none.  As PyTorch's
    ``fixSizeOneDimStride``: the axes are walked from the innermost, C first
    where the channels are innermost (the array is channels-last), else W.
    """
    n, c, h, w = shape
    channels_last = c > 1 and strides[1] == 1
    order = (1, 3, 2, 0) if channels_last else (3, 2, 1, 0)
    fixed, inside = [int(step) for step in strides], 1
    for axis in order:
        if shape[axis] == 1:
            fixed[axis] = inside
        else:
            inside *= shape[axis]
    return tuple(fixed)


def element_strides(array):
    """``array``'s strides in elements."""
    return tuple(step // array.itemsize for step in array.strides)


class Plans:
    """The three graphs of one convolution's shape (forward, input gradient, weight gradient), built once,
    with their workspace; :meth:`forward`, :meth:`input_grad` and :meth:`weight_grad` run them.

    Raises:
        Unsupported: a graph cannot be built (cuDNN has no plan for it here).
    """

    def __init__(self, xp, geometry, dtype):
        import cudnn

        self.xp, self.cudnn, self.geometry = xp, cudnn, geometry
        self.type = getattr(cudnn.data_type, _TYPE_NAMES[np.dtype(dtype).name])
        self.exact = np.dtype(dtype) == np.float32  # (no TF32: float32's numbers, as the host's)
        self.handle = _handle(cudnn)
        try:
            self.graphs = [self._fprop(), self._dgrad(), self._wgrad()]
            self.workspace = xp.empty(max(graph.get_workspace_size() for graph, _ in self.graphs), np.uint8)
        except Exception as err:  # (the frontend's errors are of many kinds: each means "not here")
            raise Unsupported(f"{type(err).__name__}: {err}") from None

    def forward(self, x, w, y):
        """``y`` (channels-last, as :attr:`Geometry.y_stride`) = the convolution of ``x`` by ``w``."""
        self._run(0, x, w, y)

    def input_grad(self, dy, w, dx):
        """``dx`` (channels-last) = the input gradient of ``dy`` (laid out as ``y``)."""
        self._run(1, dy, w, dx)

    def weight_grad(self, x, dy, dw):
        """``dw`` (the filters' layout) = the weight gradient of ``x`` and ``dy``."""
        self._run(2, x, dy, dw)

    def _run(self, index, *arrays):
        graph, tensors = self.graphs[index]
        self.cudnn.set_stream(self.handle, self.xp.cuda.get_current_stream().ptr)
        graph.execute(dict(zip(tensors, arrays)), self.workspace, handle=self.handle)

    def _graph(self):
        cudnn = self.cudnn
        float32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(
            io_data_type=self.type,
            intermediate_data_type=float32,
            compute_data_type=float32,
            handle=self.handle,
        )
        if self.exact:
            note = cudnn.numerical_note
            graph.deselect_numeric_notes([note.TENSOR_CORE, note.DOWN_CONVERT_INPUTS, note.NONDETERMINISTIC])
        return graph

    def _tensor(self, graph, name, dim, stride):
        return graph.tensor(name=name, dim=list(dim), stride=list(stride), data_type=self.type)

    def _window(self):
        g = self.geometry
        return {
            "pre_padding": list(g.pre),
            "post_padding": list(g.post),
            "stride": list(g.stride),
            "dilation": [1, 1],
            "compute_data_type": self.cudnn.data_type.FLOAT,
        }

    def _built(self, graph, output, dim, stride, inputs):
        output.set_output(True).set_data_type(self.type).set_dim(list(dim)).set_stride(list(stride))
        heuristics = self.cudnn.heur_mode
        graph.build([heuristics.A, heuristics.FALLBACK])
        return graph, (*inputs, output)

    def _fprop(self):
        g, graph = self.geometry, self._graph()
        x, w = self._tensor(graph, "x", g.x_dim, g.x_stride), self._tensor(graph, "w", g.w_dim, g.w_stride)
        y = graph.conv_fprop(image=x, weight=w, name="fprop", **self._window())
        return self._built(graph, y, g.y_dim, g.y_stride, (x, w))

    def _dgrad(self):
        g, graph = self.geometry, self._graph()
        dy, w = self._tensor(graph, "dy", g.y_dim, g.y_stride), self._tensor(graph, "w", g.w_dim, g.w_stride)
        dx = graph.conv_dgrad(loss=dy, filter=w, name="dgrad", **self._window())
        return self._built(graph, dx, g.x_dim, g.dx_stride, (dy, w))

    def _wgrad(self):
        g, graph = self.geometry, self._graph()
        x, dy = self._tensor(graph, "x", g.x_dim, g.x_stride), self._tensor(graph, "dy", g.y_dim, g.y_stride)
        dw = graph.conv_wgrad(image=x, loss=dy, name="wgrad", **self._window())
        return self._built(graph, dw, g.w_dim, g.w_stride, (x, dy))


_HANDLES = {}


def _handle(cudnn):
    """This process's cuDNN handle on the current device (made once)."""
    import cupy

    device = cupy.cuda.Device().id
    if device not in _HANDLES:
        _HANDLES[device] = cudnn.create_handle()
    return _HANDLES[device]


# ---- a convolution layer's passes on this path (mpidist.nn.conv's _ChannelsLastConv calls them) ----


def plans_for(layer, x):
    """The :class:`Plans` of ``layer`` (a convolution) for the 4-D input ``x``, or None: its own path
    (made once per shape, strides and type; :data:`PATHS` counts which path each took)."""
    if layer.xp.__name__ == "numpy":
        return None
    made, key = _plans_of(layer), _key(x)
    if key not in made:
        why = refused(x.dtype) or (None if x.dtype == layer.params["W"].dtype else "mixed types")
        plans = None
        if why is None:
            geometry = Geometry.of(
                x.shape, element_strides(x), layer.filters, layer.kernel_hw, layer.stride, layer.pads_hw,
                layer.out_hw,
            )  # fmt: skip
            try:
                plans = Plans(layer.xp, geometry, x.dtype)
            except Unsupported as err:
                if capturing(layer.xp):  # (the capture's failure, not the shape's: the pass runs eagerly)
                    raise
                why = str(err)[:200]
        made[key] = plans
        PATHS["cudnn" if plans is not None else f"im2col: {why}"] += 1
    return made[key]


#: the bytes an input's start is a multiple of, or it is copied first: a micro-batch's or a slice's rows
#: start anywhere, and cuDNN's plans read aligned memory
ALIGNMENT = 256


def forward(layer, x):
    """``(output, plans, input)`` of ``layer`` for ``x`` (4-D) through cuDNN, or None: its own path.

    The output is an ``(N, F, Ho, Wo)`` view of channels-last memory, the bias
    added; the input is ``x``, or its aligned copy, which the backward pass
    reads.  A plan that fails to run takes the shape off this path for good
    (before anything of the step was written by it).
    """
    if layer.xp.__name__ != "numpy" and x.data.ptr % ALIGNMENT:
        x = _copy(layer, "x_cudnn", x)
    plans = plans_for(layer, x)
    if plans is None:
        return None
    (ho, wo), f = layer.out_hw, layer.filters
    y = layer.scratch("y_cudnn", (len(x), ho, wo, f), x.dtype)
    try:
        plans.forward(x, _weights(layer, x.dtype), y.transpose(0, 3, 1, 2))
    except Exception as err:  # (the frontend's errors are of many kinds)
        if capturing(layer.xp):  # (the capture's failure, not the plan's: the pass runs eagerly, with it)
            raise
        _drop(layer, x, f"running its plan: {type(err).__name__}: {err}")
        return None
    y += layer.params["b"]  # (channels innermost: the bias along the last axis)
    return y.transpose(0, 3, 1, 2), plans, x


def backward_params(layer, plans, x, dy):
    """Fill ``layer``'s gradients from ``dy`` (4-D) and its input ``x``; ``dy`` channels-last,
    ``(N, Ho, Wo, F)``."""
    rows = channels_last_copy(layer, dy)
    dw = layer.scratch("dw_cudnn", plans.geometry.w_dim, dy.dtype)
    plans.weight_grad(x, rows.transpose(0, 3, 1, 2), dw)
    layer.grads["W"].reshape(dw.shape)[...] = dw
    rows.reshape(-1, layer.filters).sum(axis=0, out=layer.grads["b"])
    return rows


def input_grad(layer, plans, rows):
    """The input gradient, ``(N, C, H, W)`` over channels-last memory, of ``rows`` (from
    :func:`backward_params`)."""
    n, c, h, w = plans.geometry.x_dim
    dx = layer.scratch("dx_cudnn", (n, h, w, c), rows.dtype)
    plans.input_grad(rows.transpose(0, 3, 1, 2), _weights(layer, rows.dtype), dx.transpose(0, 3, 1, 2))
    return dx.transpose(0, 3, 1, 2)


def channels_last_copy(layer, dy):
    """``dy`` (4-D) as ``(N, Ho, Wo, F)`` contiguous: its own memory where it is laid out so (and aligned),
    else a copy."""
    rows = dy.transpose(0, 2, 3, 1)
    aligned = layer.xp.__name__ == "numpy" or rows.data.ptr % ALIGNMENT == 0
    return rows if rows.flags.c_contiguous and aligned else _copy(layer, "dy_cudnn", rows)


def _copy(layer, name, array):
    """``array`` copied into ``layer``'s workspace array ``name`` (contiguous, aligned)."""
    out = layer.scratch(name, array.shape, array.dtype)
    out[...] = array
    return out


def _drop(layer, x, why):
    """Take ``x``'s shape off this path for ``layer`` (mpidist's own path from now on), counted as such."""
    _plans_of(layer)[_key(x)] = None
    PATHS["cudnn"] -= 1
    PATHS[f"im2col: {why[:200]}"] += 1


def _weights(layer, dtype):
    """The filters as ``(F, C, kh, kw)`` in a workspace array of their own: a parameter's view of the flat
    buffer may start anywhere, and cuDNN's kernels read aligned memory."""
    f, c, (kh, kw) = layer.filters, layer.in_channels, layer.kernel_hw
    out = layer.scratch("w_cudnn", (f, c, kh, kw), dtype)
    out[...] = layer.params["W"].reshape(out.shape)
    return out


def _plans_of(layer):
    """``layer``'s plans (or None: its own path) by :func:`_key` of their input, made here once."""
    return layer.__dict__.setdefault("_cudnn_plans", {})


def _key(x):
    """What a plan is built for: the input's shape, strides and type."""
    return x.shape, element_strides(x), x.dtype.str
