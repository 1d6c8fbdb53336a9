"""The quality gate of `memory.mode: auto`: a model's calibration (`calibration.py`: the file, the
non-inferiority decision per k, the encoding key), its statistics (`noninferiority.py`) and the
calibrations shipped for the known models (`calibrations/`)."""
