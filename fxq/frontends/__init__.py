"""Frontends: model files from other frameworks -> one annotated ``torch.fx.GraphModule``.

Each frontend is a subpackage (``fxq.frontends.onnx``, ...) whose loader returns a ``GraphModule`` that the rest
of fxq treats like a traced ``nn.Module``, with the original names kept in ``node.meta``.
"""
