"""Converters of caffe layer types, one file per family; importing this package registers them all."""
from fxq.frontends.caffe.layers import activation, conv, detection, norm, pooling, resize, tensor  # noqa: F401
