"""fxq's numeric core, in layers that import only downwards.

1. :mod:`fxq.numeric.reference`: the one definition of the math (rounding, linear and FP8 fake-quant, their
   gradients), in plain torch.
2. :mod:`fxq.numeric.opspec`: the ``fxq::`` ops' argument lists, written once, each tied to its reference.
3. Kernels (:mod:`fxq.fused_cpu`, :mod:`fxq.triton_kernels`) implement those ops from the two modules above.
4. :mod:`fxq.ops` registers the ops (forward, backward, fake, autograd, per-device kernels) from the table.
5. :mod:`fxq.functional` is the config-level API on top.
"""
