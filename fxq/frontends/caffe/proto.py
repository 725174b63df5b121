"""fxq's own subset of caffe's ``caffe.proto``, built in Python at import time (no protoc, no compiled caffe).

Only the messages and fields the frontend reads are declared; everything else in a real prototxt or caffemodel is
skipped as an unknown field. Field numbers and types follow the public caffe schema (BVLC master), so a caffemodel
written by caffe parses with ``ParseFromString``. Fork-only messages (``Upsample``, ``Interp``) and the fork alias
``PoolingParameter.ceil_mode`` are declared for text-format prototxts; their numbers are marked below. Layer
parameters are always read from the prototxt; a caffemodel contributes only blobs, so a fork whose numbers differ
still loads.

The messages live in a private descriptor pool, so a real ``caffe_pb2`` imported elsewhere cannot clash with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = [
    "BlobProto",
    "BlobShape",
    "LayerParameter",
    "NetParameter",
    "V1LayerParameter",
    "file_descriptor_proto",
]

_PACKAGE = "caffe"
_FDP = descriptor_pb2.FieldDescriptorProto
_SCALAR_TYPES = {
    "double": _FDP.TYPE_DOUBLE,
    "float": _FDP.TYPE_FLOAT,
    "int64": _FDP.TYPE_INT64,
    "uint64": _FDP.TYPE_UINT64,
    "int32": _FDP.TYPE_INT32,
    "uint32": _FDP.TYPE_UINT32,
    "bool": _FDP.TYPE_BOOL,
    "string": _FDP.TYPE_STRING,
    "bytes": _FDP.TYPE_BYTES,
}


@dataclass(frozen=True)
class _Field:
    name: str
    number: int
    type: str  # a scalar type name, an enum ("Msg.Enum" / "Phase") or a message name
    repeated: bool = False
    default: str | None = None
    packed: bool = False


@dataclass(frozen=True)
class _Message:
    name: str
    fields: tuple[_Field, ...]
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)  # enum name -> value names 0, 1, 2, ...


def _f(name: str, number: int, type_: str, default: Any = None, *, repeated: bool = False,
       packed: bool = False) -> _Field:
    if isinstance(default, bool):
        default = "true" if default else "false"
    return _Field(name, number, type_, repeated, None if default is None else str(default), packed)


def _rep(name: str, number: int, type_: str, *, packed: bool = False) -> _Field:
    return _f(name, number, type_, repeated=True, packed=packed)


_TOP_LEVEL_ENUMS: dict[str, tuple[str, ...]] = {"Phase": ("TRAIN", "TEST")}

_MESSAGES: tuple[_Message, ...] = (
    _Message("BlobShape", (_rep("dim", 1, "int64", packed=True),)),
    _Message("BlobProto", (
        _f("num", 1, "int32", 0),  # legacy 4-D shape: num, channels, height, width
        _f("channels", 2, "int32", 0),
        _f("height", 3, "int32", 0),
        _f("width", 4, "int32", 0),
        _rep("data", 5, "float", packed=True),
        _rep("diff", 6, "float", packed=True),
        _f("shape", 7, "BlobShape"),
        _rep("double_data", 8, "double", packed=True),
        _rep("double_diff", 9, "double", packed=True),
    )),
    _Message("NetState", (
        _f("phase", 1, "Phase", "TEST"),
        _f("level", 2, "int32", 0),
        _rep("stage", 3, "string"),
    )),
    _Message("NetStateRule", (
        _f("phase", 1, "Phase"),
        _f("min_level", 2, "int32"),
        _f("max_level", 3, "int32"),
        _rep("stage", 4, "string"),
        _rep("not_stage", 5, "string"),
    )),
    _Message("ParamSpec", (
        _f("name", 1, "string"),
        _f("lr_mult", 3, "float", 1.0),
        _f("decay_mult", 4, "float", 1.0),
    )),
    _Message("NetParameter", (
        _f("name", 1, "string"),
        _rep("layers", 2, "V1LayerParameter"),  # deprecated V1 layers: detected, refused
        _rep("input", 3, "string"),
        _rep("input_dim", 4, "int32"),
        _f("force_backward", 5, "bool", False),
        _f("state", 6, "NetState"),
        _f("debug_info", 7, "bool", False),
        _rep("input_shape", 8, "BlobShape"),
        _rep("layer", 100, "LayerParameter"),
    )),
    # Just enough of the V1 layer to name it in an error and to read blobs from an old caffemodel.
    _Message("V1LayerParameter", (
        _rep("bottom", 2, "string"),
        _rep("top", 3, "string"),
        _f("name", 4, "string"),
        _rep("blobs", 6, "BlobProto"),
    )),
    _Message("LayerParameter", (
        _f("name", 1, "string"),
        _f("type", 2, "string"),
        _rep("bottom", 3, "string"),
        _rep("top", 4, "string"),
        _rep("loss_weight", 5, "float"),
        _rep("param", 6, "ParamSpec"),
        _rep("blobs", 7, "BlobProto"),
        _rep("include", 8, "NetStateRule"),
        _rep("exclude", 9, "NetStateRule"),
        _f("phase", 10, "Phase"),
        _rep("propagate_down", 11, "bool"),
        _f("concat_param", 104, "ConcatParameter"),
        _f("convolution_param", 106, "ConvolutionParameter"),
        _f("dropout_param", 108, "DropoutParameter"),
        _f("eltwise_param", 110, "EltwiseParameter"),
        _f("inner_product_param", 117, "InnerProductParameter"),
        _f("lrn_param", 118, "LRNParameter"),
        _f("pooling_param", 121, "PoolingParameter"),
        _f("power_param", 122, "PowerParameter"),
        _f("relu_param", 123, "ReLUParameter"),
        _f("softmax_param", 125, "SoftmaxParameter"),
        _f("slice_param", 126, "SliceParameter"),
        _f("prelu_param", 131, "PReLUParameter"),
        _f("reshape_param", 133, "ReshapeParameter"),
        _f("flatten_param", 135, "FlattenParameter"),
        _f("batch_norm_param", 139, "BatchNormParameter"),
        _f("scale_param", 142, "ScaleParameter"),
        _f("input_param", 143, "InputParameter"),
        # Fork layers. 149 is the number the common YOLOv3 caffe fork gives upsample_param; the DeepLab/PSPNet
        # forks give interp_param 143, which BVLC uses for input_param, so interp_param gets a number of our own.
        _f("upsample_param", 149, "UpsampleParameter"),
        _f("interp_param", 5001, "InterpParameter"),
        _f("exp_param", 111, "ExpParameter"),
        _f("log_param", 134, "LogParameter"),
        _f("elu_param", 140, "ELUParameter"),
        _f("bias_param", 141, "BiasParameter"),
        _f("crop_param", 144, "CropParameter"),
        _f("swish_param", 147, "SwishParameter"),
        _f("clip_param", 148, "ClipParameter"),
        # ShuffleNet's fork layer (its number differs between forks; prototxt text only, so ours).
        _f("shuffle_channel_param", 5002, "ShuffleChannelParameter"),
        # The SSD fork's layers (weiliu89/caffe, branch ssd; OpenCV's res10 face detector, MobileNet-SSD).
        _f("permute_param", 202, "PermuteParameter"),
        _f("prior_box_param", 203, "PriorBoxParameter"),
        _f("detection_output_param", 204, "DetectionOutputParameter"),
        _f("norm_param", 206, "NormalizeParameter"),
    )),
    _Message("ConvolutionParameter", (
        _f("num_output", 1, "uint32"),
        _f("bias_term", 2, "bool", True),
        _rep("pad", 3, "uint32"),
        _rep("kernel_size", 4, "uint32"),
        _f("group", 5, "uint32", 1),
        _rep("stride", 6, "uint32"),
        _f("pad_h", 9, "uint32", 0),
        _f("pad_w", 10, "uint32", 0),
        _f("kernel_h", 11, "uint32"),
        _f("kernel_w", 12, "uint32"),
        _f("stride_h", 13, "uint32"),
        _f("stride_w", 14, "uint32"),
        _f("axis", 16, "int32", 1),
        _f("force_nd_im2col", 17, "bool", False),
        _rep("dilation", 18, "uint32"),
    )),
    _Message("InnerProductParameter", (
        _f("num_output", 1, "uint32"),
        _f("bias_term", 2, "bool", True),
        _f("axis", 5, "int32", 1),
        _f("transpose", 6, "bool", False),
    )),
    _Message("PoolingParameter", (
        _f("pool", 1, "PoolingParameter.PoolMethod", "MAX"),
        # BVLC declares kernel_size/stride/pad optional; forks repeat them per axis. Repeated reads both.
        _rep("kernel_size", 2, "uint32"),
        _rep("stride", 3, "uint32"),
        _rep("pad", 4, "uint32"),
        _f("kernel_h", 5, "uint32"),
        _f("kernel_w", 6, "uint32"),
        _f("stride_h", 7, "uint32"),
        _f("stride_w", 8, "uint32"),
        _f("pad_h", 9, "uint32", 0),
        _f("pad_w", 10, "uint32", 0),
        _f("global_pooling", 12, "bool", False),
        _f("round_mode", 13, "PoolingParameter.RoundMode", "CEIL"),
        _f("ceil_mode", 5001, "bool", True),  # fork alias of round_mode (text format only; number is ours)
    ), {"PoolMethod": ("MAX", "AVE", "STOCHASTIC"), "RoundMode": ("CEIL", "FLOOR")}),
    _Message("ReLUParameter", (_f("negative_slope", 1, "float", 0.0),)),
    _Message("PReLUParameter", (_f("channel_shared", 2, "bool", False),)),
    _Message("DropoutParameter", (_f("dropout_ratio", 1, "float", 0.5),)),
    _Message("BatchNormParameter", (
        _f("use_global_stats", 1, "bool"),
        _f("moving_average_fraction", 2, "float", 0.999),
        _f("eps", 3, "float", 1e-5),
    )),
    _Message("ScaleParameter", (
        _f("axis", 1, "int32", 1),
        _f("num_axes", 2, "int32", 1),
        _f("bias_term", 4, "bool", False),
    )),
    _Message("EltwiseParameter", (
        _f("operation", 1, "EltwiseParameter.EltwiseOp", "SUM"),
        _rep("coeff", 2, "float"),
        _f("stable_prod_grad", 3, "bool", True),
    ), {"EltwiseOp": ("PROD", "SUM", "MAX")}),
    _Message("ConcatParameter", (
        _f("concat_dim", 1, "uint32", 1),
        _f("axis", 2, "int32", 1),
    )),
    _Message("SoftmaxParameter", (_f("axis", 2, "int32", 1),)),
    _Message("FlattenParameter", (
        _f("axis", 1, "int32", 1),
        _f("end_axis", 2, "int32", -1),
    )),
    _Message("ReshapeParameter", (
        _f("shape", 1, "BlobShape"),
        _f("axis", 2, "int32", 0),
        _f("num_axes", 3, "int32", -1),
    )),
    _Message("SliceParameter", (
        _f("slice_dim", 1, "uint32", 1),
        _rep("slice_point", 2, "uint32"),
        _f("axis", 3, "int32", 1),
    )),
    _Message("PowerParameter", (
        _f("power", 1, "float", 1.0),
        _f("scale", 2, "float", 1.0),
        _f("shift", 3, "float", 0.0),
    )),
    _Message("LRNParameter", (
        _f("local_size", 1, "uint32", 5),
        _f("alpha", 2, "float", 1.0),
        _f("beta", 3, "float", 0.75),
        _f("norm_region", 4, "LRNParameter.NormRegion", "ACROSS_CHANNELS"),
        _f("k", 5, "float", 1.0),
    ), {"NormRegion": ("ACROSS_CHANNELS", "WITHIN_CHANNEL")}),
    _Message("InputParameter", (_rep("shape", 1, "BlobShape"),)),
    # Fork messages (YOLOv3 / SegNet Upsample, DeepLab / PSPNet Interp). The scales are declared float so that
    # both "scale: 2" and "scale: 2.0" parse as text.
    _Message("UpsampleParameter", (
        _f("scale", 1, "float"),
        _f("scale_h", 2, "float"),
        _f("scale_w", 3, "float"),
        _f("upsample_h", 6, "uint32"),
        _f("upsample_w", 7, "uint32"),
    )),
    _Message("ExpParameter", (_f("base", 1, "float", -1.0), _f("scale", 2, "float", 1.0), _f("shift", 3, "float", 0.0))),
    _Message("LogParameter", (_f("base", 1, "float", -1.0), _f("scale", 2, "float", 1.0), _f("shift", 3, "float", 0.0))),
    _Message("ELUParameter", (_f("alpha", 1, "float", 1.0),)),
    _Message("BiasParameter", (_f("axis", 1, "int32", 1), _f("num_axes", 2, "int32", 1))),
    _Message("CropParameter", (_f("axis", 1, "int32", 2), _rep("offset", 2, "uint32"))),
    _Message("SwishParameter", (_f("beta", 1, "float", 1.0),)),
    _Message("ClipParameter", (_f("min", 1, "float"), _f("max", 2, "float"))),
    _Message("ShuffleChannelParameter", (_f("group", 1, "uint32", 1),)),
    # SSD fork messages. CodeType counts from 1 in the fork (CORNER = 1): a placeholder takes 0.
    _Message("NormalizeParameter", (
        _f("across_spatial", 1, "bool", True),
        _f("channel_shared", 3, "bool", True),
        _f("eps", 4, "float", 1e-10),
    )),
    _Message("PermuteParameter", (_rep("order", 1, "uint32"),)),
    _Message("PriorBoxParameter", (
        _rep("min_size", 1, "float"),
        _rep("max_size", 2, "float"),
        _rep("aspect_ratio", 3, "float"),
        _f("flip", 4, "bool", True),
        _f("clip", 5, "bool", False),
        _rep("variance", 6, "float"),
        _f("img_size", 7, "uint32"),
        _f("img_h", 8, "uint32"),
        _f("img_w", 9, "uint32"),
        _f("step", 10, "float"),
        _f("step_h", 11, "float"),
        _f("step_w", 12, "float"),
        _f("offset", 13, "float", 0.5),
    ), {"CodeType": ("CODE_TYPE_UNSET", "CORNER", "CENTER_SIZE", "CORNER_SIZE")}),
    _Message("NonMaximumSuppressionParameter", (
        _f("nms_threshold", 1, "float", 0.3),
        _f("top_k", 2, "int32"),
        _f("eta", 3, "float", 1.0),
    )),
    _Message("DetectionOutputParameter", (
        _f("num_classes", 1, "uint32"),
        _f("share_location", 2, "bool", True),
        _f("background_label_id", 3, "int32", 0),
        _f("nms_param", 4, "NonMaximumSuppressionParameter"),
        _f("code_type", 6, "PriorBoxParameter.CodeType", "CORNER"),
        _f("keep_top_k", 7, "int32", -1),
        _f("variance_encoded_in_target", 8, "bool", False),
        _f("confidence_threshold", 9, "float"),
    )),
    _Message("InterpParameter", (
        _f("height", 1, "int32", 0),
        _f("width", 2, "int32", 0),
        _f("zoom_factor", 3, "int32", 1),
        _f("shrink_factor", 4, "int32", 1),
        _f("pad_beg", 5, "int32", 0),
        _f("pad_end", 6, "int32", 0),
    )),
)


def _enum_proto(name: str, values: tuple[str, ...]) -> descriptor_pb2.EnumDescriptorProto:
    enum = descriptor_pb2.EnumDescriptorProto(name=name)
    for number, value in enumerate(values):
        enum.value.add(name=value, number=number)
    return enum


def _all_enum_names() -> set[str]:
    names = set(_TOP_LEVEL_ENUMS)
    for msg in _MESSAGES:
        names.update(f"{msg.name}.{enum}" for enum in msg.enums)
    return names


def _field_proto(spec: _Field, enum_names: set[str]) -> descriptor_pb2.FieldDescriptorProto:
    proto = _FDP(
        name=spec.name,
        number=spec.number,
        label=_FDP.LABEL_REPEATED if spec.repeated else _FDP.LABEL_OPTIONAL,
    )
    if spec.type in _SCALAR_TYPES:
        proto.type = _SCALAR_TYPES[spec.type]
    else:
        proto.type = _FDP.TYPE_ENUM if spec.type in enum_names else _FDP.TYPE_MESSAGE
        proto.type_name = f".{_PACKAGE}.{spec.type}"
    if spec.default is not None:
        proto.default_value = spec.default
    if spec.packed:
        proto.options.packed = True
    return proto


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """The schema subset as a ``FileDescriptorProto`` (e.g. to print it, or to add it to another pool)."""
    enum_names = _all_enum_names()
    fdp = descriptor_pb2.FileDescriptorProto(name="fxq_caffe_subset.proto", package=_PACKAGE, syntax="proto2")
    for name, values in _TOP_LEVEL_ENUMS.items():
        fdp.enum_type.append(_enum_proto(name, values))
    for msg in _MESSAGES:
        proto = fdp.message_type.add(name=msg.name)
        for enum_name, values in msg.enums.items():
            proto.enum_type.append(_enum_proto(enum_name, values))
        for spec in msg.fields:
            proto.field.append(_field_proto(spec, enum_names))
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(file_descriptor_proto().SerializeToString())


def _message_class(name: str) -> type:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


NetParameter = _message_class("NetParameter")
LayerParameter = _message_class("LayerParameter")
V1LayerParameter = _message_class("V1LayerParameter")
BlobProto = _message_class("BlobProto")
BlobShape = _message_class("BlobShape")
