"""End-to-end engine benchmarks: throughput, decode profiles, speculative decoding."""
