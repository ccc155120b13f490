"""cocotb test benches, one folder per block (``tb/<module>/test_<module>.py``)."""
