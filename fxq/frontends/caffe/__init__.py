"""Caffe frontend: ``load_caffe(prototxt, caffemodel)`` -> ``torch.fx.GraphModule``, with no compiled caffe.

The schema is fxq's own subset of ``caffe.proto`` built at import time (:mod:`fxq.frontends.caffe.proto`);
layer types map to converters registered with :func:`register_caffe_layer`.
"""
from fxq.frontends.caffe.loader import load_caffe
from fxq.frontends.caffe.registry import register_caffe_layer, supported_layer_types

__all__ = ["load_caffe", "register_caffe_layer", "supported_layer_types"]
