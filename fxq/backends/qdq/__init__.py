"""ONNX machinery shared by the Q/DQ exporters (TensorRT, ONNX Runtime, OpenPPL): the template they subclass.

:class:`template.QdqOnnxExporter` runs the shared steps (options, model, files, capability pre-check, opset,
lowering, atomic write) and calls the backend's ``render``. Lowering: :func:`marking.build_marked_module` (fx
copy with identity marks) -> :func:`lowering.lower` (torch.onnx, names resolved) -> :func:`insert.insert_qdq` or :func:`insert.strip_marks` ->
:func:`common.finalize`; :mod:`ort_bias` finds the biases a default onnxruntime session would not add as
written. Submodules import onnx; this package does not, so ``import fxq`` stays light.
"""
