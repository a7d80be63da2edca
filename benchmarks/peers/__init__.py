"""Peers the benchmarks run beside prefixserve (llama.cpp's ``llama-server``), and the roofline."""
