"""Measurement: the benchmark and the roofline."""
