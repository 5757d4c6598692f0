"""Calibration: measure the decoder on this machine, fit the cost model, validate, save a profile.

`costmodel calibrate --model huginn|ouro` runs it; `calibrate/gpu.sh` runs it unattended on a GPU.
"""
