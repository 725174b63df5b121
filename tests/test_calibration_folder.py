"""fxq.load_calibration_folder: .npy / raw / .pt / image folders, multi-input sub-folders, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fxq
from fxq.errors import CalibrationError


def _npy(folder, name, shape, dtype=np.float32, fill=None):
    folder.mkdir(parents=True, exist_ok=True)
    arr = np.full(shape, fill, dtype) if fill is not None else np.random.default_rng(0).random(shape).astype(dtype)
    np.save(folder / name, arr)


def test_npy_raw_and_pt(tmp_path):
    for i in (10, 2, 1):  # natural order: b1, b2, b10
        _npy(tmp_path, f"b{i}.npy", (2, 3, 4, 4), np.float64, fill=i)
    np.full((3, 4, 4), 7, np.float32).tofile(tmp_path / "c.bin")  # one sample: gets a batch dim
    torch.save(torch.ones(1, 3, 4, 4), tmp_path / "d.pt")
    (tmp_path / "notes.txt").write_text("ignored")
    data = fxq.load_calibration_folder(tmp_path, input_shape=[1, 3, 4, 4])
    assert [f.name for f in data.files] == ["b1.npy", "b2.npy", "b10.npy", "c.bin", "d.pt"]
    assert len(data) == 5
    batches = list(data)
    assert [float(b[0, 0, 0, 0]) for b in batches] == [1, 2, 10, 7, 1]
    assert batches[0].dtype == torch.float32 and tuple(batches[3].shape) == (1, 3, 4, 4)
    assert [tuple(b.shape) for b in fxq.load_calibration_folder(tmp_path, [1, 3, 4, 4], batch_size=4)] == [
        (4, 3, 4, 4), (4, 3, 4, 4)]
    half = fxq.load_calibration_folder(tmp_path, [1, 3, 4, 4], dtype="float16")
    assert half[-1].dtype == torch.float16


def test_images(tmp_path):
    from torchvision.io import write_png

    for i in range(2):
        write_png((torch.rand(3, 10, 12) * 255).to(torch.uint8), str(tmp_path / f"img{i}.png"))
    nchw = fxq.load_calibration_folder(tmp_path, input_shape=[1, 3, 8, 8])
    assert tuple(nchw[0].shape) == (1, 3, 8, 8) and 0.0 <= float(nchw[0].min()) and float(nchw[0].max()) <= 1.0
    nhwc = fxq.load_calibration_folder(tmp_path, input_shape=[1, 8, 8, 3], layout="NHWC")
    assert tuple(nhwc[1].shape) == (1, 8, 8, 3)
    gray = fxq.load_calibration_folder(tmp_path, input_shape=[1, 1, 10, 12],
                                       transform=lambda x: (x - 0.5) / 0.25)
    assert tuple(gray[0].shape) == (1, 1, 10, 12) and float(gray[0].min()) < 0


def test_bmp_and_16_bit_png_read_into_unit_range(tmp_path):
    """BMP goes through Pillow (torchvision does not decode it); a 16-bit PNG scales by 65535, not 255."""
    from PIL import Image

    pixels = np.array([[0, 128], [255, 64]], np.uint8)
    Image.fromarray(np.stack([pixels] * 3, -1)).save(tmp_path / "a.bmp")
    deep = tmp_path / "deep"
    deep.mkdir()
    Image.fromarray(np.array([[0, 65535], [32768, 1000]], np.uint16)).save(deep / "a.png")
    bmp = fxq.load_calibration_folder(tmp_path, input_shape=[1, 3, 2, 2])[0]
    np.testing.assert_allclose(bmp[0, 0].numpy(), pixels / 255.0, rtol=1e-6)
    png16 = fxq.load_calibration_folder(deep, input_shape=[1, 1, 2, 2])[0]
    assert float(png16.max()) == 1.0 and float(png16.min()) == 0.0


def test_multi_input_subfolders(tmp_path):
    for i in range(2):
        _npy(tmp_path / "image", f"{i}.npy", (2, 3, 4, 4))
        _npy(tmp_path / "mask", f"{i}.npy", (2, 1, 4, 4))
    data = fxq.load_calibration_folder(tmp_path, input_shape={"image": [1, 3, 4, 4]})
    assert len(data) == 2 and set(data[0]) == {"image", "mask"}
    assert tuple(data[1]["mask"].shape) == (2, 1, 4, 4)

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, image, mask):
            return self.conv(torch.cat([image, mask], 1))

    gm = fxq.quantize(TwoInputs().eval(), data, platform="trt_int8", progress=False)
    report = fxq.graphwise_error_analyse(gm, data)
    assert report.batches == 2 and report[0].name == "conv"
    _npy(tmp_path / "mask", "2.npy", (2, 1, 4, 4))
    with pytest.raises(CalibrationError, match="different numbers of files"):
        fxq.load_calibration_folder(tmp_path)


def test_errors(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        fxq.load_calibration_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="empty.*is empty"):
        fxq.load_calibration_folder(tmp_path / "empty")
    raw = tmp_path / "raw"
    raw.mkdir()
    np.zeros(10, np.float32).tofile(raw / "x.bin")
    with pytest.raises(CalibrationError, match="x.bin.*input shape"):
        fxq.load_calibration_folder(raw)
    with pytest.raises(CalibrationError, match="x.bin: 40 bytes"):
        fxq.load_calibration_folder(raw, input_shape=[1, 3, 2, 2])
    _npy(tmp_path / "npy", "a.npy", (2, 3, 4, 4))
    with pytest.raises(CalibrationError, match="a.npy: array has shape \\[2, 3, 4, 4\\]"):
        fxq.load_calibration_folder(tmp_path / "npy", input_shape=[1, 3, 5, 5])
    (tmp_path / "npy" / "b.npy").write_bytes(b"garbage")
    with pytest.raises(CalibrationError, match="b.npy"):
        fxq.load_calibration_folder(tmp_path / "npy")


def test_multi_input_rebatching_needs_equal_sample_counts(tmp_path):
    for i in range(2):
        _npy(tmp_path / "a", f"{i}.npy", (2, 3, 4, 4), fill=i)
        _npy(tmp_path / "b", f"{i}.npy", (2 if i else 4, 1, 4, 4), fill=i)
    with pytest.raises(fxq.CalibrationError, match="different numbers of samples"):
        fxq.load_calibration_folder(tmp_path, batch_size=2)[0]
    _npy(tmp_path / "b", "0.npy", (2, 1, 4, 4), fill=0)
    batches = fxq.load_calibration_folder(tmp_path, batch_size=2)
    assert all(float(b["a"].max()) == float(b["b"].max()) for b in batches)  # samples stay paired by file



def test_image_preprocess_as_deploy_runtimes_do(tmp_path):
    """``ImagePreprocess``: BGR, 0-255 pixels, per-channel mean and std (OpenCV's blobFromImage / ncnn's
    substract_mean_normalize), checked against numpy on the PNG's own pixels; only images are touched."""
    from torchvision.io import write_png

    pixels = (torch.rand(3, 6, 5, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    write_png(pixels, str(tmp_path / "a.png"))
    image = fxq.ImagePreprocess(mean=(104, 177, 123), std=(2.0,), bgr=True, pixel_max=255)
    got = fxq.load_calibration_folder(tmp_path, input_shape=[1, 3, 6, 5], image=image)[0]
    rgb = pixels.numpy().astype(np.float64)
    want = (rgb[::-1] - np.array([104, 177, 123.0])[:, None, None]) / 2.0
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-6, atol=1e-4)
    nhwc = fxq.load_calibration_folder(tmp_path, input_shape=[1, 6, 5, 3], layout="NHWC", image=image)[0]
    torch.testing.assert_close(nhwc, got.permute(0, 2, 3, 1))
    with pytest.raises(CalibrationError, match=r"mean has 2 values for a 3-channel image; give 1 or 3"):
        fxq.load_calibration_folder(tmp_path, image=fxq.ImagePreprocess(mean=(1, 2)))[0]
    with pytest.raises(CalibrationError, match="every std must be positive"):
        fxq.ImagePreprocess(std=(1, 0, 1))
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "0.npy", np.zeros((1, 3, 4, 4), np.float32))
    with pytest.raises(CalibrationError, match=r"applies to image files, and this folder has none"):
        fxq.load_calibration_folder(arrays, image=image)


def test_cli_image_flags_reach_the_data(tmp_path, monkeypatch):
    """``--bgr --pixel-max 255 --mean ...`` build the same ImagePreprocess for every command's data folder."""
    import argparse

    from fxq.cli import _folder_options

    args = argparse.Namespace(max_image_pixels=None, mean=[104.0, 177.0, 123.0], std=None, pixel_max=255.0,
                              bgr=True)
    assert _folder_options(args) == {"image": fxq.ImagePreprocess(mean=(104, 177, 123), bgr=True, pixel_max=255)}
    args = argparse.Namespace(max_image_pixels=7, mean=None, std=None, pixel_max=None, bgr=False)
    assert _folder_options(args) == {"max_image_pixels": 7}
