"""Calibration data from a folder: ``.npy``, raw ``.bin``/``.raw``, ``.pt`` tensors or images.

Layout (the seeds' usage tutorial):

* one input: files directly in the folder, one batch (or sample) per file, in sorted name order
  (digit runs compare as numbers: ``img2`` before ``img10``);
* several inputs: one sub-folder per model input, named after the input; the i-th file of every
  sub-folder together make the i-th batch (a dict ``{input name: tensor}``).
"""
from __future__ import annotations

import logging
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from fxq.errors import CalibrationError

__all__ = ["CalibrationFolder", "load_calibration_folder", "DATA_SUFFIXES", "IMAGE_SUFFIXES", "MAX_IMAGE_PIXELS"]

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
RAW_SUFFIXES = (".bin", ".raw")
DATA_SUFFIXES = (".npy", ".pt", ".pth", *RAW_SUFFIXES, *IMAGE_SUFFIXES)
LAYOUTS = ("NCHW", "NHWC")
MAX_IMAGE_PIXELS = 2**26  # 64 megapixels: the default cap on width x height, read from the header before decoding

Shape = Sequence[int]


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    d = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise CalibrationError(f"unknown dtype {value!r}; use e.g. float32, float16, int64")
    return d


def _natural_key(p: Path) -> list[Any]:
    """``img2`` before ``img10``: digit runs compare as numbers."""
    return [(0, int(t), t) if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", p.name) if t]


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError as exc:
        raise CalibrationError(f"calibration folder {str(folder)!r} cannot be listed: {exc.strerror or exc}") from None


def _data_files(folder: Path) -> list[Path]:
    return sorted((p for p in _listing(folder) if p.is_file() and not p.name.startswith(".")
                   and p.suffix.lower() in DATA_SUFFIXES), key=_natural_key)


def _npy_header(f: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a ``.npy`` file from its header; object (pickled) and non-numeric arrays are refused."""
    try:
        with open(f, "rb") as fh:
            fmt = np.lib.format
            version = fmt.read_magic(fh)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(fh)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise CalibrationError(f"{f}: not a readable .npy array ({exc})") from exc
    if dtype.hasobject:
        raise CalibrationError(f"{f}: a .npy of Python objects (dtype {dtype}), which only unpickling could read; fxq "
                               f"never unpickles data files: save a numeric array (np.save of a float/int array)")
    if dtype.kind not in "biuf" or dtype.names is not None:
        raise CalibrationError(f"{f}: a .npy of dtype {dtype}; calibration data must be a numeric (float/int/bool) "
                               f"array")
    return tuple(int(d) for d in shape), dtype


def _image_pixels(f: Path, max_pixels: int, verify: bool = False) -> tuple[int, int]:
    """Width and height of an image from its header (no decoding); :class:`CalibrationError` above ``max_pixels``.

    ``verify`` also runs Pillow's structural check (a PNG's chunk CRCs, without decompressing).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():  # fxq applies its own cap below; Pillow's warning would be noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(f) as im:
                width, height = im.size
                if verify and width * height <= max_pixels:
                    im.verify()
    except Image.DecompressionBombError as exc:  # Pillow's hard limit: its message holds the pixel count
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = int(found.group(1)) if found else None
        if pixels is None or pixels > max_pixels:
            raise CalibrationError(f"{f}: the image has {pixels or 'too many'} pixels, over the cap of {max_pixels} "
                                   f"(max_image_pixels); downscale it, or raise the cap if it is genuine") from None
        raise CalibrationError(f"{f}: Pillow refuses images of {pixels} pixels (a decompression-bomb guard); "
                               f"downscale it") from None
    except Exception as exc:  # noqa: BLE001  (Pillow plugins raise OSError, SyntaxError, struct.error...)
        raise CalibrationError(f"{f}: not a readable image, or corrupt or truncated "
                               f"({type(exc).__name__}: {exc})") from None
    if width * height > max_pixels:
        raise CalibrationError(f"{f}: the image has {width}x{height} = {width * height} pixels, over the cap of "
                               f"{max_pixels} (max_image_pixels); downscale it, or raise the cap if it is genuine")
    return width, height


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by PNG colour type
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _check_png_data(f: Path) -> None:
    """:class:`CalibrationError` unless ``f``'s compressed pixel data inflates to the size its header declares.

    Streams the data (bounded memory): torchvision's PNG decoder crashes the process on a truncated file.
    """
    import struct
    import zlib

    def rows_bytes(w: int, h: int) -> int:
        return h * (1 + -(-w * channels * depth // 8)) if w and h else 0

    try:
        with open(f, "rb") as fh:
            fh.read(8)
            inflater, expected, got = zlib.decompressobj(), None, 0
            while True:
                head = fh.read(8)
                if len(head) < 8:
                    break
                length, kind = struct.unpack(">I4s", head)
                data = fh.read(length)
                fh.read(4)  # crc: Pillow's verify() checks it
                if kind == b"IHDR":
                    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[:13])
                    channels = _PNG_CHANNELS.get(colour, 4)
                    if interlace:
                        expected = sum(rows_bytes(-(-(width - x0) // dx), -(-(height - y0) // dy))
                                       for x0, y0, dx, dy in _ADAM7)
                    else:
                        expected = rows_bytes(width, height)
                elif kind == b"IDAT":
                    while data:
                        got += len(inflater.decompress(data, 1 << 20))
                        data = inflater.unconsumed_tail
                elif kind == b"IEND":
                    break
            got += len(inflater.flush())
    except (OSError, struct.error, zlib.error) as exc:
        raise CalibrationError(f"{f}: corrupt PNG pixel data ({exc})") from None
    if expected is not None and got < expected:
        raise CalibrationError(f"{f}: truncated PNG: {got} of {expected} bytes of pixel data; re-create the file")


def _effective_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


def _as_shape(shape: Any, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise CalibrationError(f"{what}: input shape {shape!r} is not a list of integers") from None
    if not dims or any(d <= 0 for d in dims):
        raise CalibrationError(f"{what}: input shape {list(dims)} must have positive dimensions")
    return dims


@dataclass(frozen=True)
class ImagePreprocess:
    """How calibration images become the model's input: decoded to RGB in ``[0, 1]``, channels reversed when
    ``bgr`` (caffe / OpenCV models), times ``pixel_max`` (255 for models fed 0-255 pixels), then
    ``(x - mean) / std`` per channel (one value, or one per channel), the conventions of OpenCV's
    ``blobFromImage`` and ncnn's ``substract_mean_normalize``.

    Example: OpenCV's res10 face detector, ``ImagePreprocess(mean=(104, 177, 123), bgr=True, pixel_max=255)``;
    torchvision's ImageNet models, ``ImagePreprocess(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))``.
    """

    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    bgr: bool = False
    pixel_max: float = 1.0

    def __post_init__(self) -> None:
        for what in ("mean", "std"):
            value = getattr(self, what)
            try:
                values = tuple(float(v) for v in (value if isinstance(value, (list, tuple)) else (value,)))
            except (TypeError, ValueError):
                raise CalibrationError(f"ImagePreprocess({what}={value!r}): give a number or one per channel") from None
            if not values or not all(math.isfinite(v) for v in values):
                raise CalibrationError(f"ImagePreprocess({what}={value!r}): give finite numbers")
            object.__setattr__(self, what, values)
        if any(v <= 0 for v in self.std):
            raise CalibrationError(f"ImagePreprocess(std={self.std}): every std must be positive")
        if not (isinstance(self.pixel_max, (int, float)) and math.isfinite(self.pixel_max) and self.pixel_max > 0):
            raise CalibrationError(f"ImagePreprocess(pixel_max={self.pixel_max!r}): give a positive number (1 or 255)")

    def __call__(self, x: torch.Tensor, source: Path) -> torch.Tensor:
        """``x``: one decoded image, ``1 x C x H x W`` in ``[0, 1]`` (RGB for 3 channels)."""
        channels = x.shape[1]
        if self.bgr:
            if channels != 3:
                raise CalibrationError(f"{source}: bgr applies to 3-channel images; this one has {channels}")
            x = x.flip(1)
        stats = []
        for what, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise CalibrationError(f"{source}: {what} has {len(values)} values for a {channels}-channel image; "
                                       f"give 1 or {channels}")
            stats.append(torch.tensor(values, dtype=x.dtype).reshape(1, -1, 1, 1))
        return (x * float(self.pixel_max) - stats[0]) / stats[1]


class _InputFiles:
    """The files of one model input and how to read them."""

    def __init__(self, name: str | None, folder: Path, files: list[Path], shape: tuple[int, ...] | None,
                 dtype: torch.dtype | None, layout: str, max_pixels: int = MAX_IMAGE_PIXELS,
                 image: ImagePreprocess | None = None) -> None:
        self.name, self.folder, self.files, self.shape, self.dtype, self.layout = name, folder, files, shape, dtype, layout
        self.max_pixels = max_pixels
        self.image = image
        self._dtypes: dict[torch.dtype, Path] = {}  # the dtype each file will load as (known from headers)
        for f in files:
            self._check_header(f)
        if len(self._dtypes) > 1:
            found = ", ".join(f"{str(d).replace('torch.', '')} ({p.name})" for d, p in self._dtypes.items())
            raise CalibrationError(f"{folder}: files hold different dtypes: {found}; convert them to one, or give "
                                   f"dtype= (--dtype) to convert every file")

    def _check_header(self, f: Path) -> None:
        """Cheap checks before any batch is loaded: raw sizes, .npy shapes and dtypes, image sizes."""
        suffix = f.suffix.lower()
        if not os.access(f, os.R_OK):
            raise CalibrationError(f"{f}: calibration file is not readable (permission denied)")
        if suffix in RAW_SUFFIXES:
            if self.shape is None:
                raise CalibrationError(f"{f}: raw {suffix} files carry no shape; give the input shape "
                                       f"(input_shape=... / --input-shape N,C,H,W)")
            itemsize = torch.empty((), dtype=self.dtype or torch.float32).element_size()
            size = f.stat().st_size
            sample = math.prod(self.shape[1:]) * itemsize
            if size == 0 or sample == 0 or size % sample != 0:
                raise CalibrationError(
                    f"{f}: {size} bytes is not a whole number of samples of shape {list(self.shape[1:])} "
                    f"({sample} bytes each as {self.dtype or torch.float32}); check the input shape and dtype")
            self._dtypes.setdefault(self.dtype or torch.float32, f)
        elif suffix == ".npy":
            shape, dtype = _npy_header(f)
            try:
                arr = np.load(f, mmap_mode="r", allow_pickle=False)  # also checks the data fills the header's shape
            except (ValueError, OSError) as exc:
                raise CalibrationError(f"{f}: not a readable .npy array ({exc})") from exc
            del arr
            self._shaped(f, shape)
            try:
                torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
            except TypeError:
                raise CalibrationError(f"{f}: torch has no dtype for the array's {dtype}; save it as float32") from None
            self._dtypes.setdefault(self.dtype or _effective_dtype(torch_dtype), f)
        elif suffix in IMAGE_SUFFIXES:
            _image_pixels(f, self.max_pixels)
            self._dtypes.setdefault(self.dtype or torch.float32, f)

    def _shaped(self, f: Path, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The batch shape of a tensor with ``shape`` read from ``f`` (adds a batch dim to one sample)."""
        if self.shape is None:
            return shape
        want = self.shape
        if shape == want or (len(shape) == len(want) and shape[1:] == want[1:]):
            return shape
        if shape == want[1:]:
            return (1, *shape)
        raise CalibrationError(f"{f}: array has shape {list(shape)} but the input shape is {list(want)} "
                               f"(batch dimension free); fix the data or the input shape")

    def load(self, i: int) -> torch.Tensor:
        f = self.files[i]
        suffix = f.suffix.lower()
        if suffix == ".npy":
            try:
                t = torch.from_numpy(np.ascontiguousarray(np.load(f, allow_pickle=False)))
            except (ValueError, OSError) as exc:
                raise CalibrationError(f"{f}: not a readable .npy array ({exc})") from exc
        elif suffix in RAW_SUFFIXES:
            dt = self.dtype or torch.float32
            t = torch.from_numpy(np.fromfile(f, dtype=torch.empty((), dtype=dt).numpy().dtype).copy())
            t = t.reshape(-1, *self.shape[1:])
        elif suffix in (".pt", ".pth"):
            try:
                t = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001  (pickle / zip errors of any kind)
                raise CalibrationError(f"{f}: cannot read it as a saved tensor ({exc})") from exc
            if not isinstance(t, torch.Tensor):
                raise CalibrationError(f"{f}: holds a {type(t).__name__}, expected one tensor")
        else:
            t = self._image(f)
        t = t.reshape(self._shaped(f, tuple(t.shape)))
        if self.dtype is not None:
            t = t.to(self.dtype)
        elif t.dtype == torch.float64:
            t = t.float()
        return t

    def _image(self, f: Path) -> torch.Tensor:
        channels = None
        if self.shape is not None and len(self.shape) == 4:
            channels = self.shape[1] if self.layout == "NCHW" else self.shape[3]
        from torchvision.io import ImageReadMode, decode_image, read_file
        from torchvision.transforms.v2.functional import to_dtype

        _image_pixels(f, self.max_pixels, verify=True)  # from the header, before a decoder allocates the pixels
        if f.suffix.lower() == ".png":
            _check_png_data(f)
        try:
            mode = {1: ImageReadMode.GRAY, 3: ImageReadMode.RGB}.get(channels, ImageReadMode.UNCHANGED)
            img = decode_image(read_file(str(f)), mode=mode)
        except RuntimeError:  # formats torchvision does not decode (BMP...): Pillow, which torchvision brings
            img = _pil_image(f, channels)
        x = to_dtype(img, torch.float32, scale=True).unsqueeze(0)  # 1 x C x H x W in [0, 1] (8- or 16-bit)
        if self.image is not None:
            x = self.image(x, f)
        if self.shape is not None and len(self.shape) == 4:
            h, w = (self.shape[2], self.shape[3]) if self.layout == "NCHW" else (self.shape[1], self.shape[2])
            if tuple(x.shape[2:]) != (h, w):
                x = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear", align_corners=False,
                                                    antialias=True)
        if self.layout == "NHWC":
            x = x.permute(0, 2, 3, 1).contiguous()
        return x


def _pil_image(f: Path, channels: int | None) -> torch.Tensor:
    from PIL import Image

    try:
        with warnings.catch_warnings():  # the size was checked against fxq's cap from the header already
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(f) as im:
                im = im.convert({1: "L", 3: "RGB"}.get(channels, im.mode))
                arr = np.asarray(im)
    except Exception as exc:  # noqa: BLE001  (Pillow plugins raise OSError, SyntaxError, struct.error...)
        raise CalibrationError(f"{f}: cannot decode the image ({type(exc).__name__}: {exc})") from exc
    t = torch.from_numpy(arr.copy())
    return t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)


class CalibrationFolder(Sequence):
    """Batches read lazily from a folder (see :func:`load_calibration_folder`); ``len()`` is the batch count."""

    def __init__(self, path: Path, inputs: list[_InputFiles], transform: Callable[[Any], Any] | None,
                 batch_size: int | None) -> None:
        self.path = path
        self.inputs = inputs
        self.transform = transform
        self._batches: list[Any] | None = None
        if batch_size is not None:
            self._batches = self._rebatch(batch_size)

    @property
    def files(self) -> list[Path]:
        return [f for inp in self.inputs for f in inp.files]

    @property
    def multi_input(self) -> bool:
        return self.inputs[0].name is not None

    def batch_source(self, i: int) -> str | None:
        """The file(s) batch ``i`` comes from (None once re-batched), for error messages."""
        if self._batches is not None or not 0 <= i < len(self):
            return None
        return ", ".join(str(inp.files[i]) for inp in self.inputs)

    def _load(self, i: int) -> Any:
        if self.multi_input:
            batch: Any = {inp.name: inp.load(i) for inp in self.inputs}
        else:
            batch = self.inputs[0].load(i)
        return self.transform(batch) if self.transform is not None else batch

    def _rebatch(self, size: int) -> list[Any]:
        if size <= 0:
            raise CalibrationError(f"batch_size must be positive, got {size}")
        items = [self._load(i) for i in range(len(self.inputs[0].files))]

        def cat(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            dtypes = sorted({str(t.dtype).replace("torch.", "") for t in parts})
            if len(dtypes) > 1:
                raise CalibrationError(f"{self.path}: files hold different dtypes {dtypes}; convert them to one, or "
                                       f"give dtype= (--dtype) to convert every file")
            try:
                return list(torch.cat(parts, 0).split(size, 0))
            except RuntimeError as exc:
                raise CalibrationError(f"{self.path}: samples have different shapes and cannot be batched "
                                       f"({exc})") from exc

        if self.multi_input:
            totals = {k: sum(int(b[k].shape[0]) for b in items) for k in items[0]}
            if len(set(totals.values())) > 1:  # re-batched, unequal counts would pair samples of different files
                raise CalibrationError(f"{self.path}: the inputs hold different numbers of samples {totals}; give "
                                       f"each input the same number of samples, or leave batch_size unset")
            cols = {k: cat([b[k] for b in items]) for k in items[0]}
            return [{k: cols[k][j] for k in cols} for j in range(len(next(iter(cols.values()))))]
        return cat(items)

    def __len__(self) -> int:
        return len(self._batches) if self._batches is not None else len(self.inputs[0].files)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self._batches[i] if self._batches is not None else self._load(i)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        names = [inp.name for inp in self.inputs] if self.multi_input else ["(single input)"]
        return f"<CalibrationFolder {str(self.path)!r}: {len(self)} batches, inputs {names}>"


def load_calibration_folder(
    path: str | os.PathLike,
    input_shape: Shape | Mapping[str, Shape] | None = None,
    dtype: torch.dtype | str | None = None,
    layout: str = "NCHW",
    *,
    batch_size: int | None = None,
    transform: Callable[[Any], Any] | None = None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    image: ImagePreprocess | None = None,
) -> CalibrationFolder:
    """Calibration batches from a folder, one batch per file, in sorted file-name order.

    Files: ``.npy`` arrays, ``.pt`` tensors, raw ``.bin``/``.raw`` (``dtype``, default float32, reshaped to
    ``input_shape`` with a free batch dimension) and images (PNG/JPEG/BMP..., scaled to [0, 1] and resized to
    ``input_shape``'s height and width; normalise them with ``transform``). A file holding one sample
    (``input_shape`` without the batch dim) gets a batch dim. For multi-input models give one sub-folder per
    input, named after it: batches are then dicts ``{input name: tensor}``.

    Args:
        path: the folder.
        input_shape: ``[N, C, H, W]``-like shape, or ``{input name: shape}`` for sub-folders. Checked against
            every file; needed for raw files.
        dtype: convert every tensor to this dtype (default: keep, but float64 becomes float32).
        layout: ``"NCHW"`` or ``"NHWC"`` — how images are laid out (and how ``input_shape`` reads for them).
        batch_size: concatenate samples and re-split them into batches of this size (loads everything).
        transform: applied to each batch (e.g. mean/std normalisation).
        max_image_pixels: largest width x height of an image (default 2**26, 64 megapixels), checked from the file
            header before decoding, so a decompression bomb is refused without allocating its pixels.
        image: how images become the model's input (:class:`ImagePreprocess`: channel order, pixel range,
            mean / std); default RGB in [0, 1]. Applies to image files only.

    Returns:
        a lazy :class:`CalibrationFolder` sequence, usable wherever fxq takes calibration data.

    Raises:
        CalibrationError: missing, unreadable or empty folder; unreadable, corrupt or pickled (object) file;
            image over ``max_image_pixels``; shape, size or dtype mismatch (naming the file).

    Example:
        >>> calib = fxq.load_calibration_folder("calib/", input_shape=[1, 3, 224, 224])
        >>> qmodel = fxq.quantize(model, calib, platform="trt_int8")
    """
    folder = Path(path)
    if not folder.exists():
        raise CalibrationError(f"calibration folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise CalibrationError(f"calibration data {str(folder)!r} is a file, not a folder of batches")
    layout = str(layout).upper()
    if layout not in LAYOUTS:
        raise CalibrationError(f"layout {layout!r}: use one of {list(LAYOUTS)}")
    if isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int) or max_image_pixels <= 0:
        raise CalibrationError(f"max_image_pixels={max_image_pixels!r}: give a positive number of pixels")
    dt = _dtype(dtype)
    files = _data_files(folder)
    subdirs = sorted(p for p in _listing(folder) if p.is_dir() and not p.name.startswith("."))
    if files:
        if isinstance(input_shape, Mapping):
            if len(input_shape) != 1:
                names = list(input_shape)
                where = ", ".join(str(folder / str(n)) for n in names[:4]) + (", ..." if len(names) > 4 else "")
                raise CalibrationError(f"{folder}: its files hold one input, but {len(names)} inputs are wanted "
                                       f"({names}); put each input's files in a sub-folder named after it ({where})")
            input_shape = next(iter(input_shape.values()))
        shape = _as_shape(input_shape, str(folder)) if input_shape is not None else None
        inputs = [_InputFiles(None, folder, files, shape, dt, layout, max_image_pixels, image)]
    elif subdirs:
        shapes = dict(input_shape) if isinstance(input_shape, Mapping) else {}
        if input_shape is not None and not isinstance(input_shape, Mapping):
            raise CalibrationError(f"{folder}: one sub-folder per input ({[d.name for d in subdirs]}); give input "
                                   f"shapes as {{input name: shape}}")
        unknown = [k for k in shapes if k not in {d.name for d in subdirs}]
        if unknown:
            raise CalibrationError(f"{folder}: no sub-folder for input(s) {unknown}; found {[d.name for d in subdirs]}")
        inputs = []
        for d in subdirs:
            sub_files = _data_files(d)
            if not sub_files:
                raise CalibrationError(f"calibration folder {str(d)!r} (input {d.name!r}) has no data files "
                                       f"({', '.join(DATA_SUFFIXES)})")
            shape = _as_shape(shapes[d.name], str(d)) if d.name in shapes else None
            inputs.append(_InputFiles(d.name, d, sub_files, shape, dt, layout, max_image_pixels, image))
        counts = {inp.name: len(inp.files) for inp in inputs}
        if len(set(counts.values())) > 1:
            raise CalibrationError(f"{folder}: the input sub-folders hold different numbers of files {counts}; "
                                   f"each batch needs one file per input")
    else:
        raise CalibrationError(f"calibration folder {str(folder)!r} is empty: put one batch per file there "
                               f"({', '.join(DATA_SUFFIXES)}), or one sub-folder per model input")
    if image is not None and not any(f.suffix.lower() in IMAGE_SUFFIXES for inp in inputs for f in inp.files):
        raise CalibrationError(f"{folder}: image= (--mean / --std / --bgr / --pixel-max) applies to image files, and "
                               "this folder has none; preprocess arrays before saving them")
    data = CalibrationFolder(folder, inputs, transform, batch_size)
    logger.info("calibration folder %s: %d batches", folder, len(data))
    return data
