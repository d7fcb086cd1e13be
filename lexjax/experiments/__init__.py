"""Experiments built from lexjax's training and evaluation: one module per paper result."""
