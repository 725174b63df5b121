"""The caffe layer-type -> converter table, extended with :func:`register_caffe_layer`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fxq.registry import Registry

if TYPE_CHECKING:
    from fxq.frontends.caffe.builder import LayerContext

__all__ = ["LayerConverter", "CAFFE_LAYERS", "register_caffe_layer", "supported_layer_types"]

ConvertFn = Callable[["LayerContext"], None]


@dataclass(frozen=True)
class LayerConverter:
    """One caffe layer type (its spelling in prototxts) and the function that adds its nodes to the graph."""

    type_name: str
    fn: ConvertFn


CAFFE_LAYERS: Registry[LayerConverter] = Registry("caffe layer type")


def register_caffe_layer(type_name: str, *, override: bool = False) -> Callable[[ConvertFn], ConvertFn]:
    """Decorator registering ``fn(ctx: LayerContext) -> None`` as the converter of caffe layers of ``type_name``.

    Example::

        @register_caffe_layer("Swish")
        def swish(ctx):
            ctx.set_top(0, ctx.call_module(torch.nn.SiLU(), ctx.bottom(0)))
    """

    def deco(fn: ConvertFn) -> ConvertFn:
        CAFFE_LAYERS.register(type_name, LayerConverter(type_name, fn), override=override)
        return fn

    return deco


def supported_layer_types() -> list[str]:
    """The caffe layer types :func:`fxq.load_caffe` converts, as spelled in prototxts."""
    return sorted(conv.type_name for _, conv in CAFFE_LAYERS.items())
