"""Passes over ``torch.fx.GraphModule``s: trace, standardize, dispatch, prepare, calibrate, convert, summary.

Each module holds plain functions ``GraphModule -> GraphModule`` (or queries over one); the public entry points
are re-exported from :mod:`fxq`.
"""
