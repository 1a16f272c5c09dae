"""DeepBench-style single convolution layers (Baidu DeepBench, ``kernels/conv_problems.h``).

μ-cuDNN (arXiv 1804.04806, §V-B) evaluates DeepBench's 3x3 and 5x5 training layers one at a
time. Each model here is one ``Conv2d`` of a named geometry, so the planner treats it exactly
like a network layer. The first three geometries are copied from DeepBench's training set
(``w, h, c, n, k, r, s, pad, stride``); the 5x5 ones are Inception-style layers of the same kind
(not verified against DeepBench's file, hence the ``_style`` suffix).
Use :data:`GEOMETRIES` for the input size and the batch size DeepBench uses.
"""

from __future__ import annotations

from torch import nn

__all__ = ["GEOMETRIES", "DeepBenchConv", "deepbench"]

# name -> (in_channels, out_channels, kernel, stride, padding, height, width, deepbench_batch)
GEOMETRIES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "deepbench_3x3_54x54x64": (64, 64, 3, 1, 1, 54, 54, 8),
    "deepbench_3x3_224x224x3": (3, 64, 3, 1, 1, 224, 224, 16),
    "deepbench_1x1_112x112x64": (64, 64, 1, 1, 0, 112, 112, 16),
    "deepbench_5x5_28x28x192_style": (192, 32, 5, 1, 2, 28, 28, 16),
    "deepbench_5x5_14x14x512_style": (512, 48, 5, 1, 2, 14, 14, 16),
}


class DeepBenchConv(nn.Module):
    """One convolution of a DeepBench geometry: (N, C, H, W) -> (N, K, H', W')."""

    def __init__(self, name: str):
        super().__init__()
        if name not in GEOMETRIES:
            raise KeyError(f"DeepBenchConv: unknown geometry {name!r}; known: {', '.join(sorted(GEOMETRIES))}")
        c, k, r, s, p, h, w, n = GEOMETRIES[name]
        self.name = name
        self.input_size = (c, h, w)
        self.batch_size = n
        self.conv = nn.Conv2d(c, k, kernel_size=r, stride=s, padding=p, bias=False)

    def forward(self, x):
        return self.conv(x)


def deepbench(name: str = "deepbench_3x3_54x54x64") -> DeepBenchConv:
    """The single-layer model of DeepBench geometry ``name``."""
    return DeepBenchConv(name)


def _factory(name: str):
    def build() -> DeepBenchConv:
        return DeepBenchConv(name)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"The single-layer model of DeepBench geometry {name!r}."
    return build


# One factory per geometry, so the model registry can name each layer ("module:factory").
for _name in GEOMETRIES:
    globals()[_name] = _factory(_name)
del _name
