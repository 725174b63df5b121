"""fx helpers every graph pass needs, kept below all of them (no fxq imports) so any pass can use them."""
from __future__ import annotations

from typing import Any

from torch import fx

__all__ = ["get_attr_value", "redirect_later_readers", "thaw", "Interpreter"]


def get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target (``"layer1.0.conv1.weight"``) names in ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def redirect_later_readers(written: fx.Node, new_value: fx.Node, writer: fx.Node, order: dict[fx.Node, int]) -> None:
    """Make the readers of ``written`` that come after ``writer`` (by ``order``, node -> position) read
    ``new_value``: how an in-place write becomes an out-of-place one without changing what the graph computes."""
    for user in [u for u in written.users if order.get(u, -1) > order[writer]]:
        user.replace_input_with(written, new_value)


def thaw(value: Any) -> Any:
    """Plain lists / dicts for fx's immutable argument containers (nested in tuples too): the arguments a node's
    function gets when the generated code runs it (a literal ``[7, 7, 7]`` is a new list on every call)."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if isinstance(value, immutable_list):
        return [thaw(v) for v in value]
    if isinstance(value, immutable_dict):
        return {k: thaw(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(thaw(v) for v in value)
    return value


class Interpreter(fx.Interpreter):
    """``torch.fx.Interpreter`` whose calls get their own mutable copies of list / dict arguments, as the generated
    code gives them. torch.fx's own passes the node's immutable list itself, which functions that edit their argument
    in place (torchvision's Swin3D ``_get_window_and_shift_size``) cannot take. Every fxq interpreter derives from
    this one."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return thaw(args), thaw(kwargs)
