"""ONNX machinery shared by the Q/DQ exporters (TensorRT, ONNX Runtime, OpenPPL).

Flow: :func:`marking.build_marked_module` (fx copy with identity marks) -> :func:`lowering.lower`
(torch.onnx, names resolved) -> :func:`insert.insert_qdq` or :func:`insert.strip_marks` ->
:func:`common.finalize`. Submodules import onnx; this package does not, so ``import fxq`` stays light.
"""
