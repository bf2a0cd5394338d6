"""Prefill/decode sweeps with the transformers baseline, the roofline and plots."""
