"""Shared fixtures. Triton kernels run in the interpreter unless a GPU run asks otherwise."""
import os

if os.environ.get("FXQ_TEST_TRITON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Small convs are far faster on one thread on a busy 2-core machine (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_WITHOUT_INT8_FUSIONS: set[str] = set()
"""The tests whose default onnxruntime sessions ran without the int8 fusions (this CPU saturates)."""


def pytest_terminal_summary(terminalreporter) -> None:
    if _WITHOUT_INT8_FUSIONS:
        terminalreporter.write_line(
            f"fxq: this CPU's onnxruntime int8 kernels saturate (x86 without VNNI): {len(_WITHOUT_INT8_FUSIONS)} "
            "test(s) ran default sessions of files whose weights can saturate without the int8 fusions "
            "(tests/conftest.py); run them on a CPU with VNNI for the fused kernels")


def _exact_int8_session_class():
    """``onnxruntime.InferenceSession`` whose optimized sessions of a file with weights its int8 kernels can
    saturate (:func:`fxq.backends.qdq.ort_bias.u8s8_saturation_issues`) leave out the int8 kernel fusions, or None
    where this CPU does not saturate (:func:`~fxq.backends.qdq.ort_bias.cpu_saturates_u8s8`: x86 without VNNI)."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        return None
    from fxq.backends.qdq.ort_bias import cpu_saturates_u8s8, u8s8_saturation_issues

    if not cpu_saturates_u8s8():
        return None
    fusions = ("QDQSelectorActionTransformer", "QDQS8ToU8Transformer")

    class ExactInt8Session(ort.InferenceSession):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
            level = getattr(sess_options, "graph_optimization_level", ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
            if level not in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
                try:  # a path's external data is read beside it
                    model = (onnx.load_from_string(bytes(path_or_bytes))
                             if isinstance(path_or_bytes, (bytes, bytearray)) else onnx.load(str(path_or_bytes)))
                    saturates = bool(u8s8_saturation_issues(model))
                except Exception:  # weights handed over in memory, unreadable here: take the exact kernels
                    saturates = True
                if saturates:
                    kwargs["disabled_optimizers"] = sorted({*(kwargs.get("disabled_optimizers") or ()), *fusions})
                    _WITHOUT_INT8_FUSIONS.add(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" (")[0])
            super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)

    return ExactInt8Session


_EXACT_INT8_SESSION = _exact_int8_session_class()
if _EXACT_INT8_SESSION is not None:
    from fxq.backends.qdq.ort_bias import cpu_saturates_u8s8 as _CPU_SATURATES


@pytest.fixture(autouse=True)
def _as_on_a_cpu_with_vnni(request, monkeypatch):
    """On x86 CPUs without VNNI onnxruntime's int8 kernels add pairs of 8-bit products with int16 saturation, a
    property of the machine that fxq's exports name (``ort_int8_reduce_range`` avoids it). The tests compare
    default sessions with fxq's simulation exactly and read exports' warnings, so on such a CPU they run as on one
    with VNNI: a default session of a file whose weights can saturate leaves out those kernels' fusions, and fxq
    takes the CPU for one that does not saturate. Elsewhere nothing changes. Tests of the saturation itself are
    marked ``real_ort_kernels``."""
    if _EXACT_INT8_SESSION is not None and "real_ort_kernels" not in request.keywords:
        import onnxruntime as ort

        from fxq.backends.qdq import ort_bias

        monkeypatch.setattr(ort, "InferenceSession", _EXACT_INT8_SESSION)
        monkeypatch.setattr(ort_bias, "cpu_saturates_u8s8", lambda cpuinfo=None: False if cpuinfo is None else
                            _CPU_SATURATES(cpuinfo))
    yield
