"""Calibration data sources (folders of arrays, raw files or images)."""
from fxq.data.folder import CalibrationFolder, ImagePreprocess, load_calibration_folder

__all__ = ["load_calibration_folder", "CalibrationFolder", "ImagePreprocess"]
