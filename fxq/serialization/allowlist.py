"""What a saved fxq model may name: a closed, explicit table of module classes, functions, ops, tensor methods.

Loading never unpickles objects and never looks a name from the file up by walking attributes or importing
modules. Every class, function, op and method a file may name is listed below by us; the tables are built from
those lists (our names, never the file's) and a file's names are only looked up in them:

* module classes: the ``torch.nn`` classes of :data:`_NN_CLASSES`, fxq's own (:data:`_FXQ_CLASSES`), classes
  defined in ``onnx2torch`` (indexed once from its already imported modules) and classes registered with
  :func:`register_serializable`;
* functions: pure compute functions of ``torch``, ``torch.nn.functional``, ``torch.fft/linalg/special``,
  ``operator``, ``math`` and a few builtins; ``aten`` overloads admitted by the rule below (torch.export graphs);
  fxq's ``fxq::`` ops and its own wrapped functions; and functions registered with :func:`register_serializable`;
* tensor methods (``call_method`` targets) of :data:`TENSOR_METHODS`, attribute names of :data:`GETATTR_NAMES`
  (``getattr`` nodes);
* names: identifiers (not keywords, not dunders) and dotted paths of them (see :func:`check_identifier`).

Nothing that loads libraries, imports modules, reads or writes files, touches global state or calls a name
(``operator.attrgetter``, ``torch.from_file``, ``torch.ops.load_library``, ``Tensor.set_``...) is listed.

aten ops are too many to list by hand (torch.export keeps whatever aten op a model's torch call maps to), so an
aten overload is admitted by a rule, applied to torch's own registry of overloads when the table is built
(:func:`aten_refusal` says why one is refused). An overload is admitted when all of these hold:

1. its name does not match :data:`_ATEN_NEVER`: never ops that reinterpret or resize memory (the ``as_strided``
   family, ``set_``, ``resize_``, ``_reshape_alias``), skip bounds checks (``_unsafe_*``, ``unsafe_*``), touch
   files or storages (``from_file``, ``save``, ``*storage*``) or assemble tensors from raw parts (``_make_*``,
   ``_nested_*``, sparse constructors) -- even where torch tags them ``core``;
2. its schema is functional: no argument it writes (no in-place, no ``out=`` overload); the one exception is
   :data:`_ATEN_WRITES` (``copy_``: how ``ExportedProgram.module()`` writes back a mutated buffer or input);
3. no argument is a ``Storage``, ``Stream`` or untyped (``Any``) value, and every ``str`` argument is an option
   word of :data:`_ATEN_STR_ARGS` (``approximate``, ``rounding_mode``...), never a file name or free string;
4. it is tagged ``torch.Tag.core`` or ``torch.Tag.pointwise``, or its op is one of :data:`_ATEN_LISTED` (the
   non-core ops fxq graphs hold: torch-level functions export keeps as aten ops, ``grid_sampler``...) or of
   :data:`TENSOR_METHODS` (export keeps a method call as its aten op: ``aten.type_as``, ``aten.view_as``).

aten packets (``torch.ops.aten.add`` without an overload) are refused: the overload a packet runs is chosen from
the call's arguments at run time, and torch.export graphs hold overloads.
"""
from __future__ import annotations

import builtins
import functools
import keyword
import math
import operator
import re
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fxq.errors import NotSupportedError
from fxq.registry import Registry

__all__ = ["register_serializable", "aten_refusal", "class_name", "resolve_class", "function_name", "resolve_function",
           "check_method", "check_node", "check_identifier", "check_part", "check_path", "SERIALIZABLE", "TENSOR_METHODS",
           "GETATTR_NAMES"]

SERIALIZABLE: Registry[Any] = Registry("serializable class or function")
"""User-registered module classes and functions, keyed by ``module:qualname``."""

# ---------------------------------------------------------------------------------------------- the lists
_ELEMENTWISE = (
    "abs", "absolute", "acos", "acosh", "add", "addcdiv", "addcmul", "angle", "arccos", "arccosh", "arcsin",
    "arcsinh", "arctan", "arctan2", "arctanh", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and",
    "bitwise_left_shift", "bitwise_not", "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil", "clamp",
    "clamp_max", "clamp_min", "clip", "copysign", "cos", "cosh", "deg2rad", "div", "divide", "erf", "erfc",
    "erfinv", "exp", "exp2", "expm1", "fix", "float_power", "floor", "floor_divide", "fmax", "fmin", "fmod", "frac",
    "hypot", "i0", "lerp", "lgamma", "digamma", "log", "log10", "log1p", "log2", "logaddexp", "logaddexp2",
    "logical_and", "logical_not", "logical_or", "logical_xor", "logit", "maximum", "minimum", "mul", "multiply",
    "nan_to_num", "neg", "negative", "nextafter", "positive", "pow", "rad2deg", "reciprocal", "remainder", "round",
    "rsqrt", "sgn", "sigmoid", "sign", "signbit", "sin", "sinc", "sinh", "sqrt", "square", "sub", "subtract",
    "tan", "tanh", "true_divide", "trunc", "xlogy", "relu", "hardshrink", "celu", "selu", "rrelu", "prelu",
    "threshold", "eq", "ne", "lt", "le", "gt", "ge", "equal", "greater", "greater_equal", "less", "less_equal",
    "not_equal", "isclose", "allclose", "isfinite", "isinf", "isnan", "isneginf", "isposinf", "isreal", "where",
    "heaviside", "gcd", "lcm", "conj", "real", "imag", "polar", "complex", "view_as_real", "view_as_complex",
)
_REDUCTIONS = (
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "argsort", "count_nonzero", "cummax", "cummin",
    "cumprod", "cumsum", "logcumsumexp", "logsumexp", "max", "mean", "median", "min", "mode", "nanmean",
    "nanmedian", "nansum", "norm", "prod", "quantile", "nanquantile", "sort", "std", "std_mean", "sum", "topk",
    "kthvalue", "var", "var_mean", "unique", "unique_consecutive", "bincount", "histc", "bucketize",
    "searchsorted", "dist", "cdist", "msort",
)
_SHAPES = (
    "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_tensors", "broadcast_to", "broadcast_shapes", "cat",
    "concat", "concatenate", "chunk", "column_stack", "diag", "diag_embed", "diagonal", "dsplit", "dstack",
    "expand_copy", "flatten", "flip", "fliplr", "flipud", "gather", "hsplit", "hstack", "index_add", "index_copy",
    "index_fill", "index_put", "index_select", "masked_fill", "masked_scatter", "masked_select", "movedim",
    "moveaxis", "narrow", "narrow_copy", "nonzero", "permute", "ravel", "repeat_interleave", "reshape", "roll",
    "rot90", "scatter", "scatter_add", "scatter_reduce", "select", "select_scatter", "slice_scatter", "split",
    "squeeze", "stack", "swapaxes", "swapdims", "t", "take", "take_along_dim", "tensor_split", "tile", "transpose",
    "tril", "triu", "unbind", "unflatten", "unsqueeze", "vsplit", "vstack", "meshgrid", "numel", "clone",
    "detach", "tril_indices", "triu_indices", "combinations", "cartesian_prod", "block_diag", "kron",
    "diagonal_scatter", "argwhere", "result_type", "promote_types", "can_cast", "is_tensor",
    "is_floating_point", "is_complex", "is_nonzero",
)
_LINEAR_ALGEBRA = (
    "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "cross", "dot", "einsum", "inner",
    "matmul", "mm", "mv", "outer", "ger", "tensordot", "trace", "vdot", "cholesky", "det", "logdet", "slogdet",
    "inverse", "pinverse", "qr", "svd", "matrix_power", "matrix_exp",
)
_CREATION = (
    "arange", "empty", "empty_like", "eye", "full", "full_like", "linspace", "logspace", "ones", "ones_like",
    "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "randperm", "range", "scalar_tensor",
    "tensor", "as_tensor", "zeros", "zeros_like", "bernoulli", "multinomial", "normal", "poisson", "complex",
)
_NN_OPS = (
    "adaptive_avg_pool1d", "adaptive_max_pool1d", "avg_pool1d", "batch_norm", "bilinear", "channel_shuffle",
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "cosine_similarity", "dropout", "alpha_dropout", "feature_alpha_dropout", "feature_dropout",
    "embedding", "embedding_bag", "group_norm", "instance_norm", "layer_norm", "rms_norm", "max_pool1d",
    "max_pool2d", "max_pool3d", "native_layer_norm", "native_batch_norm", "pairwise_distance", "pdist",
    "pixel_shuffle", "pixel_unshuffle", "softmax", "log_softmax", "constant_pad_nd", "relu_", "sigmoid_",
    "tanh_", "clamp_", "clamp_min_", "clamp_max_", "exp_", "dropout_", "hardshrink", "native_dropout",
)
_TORCH = _ELEMENTWISE + _REDUCTIONS + _SHAPES + _LINEAR_ALGEBRA + _CREATION + _NN_OPS + ("_assert",)
_FUNCTIONAL = (
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "affine_grid", "alpha_dropout", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "batch_norm", "bilinear", "celu", "celu_", "channel_shuffle", "conv1d", "conv2d", "conv3d",
    "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "cosine_similarity", "dropout",
    "dropout1d", "dropout2d", "dropout3d", "elu", "elu_", "embedding", "embedding_bag", "feature_alpha_dropout",
    "fold", "fractional_max_pool2d", "fractional_max_pool3d", "gelu", "glu", "grid_sample", "group_norm",
    "gumbel_softmax", "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "hardtanh_", "instance_norm",
    "interpolate", "layer_norm", "leaky_relu", "leaky_relu_", "linear", "local_response_norm", "log_softmax",
    "logsigmoid", "lp_pool1d", "lp_pool2d", "lp_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices", "max_unpool1d",
    "max_unpool2d", "max_unpool3d", "mish", "normalize", "one_hot", "pad", "pairwise_distance", "pdist",
    "pixel_shuffle", "pixel_unshuffle", "prelu", "relu", "relu6", "relu_", "rms_norm", "rrelu", "rrelu_", "selu",
    "selu_", "sigmoid", "silu", "softmax", "softmin", "softplus", "softshrink", "softsign", "tanh", "tanhshrink",
    "threshold", "threshold_", "unfold", "upsample", "upsample_bilinear", "upsample_nearest",
    "scaled_dot_product_attention", "multi_head_attention_forward", "cross_entropy", "nll_loss", "mse_loss",
    "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div",
)
_FFT = ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn", "rfftn", "irfftn",
        "fftshift", "ifftshift", "hfft", "ihfft", "fftfreq", "rfftfreq")
_LINALG = ("norm", "vector_norm", "matrix_norm", "det", "slogdet", "inv", "pinv", "solve", "cholesky", "qr",
           "svd", "svdvals", "eigh", "eigvalsh", "matmul", "cross", "vecdot", "multi_dot", "matrix_power",
           "diagonal", "lstsq")
_SPECIAL = ("erf", "erfc", "erfinv", "expit", "logit", "expm1", "exp2", "log1p", "softmax", "log_softmax",
            "sinc", "round", "i0", "xlogy", "entr", "ndtr", "ndtri", "log_ndtr", "gammaln", "digamma", "logsumexp")
_OPERATOR = (
    "abs", "add", "and_", "concat", "contains", "eq", "floordiv", "ge", "getitem", "gt", "iadd", "iand",
    "ifloordiv", "ilshift", "imatmul", "imod", "imul", "index", "inv", "invert", "ior", "ipow", "irshift", "is_",
    "is_not", "isub", "itruediv", "ixor", "le", "lshift", "lt", "matmul", "mod", "mul", "ne", "neg", "not_", "or_",
    "pos", "pow", "rshift", "setitem", "sub", "truediv", "truth", "xor",
)
_MATH = ("ceil", "floor", "trunc", "sqrt", "exp", "log", "log2", "log10", "pow", "fabs", "sin", "cos", "tan",
         "tanh", "erf", "isfinite", "isinf", "isnan", "prod", "gcd", "copysign", "fmod", "hypot", "atan2")
_BUILTINS = ("getattr", "len", "abs", "min", "max", "int", "float", "bool", "round", "slice", "range", "tuple",
             "list", "sum", "pow", "divmod")
_FXQ_FUNCTIONS = (("fxq.frontends.caffe.modules", ("caffe_pool2d", "caffe_interp")),
                  ("fxq.ops", ("fake_quant_linear", "fake_quant_float")),
                  ("fxq.graph.attention", ("apply_attention_mask",)))
_ONNX2TORCH_FUNCTIONS = (("onnx2torch.node_converters.binary_math_operations", ("_onnx_div",)),
                         ("onnx2torch.node_converters.reduce", ("_log_sum", "_log_sum_exp", "_sum_square")))
"""onnx2torch's own functions its modules hold as attributes (``OnnxBinaryMathOperation.math_op_function``)."""
_FXQ_OPS = ("fake_quant_linear", "fake_quant_linear_backward", "fake_quant_float", "fake_quant_float_backward",
            "lstm", "gru")

_ATEN_LISTED = tuple(sorted({
    *(n for n in _ELEMENTWISE + _REDUCTIONS + _SHAPES + _LINEAR_ALGEBRA + _NN_OPS if not n.startswith("_")),
    "hardtanh", "hardswish", "hardsigmoid", "gelu", "silu", "elu", "leaky_relu", "mish", "softplus", "glu",
    "log_sigmoid_forward", "_softmax", "_log_softmax", "_to_copy", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "native_group_norm",
    "linear", "addmm", "view", "expand", "contiguous", "alias", "slice", "sym_size", "sym_numel", "sym_stride",
    "sym_not", "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_nearest1d",
    "upsample_linear1d", "upsample_nearest3d", "upsample_trilinear3d", "_upsample_nearest_exact2d",
    "_upsample_bilinear2d_aa", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "pad", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
    "affine_grid_generator", "repeat", "expand_as", "linspace", "logspace", "zeros", "ones", "full", "empty",
    "arange", "scalar_tensor", "new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like",
    "full_like", "empty_like", "copy", "fill", "lift_fresh_copy", "item", "_local_scalar_dense", "t", "mean", "sum",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "embedding", "split_with_sizes", "squeeze_copy", "unsqueeze_copy",
    "permute_copy", "view_copy", "rsub", "_assert_scalar", "_assert_tensor_metadata", "index", "dropout",
    "native_dropout", "bernoulli",
}))
"""aten ops that are in neither core ATen nor pointwise and that fxq graphs hold: torch.export keeps a torch
function a model calls as the aten op of its name (``aten.meshgrid``, ``aten.instance_norm``), hence the torch-level
lists; the rest are the ops fxq's captures were seen to contain. Every overload still passes :func:`aten_refusal`."""
_ATEN_WRITES = ("copy_",)
"""In-place aten ops admitted although they write: ``ExportedProgram.module()`` writes a mutated input or buffer
back with ``copy_`` (fxq's capture keeps those writes: they are state, not arithmetic)."""
_ATEN_NEVER = re.compile(r"as_strided|resize|storage|unsafe|file|^_?set(_|$)|^_reshape_alias|^_?save|^_?load"
                         r"|^_print|^_make_|^_nested|sparse|^_debug|data_ptr|record_stream")
"""Refused whatever their tags: ops that reinterpret or resize memory (``as_strided``, ``set_``, ``resize_``,
``_reshape_alias``, ``_unsafe_index`` skips bounds checks), touch files (``from_file``, ``save``) or storages, or
build tensors from raw parts (``_make_*``, ``_nested_*``, sparse constructors)."""
_ATEN_STR_ARGS = frozenset({"approximate", "rounding_mode", "reduce", "mode", "padding", "padding_mode", "equation",
                            "indexing", "norm", "side", "interpolation", "UPLO", "ord", "driver", "assert_msg",
                            "pad_mode"})
"""The only ``str`` arguments an admitted aten op may take: options from a fixed set of words (``gelu``'s
``approximate``, ``div``'s ``rounding_mode``, ``einsum``'s equation...), never a file name or a free string."""
_ATEN_NEVER_TYPES = ("Storage", "Stream", "Any")
"""Argument types that refuse an aten op (raw storages, streams, untyped values)."""

_NN_CLASSES = (
    "Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity", "Linear",
    "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "Fold",
    "Unfold", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "LPPool1d", "LPPool2d", "LPPool3d", "FractionalMaxPool2d", "FractionalMaxPool3d", "MaxUnpool1d",
    "MaxUnpool2d", "MaxUnpool3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
    "InstanceNorm3d", "LayerNorm", "GroupNorm", "LocalResponseNorm", "CrossMapLRN2d", "RMSNorm", "Dropout",
    "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "ReLU", "ReLU6", "LeakyReLU",
    "PReLU", "RReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Hardtanh", "Hardswish",
    "Hardsigmoid", "Hardshrink", "Softshrink", "Tanhshrink", "Softplus", "Softsign", "LogSigmoid", "Softmax",
    "Softmax2d", "LogSoftmax", "Softmin", "GLU", "Threshold", "MultiheadAttention", "Embedding", "EmbeddingBag",
    "Flatten", "Unflatten", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle",
    "PixelUnshuffle", "ChannelShuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
    "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d", "CosineSimilarity",
    "PairwiseDistance", "Transformer", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell",
)
_FXQ_CLASSES = (
    ("fxq.nn.fake_quantize", ("FakeQuantize",)),
    ("fxq.recurrent.modules", ("RecurrentLayer",)),
    ("fxq.qat", ("QATFakeQuantize", "QATBiasQuantize", "FrozenBatchNorm")),
    ("fxq.algorithms.adaround", ("AdaRoundQuantizer",)),
    ("fxq.algorithms.training", ("DropQuantize",)),
    ("fxq.frontends.caffe.modules", ("CaffePooling2d", "CaffeScale", "CaffeChannelScale1d", "CaffeChannelScale2d",
                                     "CaffeChannelScale3d", "CaffePower", "CaffeLRNWithinChannel", "CaffeInterp",
                                     "CaffeNormalize")),
    ("fxq.frontends.onnx.converters.auto_pad", ("OnnxSamePad", "OnnxAsymmetricPad")),
    ("fxq.frontends.onnx.converters.clip", ("OnnxClipRunTime",)),
    ("fxq.frontends.onnx.converters.conv_transpose", ("OnnxConvTransposeToShape",)),
    ("fxq.frontends.onnx.converters.cumsum", ("OnnxCumSum",)),
    ("fxq.frontends.onnx.converters.dropout", ("OnnxDropoutWithMask",)),
    ("fxq.frontends.onnx.converters.grid_sample", ("OnnxGridSample",)),
    ("fxq.frontends.onnx.converters.group_norm", ("OnnxGroupNormalization", "OnnxMeanVarianceNormalization")),
    ("fxq.frontends.onnx.converters.hardmax", ("OnnxHardmax", "OnnxOneHot")),
    ("fxq.frontends.onnx.converters.layout", ("OnnxFlatten", "OnnxDepthToSpace", "OnnxSpaceToDepth",
                                              "OnnxGatherElements", "OnnxNonZero")),
    ("fxq.frontends.onnx.converters.lp", ("OnnxLpNormalization", "OnnxGlobalLpPool", "OnnxLpPool")),
    ("fxq.frontends.onnx.converters.max_pool", ("OnnxMaxPoolWithIndices", "OnnxGlobalMaxPool")),
    ("fxq.frontends.onnx.converters.pad", ("OnnxPad", "OnnxPadRuntime")),
    ("fxq.frontends.onnx.converters.reduce", ("OnnxReduce",)),
    ("fxq.frontends.onnx.converters.reshape", ("OnnxReshape",)),
    ("fxq.frontends.onnx.converters.resize", ("OnnxResizeExact", "OnnxUpsample7")),
    ("fxq.frontends.onnx.converters.scatter", ("OnnxScatterElements", "OnnxScatterND", "OnnxGatherND")),
    ("fxq.frontends.onnx.converters.slice", ("OnnxSliceIndexed", "OnnxSliceAttributes")),
    ("fxq.frontends.onnx.converters.select", ("OnnxUnique", "OnnxCompress", "OnnxReverseSequence",
                                              "OnnxCenterCropPad")),
    ("fxq.frontends.onnx.converters.split", ("OnnxSplit",)),
    ("fxq.frontends.onnx.converters.topk", ("OnnxTopK",)),
    ("fxq.frontends.onnx.converters.trilu", ("OnnxTrilu",)),
)

TENSOR_METHODS = frozenset({
    *(n for n in _ELEMENTWISE + _REDUCTIONS + _SHAPES + _LINEAR_ALGEBRA if not n.startswith("_")),
    "abs_", "add_", "addcmul_", "clamp_", "clamp_min_", "clamp_max_", "copy_", "div_", "exp_", "fill_",
    "masked_fill_", "mul_", "neg_", "pow_", "relu_", "sigmoid_", "sqrt_", "sub_", "tanh_", "zero_", "round_",
    "floor_", "ceil_", "clip_", "index_put_", "scatter_", "scatter_add_", "unsqueeze_", "squeeze_", "t_",
    "transpose_", "hardtanh_", "leaky_relu_", "bool", "byte", "char", "contiguous", "cpu", "cuda", "dim",
    "double", "element_size", "expand", "expand_as", "float", "half", "bfloat16", "int", "long", "short",
    "is_contiguous", "item", "ndimension", "nelement", "new_empty", "new_full", "new_ones", "new_tensor",
    "new_zeros", "numel", "repeat", "reshape_as", "resize_as_", "size", "softmax", "log_softmax", "stride",
    "to", "tolist", "type_as", "view", "view_as", "unfold", "flatten", "relu", "hardtanh", "requires_grad_",
    "get_device", "type", "sum_to_size", "as_subclass", "nan_to_num", "bernoulli", "uniform_", "normal_",
    "exponential_", "random_", "cauchy_", "log_normal_", "geometric_",
} - {"as_subclass", "type"})
"""``call_method`` targets: pure tensor methods (never ``storage``, ``set_``, ``share_memory_``, ``apply_``...)."""

GETATTR_NAMES = frozenset({"shape", "dtype", "device", "ndim", "T", "mT", "H", "mH", "data", "is_cuda",
                           "is_quantized", "is_sparse", "layout", "requires_grad", "real", "imag", "itemsize",
                           "nbytes", "is_leaf", "grad"})
"""Attributes a ``getattr`` node may read: data, never a bound method."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PATH_PART = re.compile(r"[A-Za-z0-9_/:+\-@#\[\]()<>,=~! ]{1,200}\Z")
"""A module / attribute name that is not an identifier (``0``, onnx2torch's ``stem/0/Conv``): torch.fx writes it
as ``getattr(self, "...")``, so it may hold no quote, backslash or line break."""


# ---------------------------------------------------------------------------------------------- names
def check_identifier(name: Any, what: str) -> str:
    """``name`` if it is a plain identifier (ASCII, not a keyword, not a dunder); else :class:`NotSupportedError`."""
    why = None
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        why = "not a plain identifier"
    elif name.startswith("__"):
        why = "dunder name"
    elif keyword.iskeyword(name) or name == "self":
        why = "Python keyword"
    if why:
        raise NotSupportedError(f"{what} {name!r:.100} is not allowed in fxq files ({why})")
    return name


def check_part(name: Any, what: str) -> str:
    """``name`` if it can name a submodule, parameter or buffer: an identifier (see :func:`check_identifier`) or
    a name of digits, letters and ``_/:+-@#[]()<>,=~!`` and spaces (``0``, ``stem/0/Conv``)."""
    if isinstance(name, str) and _PATH_PART.match(name) and not name.isidentifier():
        return name
    return check_identifier(name, what)


def check_path(path: Any, what: str) -> str:
    """``path`` if it is a dotted path of :func:`check_part` names (``layer1.0.conv1``)."""
    if not isinstance(path, str) or not path:
        raise NotSupportedError(f"{what} {path!r} is not allowed in fxq files (not a dotted path)")
    for part in path.split("."):
        check_part(part, f"{what} {path!r}: part")
    return path


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def register_serializable(obj: Any) -> Any:
    """Allow ``fxq.save``/``fxq.load`` to name a module class or function of yours; usable as a decorator.

    Example:
        >>> @register_serializable
        ... class MyBlock(nn.Module): ...
    """
    is_module = isinstance(obj, type) and issubclass(obj, nn.Module)
    if isinstance(obj, type) and not is_module or not callable(obj):
        raise NotSupportedError(f"register_serializable takes an nn.Module subclass or a function, got {obj!r}")
    SERIALIZABLE.register(_qualified(obj), obj, override=True)
    return obj


# ---------------------------------------------------------------------------------------------- classes
@functools.lru_cache(maxsize=1)
def _class_table() -> dict[str, type]:
    classes: list[type] = [getattr(nn, n) for n in _NN_CLASSES if isinstance(getattr(nn, n, None), type)]
    classes.append(nn.modules.linear.NonDynamicallyQuantizableLinear)
    for module_name, names in _FXQ_CLASSES:
        module = _import_ours(module_name)
        classes += [getattr(module, n) for n in names] if module is not None else []
    return {_qualified(c): c for c in classes}


def _import_ours(module_name: str) -> Any:
    """One of fxq's own modules named in this file (never a name from a saved file)."""
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(module_name)
    except ImportError:  # optional dependency (onnx2torch) missing
        return None


@functools.lru_cache(maxsize=1)
def _onnx2torch_classes() -> dict[str, type]:
    """Index of the module classes onnx2torch defines, keyed by ``module:qualname`` (built once)."""
    if _import_ours("onnx2torch") is None:
        return {}
    out: dict[str, type] = {}
    for module_name in sorted(m for m in list(sys.modules) if m == "onnx2torch" or m.startswith("onnx2torch.")):
        module = sys.modules.get(module_name)
        for value in list(vars(module).values()) if module is not None else ():
            if isinstance(value, type) and issubclass(value, nn.Module) and value.__module__ == module_name:
                out[_qualified(value)] = value
    return out


def class_name(cls: type) -> str | None:
    """``module:qualname`` of an allowed module class, else None."""
    name = _qualified(cls)
    if name in SERIALIZABLE and SERIALIZABLE.get(name) is cls:
        return name
    return name if _lookup_class(name) is cls else None


def _lookup_class(name: str) -> type | None:
    return _lookup(name, _onnx2torch_classes, _class_table)


def _lookup(name: str, onnx2torch_table: Callable[[], dict[str, Any]], table: Callable[[], dict[str, Any]]) -> Any:
    """``name`` in ``table``, or in ``onnx2torch_table`` for onnx2torch's names (built on first use: importing
    onnx2torch is slow)."""
    return (onnx2torch_table() if name.startswith("onnx2torch.") else table()).get(name)


def _resolve(name: Any, what: str, lookup: Callable[[str], Any], registered: Callable[[Any], bool]) -> Any:
    """The object saved as ``name``: a registration that ``registered`` accepts, else the built-in table; anything
    else is a :class:`NotSupportedError` (a file names only what fxq allows)."""
    if isinstance(name, str):
        if name in SERIALIZABLE and registered(SERIALIZABLE.get(name)):
            return SERIALIZABLE.get(name)
        obj = lookup(name)
        if obj is not None:
            return obj
    raise NotSupportedError(f"{what} {name!r} is not allowed in fxq files; register it with "
                            f"fxq.serialization.register_serializable before fxq.load")


def resolve_class(name: Any) -> type:
    """The class saved as ``name``, if it is in the class table; otherwise :class:`NotSupportedError`."""
    return _resolve(name, "module class", _lookup_class, lambda obj: isinstance(obj, type))


# ---------------------------------------------------------------------------------------------- functions
@functools.lru_cache(maxsize=1)
def _function_table() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}

    def add(prefix: str, namespace: Any, names: tuple[str, ...]) -> None:
        for attr in names:
            obj = getattr(namespace, attr, None)
            if callable(obj) and not isinstance(obj, type):
                table[f"{prefix}:{attr}"] = obj

    add("torch", torch, _TORCH)
    add("torch.nn.functional", F, _FUNCTIONAL)
    add("operator", operator, _OPERATOR)
    add("math", math, _MATH)
    add("torch.fft", torch.fft, _FFT)
    add("torch.linalg", torch.linalg, _LINALG)
    add("torch.special", torch.special, _SPECIAL)
    for attr in _BUILTINS:
        table[f"builtins:{attr}"] = getattr(builtins, attr)
    for module_name, names in _FXQ_FUNCTIONS:
        module = _import_ours(module_name)
        if module is not None:
            add(module_name, module, names)
    for op in _FXQ_OPS:
        packet = getattr(torch.ops.fxq, op, None) if hasattr(torch.ops, "fxq") else None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        table[f"torch.ops:fxq::{op}"] = packet
        for overload in packet.overloads():
            if not overload.endswith("out"):
                table[f"torch.ops:fxq::{op}.{overload}"] = getattr(packet, overload)
    table.update(_aten_table())
    return table


def _aten_overloads() -> Iterator[torch._ops.OpOverload]:
    """Every aten overload torch registers (from torch's own schema list, never from a file's names)."""
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            packet = getattr(torch.ops.aten, schema.name[len("aten::"):], None)
            overload = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
            if isinstance(overload, torch._ops.OpOverload):
                yield overload


def aten_refusal(op: torch._ops.OpOverload) -> str | None:
    """Why fxq files may not name aten overload ``op`` (None: they may); the rule of the module docstring."""
    schema = op._schema
    base = schema.name.split("::", 1)[1]
    if _ATEN_NEVER.search(base):
        return "it reinterprets or resizes memory, or touches files or storages"
    if schema.is_mutable and base not in _ATEN_WRITES:
        return "it writes into its arguments (an in-place or out= overload)"
    for arg in schema.arguments:
        kind = str(arg.type)
        if any(t in kind for t in _ATEN_NEVER_TYPES):
            return f"its argument {arg.name!r} is a {kind}"
        if "str" in kind and arg.name not in _ATEN_STR_ARGS:
            return f"its argument {arg.name!r} is a free string"
    if (not {torch.Tag.core, torch.Tag.pointwise} & set(op.tags) and base not in _ATEN_LISTED + _ATEN_WRITES
            and base not in TENSOR_METHODS):
        return "it is neither core ATen nor pointwise, and not among the aten ops fxq graphs hold"
    return None


def _overload_name(op: torch._ops.OpOverload) -> str:
    """The name a file holds for ``op``: ``torch.ops:aten::add.Tensor``."""
    return f"torch.ops:{op._schema.name}.{op._overloadname}"


@functools.lru_cache(maxsize=1)
def _aten_verdicts() -> dict[str, tuple[torch._ops.OpOverload, str | None]]:
    """Every aten overload by its file name, with :func:`aten_refusal`'s verdict (built once)."""
    return {_overload_name(op): (op, aten_refusal(op)) for op in _aten_overloads()}


def _aten_table() -> dict[str, Callable[..., Any]]:
    return {name: op for name, (op, why) in _aten_verdicts().items() if why is None}


@functools.lru_cache(maxsize=1)
def _onnx2torch_functions() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    for module_name, names in _ONNX2TORCH_FUNCTIONS:
        module = _import_ours(module_name)
        for attr in names if module is not None else ():
            fn = getattr(module, attr, None)
            if callable(fn) and not isinstance(fn, type):
                table[f"{module_name}:{attr}"] = fn
    return table


def _lookup_function(name: str) -> Callable[..., Any] | None:
    return _lookup(name, _onnx2torch_functions, _function_table)


@functools.lru_cache(maxsize=1)
def _function_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for name, fn in _function_table().items():  # first listed name wins: torch before torch.nn.functional
        names.setdefault(id(fn), name)
    return names


def function_name(fn: Callable[..., Any]) -> str | None:
    """A name :func:`resolve_function` turns back into ``fn``, or None if ``fn`` is not allowed."""
    for key, obj in SERIALIZABLE.items():
        if obj is fn:
            return key
    if isinstance(fn, torch._ops.OpOverload):
        name = _overload_name(fn)
    elif isinstance(fn, torch._ops.OpOverloadPacket):
        name = f"torch.ops:{fn._qualified_op_name}"
    elif str(getattr(fn, "__module__", "")).startswith("onnx2torch."):
        return next((k for k, v in _onnx2torch_functions().items() if v is fn), None)
    else:
        return _function_names().get(id(fn))
    return name if _function_table().get(name) is fn else None


def resolve_function(name: Any) -> Callable[..., Any]:
    """The function saved as ``name``, looked up only in the function table (and registrations)."""
    op, why = _aten_verdicts().get(name, (None, None)) if isinstance(name, str) else (None, None)
    if why is not None and name not in SERIALIZABLE:
        raise NotSupportedError(f"function {name!r} is not allowed in fxq files: {op._schema.name}.{op._overloadname} is "
                                f"refused because {why}; fxq.save never writes it: a crafted file, or one from an older "
                                f"fxq (capture and save the model again with this one)")
    return _resolve(name, "function", _lookup_function, lambda obj: True)


def check_node(op: str, target: Any, args: tuple) -> None:
    """Refuse a ``getattr`` node of an attribute outside :data:`GETATTR_NAMES` (a bound method, ``__class__``...)."""
    if op == "call_function" and target is builtins.getattr:
        attr = args[1] if len(args) > 1 else None
        if len(args) != 2:
            raise NotSupportedError(f"getattr with {len(args)} arguments is not allowed in fxq files (only getattr(x, name))")
        if attr not in GETATTR_NAMES:
            raise NotSupportedError(f"getattr of {attr!r} is not allowed in fxq files (only {sorted(GETATTR_NAMES)})")
    if op in ("get_attr", "call_module"):
        check_path(target, f"{op} target")


def check_method(name: Any) -> str:
    """``name`` if it is an allowed ``torch.Tensor`` method (a ``call_method`` target)."""
    if not isinstance(name, str) or name not in TENSOR_METHODS or not hasattr(torch.Tensor, name):
        raise NotSupportedError(f"call_method target {name!r} is not allowed in fxq files (not an allowed "
                                f"torch.Tensor method)")
    return name
