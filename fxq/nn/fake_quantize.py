"""``FakeQuantize``: the module that simulates quantization of one tensor in a float graph."""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from fxq.errors import ConfigError
from fxq.functional import bound_call, fake_quantize
from fxq.fused_cpu import values_only
from fxq.observers import Observer, build_observer
from fxq.spec import QuantScheme, QuantState, TensorQuantConfig

__all__ = ["ALIGNMENTS", "Alignment", "FakeQuantize", "MODES", "ROLES"]

logger = logging.getLogger(__name__)

ROLES = ("activation", "weight", "bias")
"""What a quantizer in a prepared graph quantizes: a value computed from data, a weight, or a passive bias."""

ALIGNMENTS = ("largest", "output")
"""How an activation quantizer shares its grid with others: ``("largest", members)``, every member of the group (it
included, in the op's input order) takes the widest range (an Add's inputs); ``("output", target)``, it takes the
output quantizer ``target``'s parameters (a Concat's input)."""

Alignment = tuple[str, Any]
"""One entry of :attr:`FakeQuantize.aligned`: ``("largest", (member, ...))`` or ``("output", target)``."""

_BAKED = (QuantState.BAKED, QuantState.PASSIVE_BAKED)  # values already on the grid: pass through
_KEPT: "weakref.WeakKeyDictionary[FakeQuantize, tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]]" = \
    weakref.WeakKeyDictionary()
"""The last result of each quantizer that keeps it (:meth:`FakeQuantize.keep_result`): its key, the result, and an
alias of the input (which holds the input's storage, so that its address cannot be another tensor's)."""

MODES = {
    "observe": (True, False),
    "quantize": (False, True),
    "disabled": (False, False),
    "qat": (True, True),
}
"""Mode name -> (observer enabled, fake-quant enabled)."""


class FakeQuantize(nn.Module):
    """Observe and/or fake-quantize the tensor that flows through, as its config says.

    Modes (:meth:`set_mode`): ``observe`` feeds the observer and passes values through, ``quantize``
    fake-quantizes (when the state is a quantizing one), ``disabled`` passes through (the seeds'
    ``dequantize()``), ``qat`` does both. Scale and offset live in buffers — or in parameters after
    :meth:`make_learnable` — and ``config.scale``/``config.offset`` always point at them (also after
    ``.to()`` / ``.double()``).

    This module is the one record of a quantizer: its scheme (:attr:`scheme`, frozen), its state
    (``scale``/``offset``, ``config.state``, the FP32 copy of a baked weight in the ``fp32_backup`` buffer, so
    ``state_dict`` is complete) and, in a prepared graph, what it quantizes: :attr:`role`, :attr:`param` (the parameter behind a weight / bias) and, for a passive
    bias, :attr:`derived_from` (its input and weight quantizers), for an activation, :attr:`aligned` (the groups whose
    grid it shares, see :data:`ALIGNMENTS`). The node it quantizes is its node's input in the graph; the graph
    queries around it are answered by
    :class:`fxq.graph.quant_graph.QuantGraph`.

    Args:
        config: the tensor's quantization config (this module takes ownership of it).
        name: label used in error messages (set by the graph code to the quantizer's name).
        role: ``"activation"``, ``"weight"`` or ``"bias"``; None for a quantizer outside a prepared graph.
        param: ``get_attr`` target of the weight / bias it quantizes.
        derived_from: (input quantizer or None, weight quantizer) a passive bias derives its scale from.
        aligned: the alignment entries of an activation quantizer, in the order they were recorded (graph order).

    Example:
        >>> fq = FakeQuantize(TensorQuantConfig(num_bits=8))
        >>> fq.set_mode("observe"); _ = fq(torch.randn(16)); fq.compute_qparams()
        >>> fq.set_mode("quantize"); y = fq(torch.randn(16))
    """

    def __init__(self, config: TensorQuantConfig, name: str = "", *, role: str | None = None,
                 param: str | None = None, derived_from: tuple[str | None, str] | None = None,
                 aligned: Iterable[Alignment] = ()) -> None:
        super().__init__()
        self.config = config
        self.name = name
        self.set_record(role, param, derived_from, aligned)
        scale = config.scale if config.scale is not None else torch.ones(1)
        offset = config.offset if config.offset is not None else torch.zeros_like(scale)
        self.register_buffer("scale", scale.detach().clone().float())
        self.register_buffer("offset", offset.detach().clone().float())
        self.register_buffer("fp32_backup", None)  # the FP32 values of the baked weight (None: not baked)
        self._qparams_set = config.scale is not None  # the buffers hold placeholders until parameters are set
        self._sync_config()
        self.observer: Observer | None = None
        self.observe_enabled = False
        self.quant_enabled = True

    # ------------------------------------------------------------------ record
    def set_record(self, role: str | None, param: str | None = None,
                   derived_from: tuple[str | None, str] | None = None,
                   aligned: Iterable[Alignment] = ()) -> "FakeQuantize":
        """Say what this quantizer quantizes in its graph (see the class docstring); returns self."""
        if role is not None and role not in ROLES:
            raise ConfigError(f"FakeQuantize {self.name!r}: role {role!r}; use one of {ROLES}")
        if derived_from is not None and role != "bias":
            raise ConfigError(f"FakeQuantize {self.name!r}: only a bias derives its parameters from others")
        self.role = role
        self.param = param
        self.derived_from = None if derived_from is None else tuple(derived_from)
        return self.set_alignment(aligned)

    def set_alignment(self, aligned: Iterable[Alignment]) -> "FakeQuantize":
        """Replace the groups whose grid this activation quantizer shares (entries of :data:`ALIGNMENTS`); returns
        self."""
        entries = []
        for entry in aligned:
            kind, other = entry if isinstance(entry, (tuple, list)) and len(entry) == 2 else (None, None)
            if kind == "largest" and isinstance(other, (tuple, list)) and all(isinstance(m, str) for m in other):
                entries.append((kind, tuple(other)))
            elif kind == "output" and isinstance(other, str):
                entries.append((kind, other))
            else:
                raise ConfigError(f"FakeQuantize {self.name!r}: alignment {entry!r:.80}; use ('largest', (member, ...)) "
                                  f"or ('output', target quantizer)")
        if entries and self.role != "activation":
            raise ConfigError(f"FakeQuantize {self.name!r}: only an activation quantizer is aligned with others "
                              f"(its role is {self.role!r})")
        self.aligned: tuple[Alignment, ...] = tuple(entries)
        return self

    def copy_record(self, other: "FakeQuantize") -> "FakeQuantize":
        """Take ``other``'s role, parameter, derivation and alignment (a replacement module, e.g. QAT's)."""
        return self.set_record(other.role, other.param, other.derived_from, other.aligned)

    @property
    def scheme(self) -> QuantScheme:
        """What this quantizer does, frozen: comparing two tells whether they can share parameters."""
        return self.config.scheme

    @property
    def baked(self) -> bool:
        """Whether the FP32 copy of the weight this quantizer covers is kept aside (``fp32_backup``) while the weight
        holds its quantized values."""
        return self.fp32_backup is not None

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> QuantState:
        return self.config.state

    @state.setter
    def state(self, value: QuantState) -> None:
        self.config.state = QuantState.parse(value)

    @property
    def mode(self) -> str:
        for name, flags in MODES.items():
            if flags == (self.observe_enabled, self.quant_enabled):
                return name
        raise AssertionError("unreachable")

    def set_mode(self, mode: str) -> "FakeQuantize":
        try:
            self.observe_enabled, self.quant_enabled = MODES[mode]
        except KeyError:
            raise ConfigError(f"unknown FakeQuantize mode {mode!r}; use one of {list(MODES)}") from None
        if self.observe_enabled and self.observer is None:
            self.observer = build_observer(self.config, where=self.name)
        return self

    @property
    def learnable(self) -> bool:
        return isinstance(self.scale, nn.Parameter)

    def _sync_config(self) -> None:
        """Point ``config.scale/offset`` at the buffers once they hold real parameters (None before)."""
        self.config.scale = self.scale if self._qparams_set else None
        self.config.offset = self.offset if self._qparams_set else None

    def _apply(self, fn: Any, recurse: bool = True) -> "FakeQuantize":
        # ``.to()`` / ``.double()`` replace the buffers: point the config at the new ones
        out = super()._apply(fn, recurse)
        self._sync_config()
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["_shortcut"] = None  # whatever changes, the next call checks everything again
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__["_shortcut"] = None
        super().__delattr__(name)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_shortcut", None)  # a compiled graph or a kernel launch: made again after a copy or a load
        return state

    def set_qparams(self, scale: Any, offset: Any = None, state: QuantState | None = QuantState.ACTIVATED) -> None:
        """Validate and store new parameters in place (keeps Parameter identity for optimizers)."""
        probe = self.config.replace(scale=None, offset=None)
        probe.set_qparams(scale, offset)
        with torch.no_grad():
            for attr, value in (("scale", probe.scale), ("offset", probe.offset)):
                current = getattr(self, attr)
                value = value.to(current.device)
                if current.shape == value.shape:
                    current.copy_(value)
                elif isinstance(current, nn.Parameter):
                    current.data = value.clone()
                else:
                    setattr(self, attr, value.clone())
        self._qparams_set = True
        self._sync_config()
        if state is not None:
            self.config.state = state

    def compute_qparams(self) -> None:
        """Turn the observer's statistics into scale/offset and activate this quantizer."""
        if self.observer is None:
            raise ConfigError(f"FakeQuantize {self.name!r} has no observer: set_mode('observe') and run data first")
        scale, offset = self.observer.compute_qparams()
        state = self.config.state if self.config.is_passive else QuantState.ACTIVATED
        self.set_qparams(scale, offset, state=state)

    def make_learnable(self, scale: bool = True, offset: bool = False) -> "FakeQuantize":
        """Turn scale (and offset) into ``nn.Parameter`` for LSQ/QAT."""
        if scale and not isinstance(self.scale, nn.Parameter):
            s = self.scale
            del self.scale
            self.scale = nn.Parameter(s.clone())
        if offset and not self.config.symmetric and not isinstance(self.offset, nn.Parameter):
            o = self.offset
            del self.offset
            self.offset = nn.Parameter(o.clone())
        self._sync_config()
        return self

    def freeze(self) -> "FakeQuantize":
        """Turn learned parameters back into buffers (values kept)."""
        for attr in ("scale", "offset"):
            value = getattr(self, attr)
            if isinstance(value, nn.Parameter):
                delattr(self, attr)
                self.register_buffer(attr, value.detach().clone())
        self._sync_config()
        return self

    # ------------------------------------------------------------------ forward
    _shortcut: "_Shortcut | None" = None
    """The bound call this quantizer's last :meth:`forward` ran (:func:`fxq.functional.bound_call`), called directly
    while it holds: a model runs every quantizer batch after batch, and the checks of a call cost more than a small
    activation's arithmetic. Dropped on any assignment to the module (mode, record, parameters); neither copied nor
    saved. At each call it checks the config's ``revision`` and that the module's dicts still hold its parameter
    tensors (``.to()`` puts new ones there, torch's ``functional_call`` swaps them), and the binding checks x and the
    parameters' storage and shape; only :meth:`forward` of this class takes it (a subclass that overrides
    :meth:`_quantize` never gets one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a trace must not read (and guard on) eager bookkeeping
            shortcut = self._shortcut
            if shortcut is not None:
                y = shortcut.run(x)
                if y is not None:
                    return y
                self.__dict__["_shortcut"] = None  # this call makes the next one (another shape, a new binding)
        return self._quantize(x, overwrite=False)

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` that may write its result into ``x`` (and return ``x``).

        For inference executors that know nothing else reads ``x`` (the analysis runner): on CPU it saves
        allocating and faulting in a fresh output. Same values as :meth:`forward`.
        """
        return self._quantize(x, overwrite=True)

    def _quantize(self, x: torch.Tensor, overwrite: bool) -> torch.Tensor:
        if self.observe_enabled:
            with torch.no_grad():
                self.observer.observe(x)
        if not self.quant_enabled or not self.config.is_quantizing or self.config.state in _BAKED:
            return x
        scale, offset = self._qparam("scale"), self._qparam("offset")
        keeps = self.param is not None and self.__dict__.get("_keeps_result", False)
        if (keeps and not overwrite and values_only((x, scale, offset), x.device.type)
                and not torch.is_inference_mode_enabled()):
            return self._kept_result(x, scale, offset)
        y = fake_quantize(x, self.config, scale, offset, overwrite=overwrite)
        if not (torch.compiler.is_compiling() or overwrite or keeps or self.observe_enabled
                or self._shortcut is not None or type(self)._quantize is not FakeQuantize._quantize):
            self.__dict__["_shortcut"] = _Shortcut.of(self, x, scale, offset)
        return y

    def keep_result(self, on: bool = True) -> None:
        """Keep the last fake-quantized weight and return it again while the weight and the parameters are the
        same tensors at the same storage, unchanged (their version counters), and no gradient is recorded: a weight
        that cannot be baked (a tied weight another op reads unquantized, :func:`fxq.graph.convert.bake_parameters`)
        then costs no fake-quant per forward either. Writes through ``.data`` bump no version counter and are not
        seen: change weights in place (``copy_`` under ``no_grad``) or unbake first, as fxq's algorithms do."""
        self._keeps_result = on
        if not on:
            _KEPT.pop(self, None)

    def _kept_result(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        key = (id(x), x.data_ptr(), x._version, x.dtype, scale.data_ptr(), scale._version, offset.data_ptr(),
               offset._version, self.config.scheme, self.config.state)
        kept = _KEPT.get(self)
        if kept is not None and kept[0] == key:
            return kept[1]
        out = fake_quantize(x, self.config, scale, offset)
        _KEPT[self] = (key, out, x.detach())
        return out

    def _qparam(self, name: str) -> torch.Tensor:
        """``self.<name>`` (scale / offset: a buffer or, once learnable, a Parameter) read from its dict: the call
        path of every quantizer, where ``Module.__getattr__`` costs ~0.5 us, a tenth of a fused call on a small
        activation."""
        value = self._buffers.get(name)
        if value is None:
            value = self._parameters.get(name)
        return value if value is not None else getattr(self, name)

    # ------------------------------------------------------------------ state_dict
    def get_extra_state(self) -> dict:
        d = self.config.to_dict()
        d.pop("scale")
        d.pop("offset")
        d["learnable_scale"] = isinstance(self.scale, nn.Parameter)
        d["learnable_offset"] = isinstance(self.offset, nn.Parameter)
        return d

    def set_extra_state(self, state: dict) -> None:
        d = dict(state)
        learnable_scale = d.pop("learnable_scale", False)
        learnable_offset = d.pop("learnable_offset", False)
        self.config = TensorQuantConfig.from_dict({**d, "scale": None, "offset": None})
        self.observer = None  # built from the old config; rebuilt on the next set_mode("observe")
        self._qparams_set = self.config.state not in (QuantState.INITIAL, QuantState.PASSIVE_INIT)
        self.freeze()  # the checkpoint decides what is learnable
        if learnable_scale or learnable_offset:
            self.make_learnable(scale=learnable_scale, offset=learnable_offset)
        self._sync_config()

    def __setstate__(self, state: dict) -> None:
        # a module pickled before the record lived here: its backup was a plain attribute, the record absent
        backup = state.pop("_fp32_backup", None)
        super().__setstate__(state)
        self.adopt_legacy_state(backup)

    def adopt_legacy_state(self, backup: torch.Tensor | None) -> None:
        """Complete a FakeQuantize saved before its record lived on it: the ``fp32_backup`` buffer (``backup``: the
        old ``_fp32_backup`` attribute) and empty record fields (filled from the file's old records); the old
        stored ``source`` goes (it is read from the graph)."""
        if "fp32_backup" not in self._buffers:
            self.register_buffer("fp32_backup", backup)
        for key in ("role", "param", "derived_from"):
            self.__dict__.setdefault(key, None)
        self.__dict__.setdefault("aligned", ())  # filled from the file's old alignment lists, if any
        self.__dict__.pop("source", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # a baked weight's FP32 copy is there or not as the incoming state of this quantizer says (state_dicts
        # saved before it was a buffer have none)
        key = prefix + "fp32_backup"
        if key in state_dict:
            if self.fp32_backup is None or self.fp32_backup.shape != state_dict[key].shape:
                self.fp32_backup = torch.empty_like(state_dict[key])
        elif prefix + "scale" in state_dict:
            self.fp32_backup = None
        # per-channel parameters get their size at calibration: adopt the incoming shapes
        for attr in ("scale", "offset"):
            key = prefix + attr
            current = getattr(self, attr)
            if key in state_dict and state_dict[key].shape != current.shape:
                if isinstance(current, nn.Parameter):
                    current.data = torch.empty_like(state_dict[key])
                else:
                    setattr(self, attr, torch.empty_like(state_dict[key]))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._sync_config()
        if self.param is not None and self.config.state in _BAKED and self.fp32_backup is None:
            logger.warning("quantizer %r: its weight is baked but the state_dict holds no FP32 copy (saved before "
                           "fp32_backup was a buffer): fp32_mode and unbaking cannot restore FP32 values", self.name)

    def extra_repr(self) -> str:
        return f"{self.config!r}, mode={self.mode}"


class _Shortcut:
    """A quantizer's bound call (:func:`fxq.functional.bound_call`) with what it was made under: the config's
    ``revision`` and the dicts that hold the parameters (torch's ``functional_call`` swaps tensors in them)."""

    __slots__ = ("bound", "tag", "config", "revision", "scales", "offsets")

    @classmethod
    def of(cls, fq: FakeQuantize, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> "_Shortcut | None":
        found = bound_call(fq.config, x, scale, offset)
        if found is None:
            return None
        homes = [next((d for d in (fq._buffers, fq._parameters) if d.get(name) is t), None)
                 for name, t in (("scale", scale), ("offset", offset))]
        if homes[0] is None or (len(found[0].params) == 2 and homes[1] is None):
            return None
        cut = cls()
        cut.bound, cut.tag = found
        cut.config, cut.revision = fq.config, fq.config.revision
        cut.scales, cut.offsets = homes[0], homes[1] if len(cut.bound.params) == 2 else None
        return cut

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """The quantizer's values on ``x``, or None when the shortcut does not hold (then the full call runs)."""
        if self.config.revision != self.revision:
            return None
        scale = self.scales.get("scale")
        params = (scale,) if self.offsets is None else (scale, self.offsets.get("offset"))
        return self.bound.run(x, params, self.tag)


@contextlib.contextmanager
def fake_quant_mode(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """Set every FakeQuantize in ``model`` to ``mode`` inside the block; restore the previous modes after."""
    saved = [(m, m.observe_enabled, m.quant_enabled) for m in model.modules() if isinstance(m, FakeQuantize)]
    try:
        for m, _, _ in saved:
            m.set_mode(mode)
        yield model
    finally:
        for m, obs, q in saved:
            m.observe_enabled, m.quant_enabled = obs, q
