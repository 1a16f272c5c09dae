"""Convolution algorithms for the three passes of ``Conv2d``, each with its workspace.

A :class:`ConvAlgorithm` computes one or more of the passes of a 2-D convolution without bias:

* ``forward``:          x (n, C, H, W), w (O, C/g, kh, kw) -> y (n, O, Ho, Wo)
* ``backward_data``:    dy (n, O, Ho, Wo), w -> dx (n, C, H, W)
* ``backward_filter``:  dy, x -> dw (O, C/g, kh, kw), summed over the n samples

CPU algorithms (torch CPU build): PyTorch's own choice (``default``), oneDNN NCHW forced,
oneDNN channels_last, NNPACK (forward), im2col through ``slow_conv2d``, im2col through
``unfold`` + matmul, FFT through ``torch.fft`` and Winograd F(2x2, 3x3) written in tensor ops.
They differ in time and in temporary memory (workspace), which is what μ-cuDNN trades.
``workspace_bytes`` states each algorithm's own estimate; the planner uses the *measured* peak
(see :mod:`batchcraft.microbatching.measure`).

Element types: an algorithm declares the floating dtypes it is written for (``dtypes``) and, for
each (pass, dtype, device), a tiny call is tried once per process: an algorithm whose kernels
are missing there (NNPACK other than float32, ``torch.fft`` in 16 bits, oneDNN in float64) says why
(:meth:`ConvAlgorithm.unsupported_reason`) and is skipped. Results keep the input's dtype;
backward-filter partial sums of 16-bit micro-batches are accumulated in float32.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806), §II (algorithms and workspace); Lavin & Gray,
"Fast Algorithms for Convolutional Neural Networks" (arXiv 1509.09308) for Winograd F(2x2, 3x3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PASSES", "FLOATING_DTYPES", "ConvGeometry", "ConvAlgorithm", "ALGORITHMS", "get_algorithm",
           "algorithms_for", "unsupported_algorithms", "accumulator_dtype"]

PASSES = ("forward", "backward_data", "backward_filter")
FLOATING_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_F32 = 4


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which dW partial sums over micro-batches are added (float32 for 16-bit types)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(frozen=True)
class ConvGeometry:
    """Shape and hyper-parameters of one ``Conv2d`` call, without the batch size.

    All sizes are per sample; ``key()`` is the stable string used by the measurement cache.
    """

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    height: int
    width: int

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, input_hw: tuple[int, int]) -> "ConvGeometry":
        return cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), tuple(conv.stride),
                   tuple(conv.padding), tuple(conv.dilation), conv.groups, int(input_hw[0]), int(input_hw[1]))

    @property
    def output_hw(self) -> tuple[int, int]:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return ((self.height + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
                (self.width + 2 * pw - dw * (kw - 1) - 1) // sw + 1)

    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.out_channels, self.in_channels // self.groups, *self.kernel)

    def input_shape(self, n: int) -> tuple[int, int, int, int]:
        return (n, self.in_channels, self.height, self.width)

    def output_shape(self, n: int) -> tuple[int, int, int, int]:
        return (n, self.out_channels, *self.output_hw)

    def result_shape(self, pass_: str, n: int) -> tuple[int, ...]:
        """Shape of what ``pass_`` returns for ``n`` samples."""
        return {"forward": self.output_shape, "backward_data": self.input_shape}.get(
            pass_, lambda _n: self.weight_shape())(n)

    def key(self) -> str:
        k, s, p, d = (f"{a}x{b}" for a, b in (self.kernel, self.stride, self.padding, self.dilation))
        return (f"c{self.in_channels}-o{self.out_channels}-k{k}-s{s}-p{p}-d{d}-g{self.groups}"
                f"-h{self.height}-w{self.width}")

    def flops(self, n: int) -> int:
        """Multiply-adds x 2 of one pass for ``n`` samples (all three passes cost the same)."""
        ho, wo = self.output_hw
        return 2 * n * self.out_channels * ho * wo * (self.in_channels // self.groups) * self.kernel[0] * self.kernel[1]


class ConvAlgorithm:
    """One way to compute some passes of a convolution. Subclasses override the pass methods.

    Attributes:
        name (str): registry name, stable (it is part of the cache key).
        passes (tuple[str, ...]): the passes it implements.
    """

    name = "abstract"
    passes: tuple[str, ...] = PASSES
    dtypes: tuple[torch.dtype, ...] = FLOATING_DTYPES
    dtype_note = ""  # why the dtypes missing from ``dtypes`` are not offered

    def supports(self, geom: ConvGeometry, pass_: str, n: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> bool:
        """Whether this algorithm can run ``pass_`` of ``geom`` at micro-batch ``n`` in ``dtype`` on ``device``."""
        return (pass_ in self.passes and self.unsupported_reason(pass_, dtype, device) is None
                and self._supports(geom, n, dtype))

    def unsupported_reason(self, pass_: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        """None if ``pass_`` runs in ``dtype`` on ``device``, else why not (declared, or the kernel's error)."""
        if pass_ not in self.passes:
            return f"{self.name} does not implement {pass_}"
        if dtype not in self.dtypes:
            return f"{self.name} is not offered for {str(dtype).replace('torch.', '')}" + (
                f": {self.dtype_note}" if self.dtype_note else "")
        return _kernel_probe(self, pass_, dtype, str(torch.device(device)))

    def _supports(self, geom: ConvGeometry, n: int, dtype: torch.dtype = torch.float32) -> bool:
        return geom.groups == 1

    def workspace_bytes(self, geom: ConvGeometry, pass_: str, n: int) -> int:
        """Stated (predicted) temporary bytes of one call at micro-batch ``n``, float32."""
        return 0

    def run(self, pass_: str, a: torch.Tensor, b: torch.Tensor, geom: ConvGeometry) -> torch.Tensor:
        """Run ``pass_``: (x, w) for forward, (dy, w) for backward_data, (dy, x) for backward_filter."""
        return getattr(self, pass_)(a, b, geom)

    def forward(self, x, w, geom):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward_data(self, dy, w, geom):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward_filter(self, dy, x, geom):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<ConvAlgorithm {self.name}>"


def _conv_backward(dy, x, w, geom, mask):
    """ATen's convolution_backward with PyTorch's backend selection (returns dx or dw)."""
    dx, dw, _ = torch.ops.aten.convolution_backward(
        dy, x, w, None, list(geom.stride), list(geom.padding), list(geom.dilation), False, [0, 0],
        geom.groups, mask)
    return dx if mask[0] else dw


def _meta_input(geom: ConvGeometry, n: int, like: torch.Tensor | None = None, memory_format=torch.contiguous_format):
    # Uninitialised, of the dtype and device of ``like``: convolution_backward reads only its shape
    # and format (a float32 stand-in made ATen pick float32 kernels for float64 inputs).
    opts = {} if like is None else dict(dtype=like.dtype, device=like.device)
    return torch.empty(geom.input_shape(n), memory_format=memory_format, **opts)


def _meta_weight(geom: ConvGeometry, like: torch.Tensor, memory_format=torch.contiguous_format):
    return torch.empty(geom.weight_shape(), dtype=like.dtype, device=like.device).contiguous(memory_format=memory_format)


def selected_backend(geom: ConvGeometry, n: int, memory_format=torch.contiguous_format,
                     dtype: torch.dtype = torch.float32) -> str:
    """Name of the backend PyTorch picks for this geometry at batch ``n`` (e.g. ``"Mkldnn"``)."""
    x = torch.empty(geom.input_shape(n), memory_format=memory_format, dtype=dtype)
    w = torch.empty(geom.weight_shape(), dtype=dtype).contiguous(memory_format=memory_format)
    b = torch._C._select_conv_backend(x, w, None, list(geom.stride), list(geom.padding), list(geom.dilation),
                                      False, [0, 0], geom.groups)
    return str(b).rsplit(".", 1)[-1]


class DefaultAlgorithm(ConvAlgorithm):
    """PyTorch's own choice (``torch._C._select_conv_backend``): what plain ``Conv2d`` runs."""

    name = "default"

    def _supports(self, geom, n, dtype=torch.float32):
        return True

    def forward(self, x, w, geom):
        return torch.ops.aten.convolution(x, w, None, list(geom.stride), list(geom.padding),
                                          list(geom.dilation), False, [0, 0], geom.groups)

    def backward_data(self, dy, w, geom):
        # convolution_backward needs an input tensor only for its shape and format.
        x = _meta_input(geom, dy.shape[0], dy)
        return _conv_backward(dy, x, w, geom, [True, False, False])

    def backward_filter(self, dy, x, geom):
        return _conv_backward(dy, x, _meta_weight(geom, x), geom, [False, True, False])


class OneDNNAlgorithm(ConvAlgorithm):
    """oneDNN on NCHW tensors, forced (``aten.mkldnn_convolution``), forward only.

    Its backward passes are what ``default`` runs for fp32 NCHW, so they are not duplicated;
    likewise the forward is offered only where PyTorch would pick another backend.
    """

    name = "onednn_nchw"
    passes = ("forward",)

    def _supports(self, geom, n, dtype=torch.float32):
        return torch.backends.mkldnn.is_available() and selected_backend(geom, n, dtype=dtype) != "Mkldnn"

    def workspace_bytes(self, geom, pass_, n):
        return _F32 * geom.out_channels * geom.in_channels * geom.kernel[0] * geom.kernel[1]  # weight reorder

    def forward(self, x, w, geom):
        return torch.ops.aten.mkldnn_convolution(x, w, None, list(geom.padding), list(geom.stride),
                                                 list(geom.dilation), geom.groups)


class ChannelsLastAlgorithm(ConvAlgorithm):
    """oneDNN on channels_last (NHWC) copies; the result is converted back to NCHW."""

    name = "onednn_channels_last"

    def _supports(self, geom, n, dtype=torch.float32):
        return torch.backends.mkldnn.is_available()

    def workspace_bytes(self, geom, pass_, n):
        x, y = n * geom.in_channels * geom.height * geom.width, n * geom.out_channels * geom.output_hw[0] * geom.output_hw[1]
        return _F32 * (x + y + (y if pass_ == "forward" else x) // 1)

    def forward(self, x, w, geom):
        cl = torch.channels_last
        y = torch.ops.aten.convolution(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl), None,
                                       list(geom.stride), list(geom.padding), list(geom.dilation), False,
                                       [0, 0], geom.groups)
        return y.contiguous()

    def backward_data(self, dy, w, geom):
        cl = torch.channels_last
        x = _meta_input(geom, dy.shape[0], dy, cl)
        return _conv_backward(dy.contiguous(memory_format=cl), x, w.contiguous(memory_format=cl), geom,
                              [True, False, False]).contiguous()

    def backward_filter(self, dy, x, geom):
        cl = torch.channels_last
        w = _meta_weight(geom, x, cl)
        return _conv_backward(dy.contiguous(memory_format=cl), x.contiguous(memory_format=cl), w, geom,
                              [False, True, False]).contiguous()


class NNPACKAlgorithm(ConvAlgorithm):
    """NNPACK's spatial convolution (``aten._nnpack_spatial_convolution``); forward only."""

    name = "nnpack"
    passes = ("forward",)

    def _supports(self, geom, n, dtype=torch.float32):
        # NNPACK rejects padding >= kernel ("unsupported padding") and kernels above 16
        return (geom.groups == 1 and geom.dilation == (1, 1) and max(geom.kernel) <= 16
                and all(p < k for p, k in zip(geom.padding, geom.kernel)) and torch._nnpack_available())

    def workspace_bytes(self, geom, pass_, n):
        return _F32 * n * geom.in_channels * geom.height * geom.width  # transformed input tiles (order)

    def forward(self, x, w, geom):
        return torch._nnpack_spatial_convolution(x, w, None, list(geom.padding), list(geom.stride))


class Slow2dAlgorithm(ConvAlgorithm):
    """im2col + GEMM of ATen's ``slow_conv2d`` (columns buffer grows with the batch)."""

    name = "im2col"

    def _supports(self, geom, n, dtype=torch.float32):
        return geom.groups == 1 and geom.dilation == (1, 1)

    def workspace_bytes(self, geom, pass_, n):
        ho, wo = geom.output_hw
        return _F32 * n * geom.in_channels * geom.kernel[0] * geom.kernel[1] * ho * wo

    def forward(self, x, w, geom):
        return torch.ops.aten._slow_conv2d_forward(x, w, list(geom.kernel), None, list(geom.stride),
                                                   list(geom.padding))

    def backward_data(self, dy, w, geom):
        x = _meta_input(geom, dy.shape[0], dy)
        return torch.ops.aten._slow_conv2d_backward.output_mask(
            dy, x, w, list(geom.kernel), list(geom.stride), list(geom.padding), [True, False, False])[0]

    def backward_filter(self, dy, x, geom):
        w = _meta_weight(geom, x)
        return torch.ops.aten._slow_conv2d_backward.output_mask(
            dy, x, w, list(geom.kernel), list(geom.stride), list(geom.padding), [False, True, False])[1]


class UnfoldMatmulAlgorithm(ConvAlgorithm):
    """im2col written as ``F.unfold`` + one batched matmul (whole micro-batch of columns at once)."""

    name = "unfold_matmul"

    def workspace_bytes(self, geom, pass_, n):
        ho, wo = geom.output_hw
        return 2 * _F32 * n * geom.in_channels * geom.kernel[0] * geom.kernel[1] * ho * wo

    def _args(self, geom):
        return dict(kernel_size=geom.kernel, dilation=geom.dilation, padding=geom.padding, stride=geom.stride)

    def forward(self, x, w, geom):
        cols = F.unfold(x, **self._args(geom))  # (n, C*kh*kw, L)
        return (w.reshape(geom.out_channels, -1) @ cols).view(geom.output_shape(x.shape[0]))

    def backward_data(self, dy, w, geom):
        n = dy.shape[0]
        dcols = w.reshape(geom.out_channels, -1).t() @ dy.reshape(n, geom.out_channels, -1)
        return F.fold(dcols, (geom.height, geom.width), **self._args(geom))

    def backward_filter(self, dy, x, geom):
        cols = F.unfold(x, **self._args(geom))
        dw = torch.einsum("nol,nkl->ok", dy.reshape(dy.shape[0], geom.out_channels, -1), cols)
        return dw.reshape(geom.weight_shape())

    def backward_filter_accumulate(self, dy, x, geom, dest):
        """dest += dW of these samples, in place: one GEMM per sample into dest (beta = 1), so a
        micro-batch needs its columns but no temporary dW (μ-cuDNN's accumulation)."""
        cols = F.unfold(x, **self._args(geom))
        acc = dest.view(geom.out_channels, -1)
        dy2 = dy.reshape(dy.shape[0], geom.out_channels, -1)
        for i in range(dy.shape[0]):
            acc.addmm_(dy2[i], cols[i].t())
        return dest


class FFTAlgorithm(ConvAlgorithm):
    """Convolution theorem with real FFTs over the zero-padded input (stride 1, dilation 1).

    forward: y = irfft2(sum_c X * conj(W)) cropped; backward_data: full convolution dy * w;
    backward_filter: correlation of x with dy, summed over samples.
    """

    name = "fft"

    def _supports(self, geom, n, dtype=torch.float32):
        return geom.groups == 1 and geom.stride == (1, 1) and geom.dilation == (1, 1)

    def _size(self, geom):
        return geom.height + 2 * geom.padding[0], geom.width + 2 * geom.padding[1]

    def workspace_bytes(self, geom, pass_, n):
        ph, pw = self._size(geom)
        spec = ph * (pw // 2 + 1) * 2 * _F32
        return spec * (n * geom.in_channels + geom.out_channels * geom.in_channels + n * geom.out_channels) \
            + _F32 * n * geom.out_channels * ph * pw

    def _pad(self, x, geom):
        ph, pw = geom.padding
        return F.pad(x, (pw, pw, ph, ph)) if ph or pw else x

    def forward(self, x, w, geom):
        s = self._size(geom)
        xf = torch.fft.rfft2(self._pad(x, geom))
        wf = torch.fft.rfft2(w, s=s)
        y = torch.fft.irfft2(torch.einsum("ncij,ocij->noij", xf, wf.conj()), s=s)
        ho, wo = geom.output_hw
        return y[..., :ho, :wo].contiguous()

    def backward_data(self, dy, w, geom):
        s = self._size(geom)
        dyf = torch.fft.rfft2(dy, s=s)
        dx = torch.fft.irfft2(torch.einsum("noij,ocij->ncij", dyf, torch.fft.rfft2(w, s=s)), s=s)
        ph, pw = geom.padding
        return dx[..., ph:ph + geom.height, pw:pw + geom.width].contiguous()

    def backward_filter(self, dy, x, geom):
        s = self._size(geom)
        xf = torch.fft.rfft2(self._pad(x, geom))
        dw = torch.fft.irfft2(torch.einsum("ncij,noij->ocij", xf, torch.fft.rfft2(dy, s=s).conj()), s=s)
        return dw[..., :geom.kernel[0], :geom.kernel[1]].contiguous()


_BT = torch.tensor([[1., 0., -1., 0.], [0., 1., 1., 0.], [0., -1., 1., 0.], [0., 1., 0., -1.]])
_G = torch.tensor([[1., 0., 0.], [.5, .5, .5], [.5, -.5, .5], [0., 0., 1.]])
_AT = torch.tensor([[1., 1., 1., 0.], [0., 1., -1., -1.]])


def _winograd_2x2_3x3(x: torch.Tensor, w: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """Correlation of x (n, C, H, W) with 3x3 filters w (O, C, 3, 3), stride 1, zero padding."""
    n, c, h, wd = x.shape
    o = w.shape[0]
    ho, wo = h + 2 * ph - 2, wd + 2 * pw - 2
    th, tw = (ho + 1) // 2, (wo + 1) // 2
    # pad so that th x tw overlapping 4x4 tiles (step 2) cover the output
    xp = F.pad(x, (pw, 2 * tw + 2 - wd - pw, ph, 2 * th + 2 - h - ph))
    bt, g, at = (m.to(x.dtype) for m in (_BT, _G, _AT))
    d = xp.unfold(2, 4, 2).unfold(3, 4, 2)                       # (n, C, th, tw, 4, 4)
    v = (bt @ d @ bt.t()).permute(4, 5, 1, 0, 2, 3).reshape(16, c, n * th * tw)
    u = (g @ w @ g.t()).permute(2, 3, 0, 1).reshape(16, o, c)    # filter transform
    m = torch.bmm(u, v).view(4, 4, o, n, th, tw).permute(3, 2, 4, 5, 0, 1)
    y = at @ m @ at.t()                                          # (n, O, th, tw, 2, 2)
    y = y.permute(0, 1, 2, 4, 3, 5).reshape(n, o, 2 * th, 2 * tw)
    return y[..., :ho, :wo].contiguous()


class WinogradAlgorithm(ConvAlgorithm):
    """Winograd F(2x2, 3x3) in tensor ops: 16 GEMMs over transformed 4x4 tiles (Lavin & Gray §4).

    backward_data is the same transform applied to dy padded by 2 with the flipped, transposed
    filter; backward_filter is not offered (the transform targets 3x3 filters, not 3x3 outputs).
    """

    name = "winograd_2x2_3x3"
    passes = ("forward", "backward_data")
    dtypes = (torch.float32, torch.float64)
    dtype_note = "its tile transforms would round in 16 bits (error about twice the default's)"

    def _supports(self, geom, n, dtype=torch.float32):
        return (geom.groups == 1 and geom.kernel == (3, 3) and geom.stride == (1, 1)
                and geom.dilation == (1, 1) and max(geom.padding) <= 2)

    def workspace_bytes(self, geom, pass_, n):
        ho, wo = geom.output_hw
        tiles = ((ho + 1) // 2) * ((wo + 1) // 2) * n
        c, o = (geom.in_channels, geom.out_channels) if pass_ == "forward" else (geom.out_channels, geom.in_channels)
        return _F32 * 16 * (2 * tiles * c + o * c + 2 * tiles * o)

    def forward(self, x, w, geom):
        return _winograd_2x2_3x3(x, w, *geom.padding)

    def backward_data(self, dy, w, geom):
        wt = w.flip(2, 3).transpose(0, 1)
        dx = _winograd_2x2_3x3(dy, wt, 2, 2)  # full convolution, size H + 2p
        ph, pw = geom.padding
        return dx[..., ph:ph + geom.height, pw:pw + geom.width].contiguous()


ALGORITHMS: dict[str, ConvAlgorithm] = {a.name: a for a in (
    DefaultAlgorithm(), OneDNNAlgorithm(), ChannelsLastAlgorithm(), NNPACKAlgorithm(), Slow2dAlgorithm(),
    UnfoldMatmulAlgorithm(), FFTAlgorithm(), WinogradAlgorithm())}


_PROBE_GEOM = ConvGeometry(2, 2, (3, 3), (1, 1), (1, 1), (1, 1), 1, 5, 5)
_PROBES: dict[tuple[str, str, torch.dtype, str], str | None] = {}


def _kernel_probe(algo: ConvAlgorithm, pass_: str, dtype: torch.dtype, device: str) -> str | None:
    """Try ``pass_`` once on a tiny geometry in ``dtype`` on ``device`` (cached): None, or the error."""
    key = (algo.name, pass_, dtype, device)
    if key not in _PROBES:
        g = _PROBE_GEOM
        opts = dict(dtype=dtype, device=device)
        try:
            x, w, dy = (torch.ones(s, **opts) for s in (g.input_shape(1), g.weight_shape(), g.output_shape(1)))
            r = algo.run(pass_, *{"forward": (x, w), "backward_data": (dy, w), "backward_filter": (dy, x)}[pass_], g)
            if r.dtype != dtype or tuple(r.shape) != g.result_shape(pass_, 1):
                raise RuntimeError(f"returned {r.dtype} {tuple(r.shape)}")
            _PROBES[key] = None
        except Exception as exc:  # any failure means: no kernel for this dtype/device here
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            _PROBES[key] = f"{algo.name} cannot run {pass_} in {str(dtype).replace('torch.', '')} on {device}: {first}"
    return _PROBES[key]


def get_algorithm(name: str) -> ConvAlgorithm:
    """The registered algorithm ``name``; KeyError lists the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown convolution algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None


def algorithms_for(geom: ConvGeometry, pass_: str, n: int, dtype: torch.dtype,
                   names: tuple[str, ...] | None = None, device: torch.device | str = "cpu") -> list[ConvAlgorithm]:
    """Algorithms that can run ``pass_`` of ``geom`` at micro-batch ``n`` in ``dtype`` on ``device``."""
    pool = ALGORITHMS.values() if names is None else [get_algorithm(k) for k in names]
    return [a for a in pool if a.supports(geom, pass_, n, dtype, device)]


def unsupported_algorithms(passes, dtype: torch.dtype, device: torch.device | str = "cpu",
                           names: tuple[str, ...] | None = None) -> dict[str, str]:
    """{"algorithm pass": why it cannot run} for the algorithms skipped in ``dtype`` on ``device``."""
    pool = ALGORITHMS.values() if names is None else [get_algorithm(k) for k in names]
    out = {}
    for a in pool:
        for p in passes:
            if p in a.passes:
                why = a.unsupported_reason(p, dtype, device)
                if why is not None:
                    out[f"{a.name} {p}"] = why
    return out
