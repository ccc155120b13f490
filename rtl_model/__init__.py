"""Verilog of the CXL-HM controller's decision blocks and their cocotb benches.

The benches check the RTL in lockstep against the emulator's own reference
models (``emulator.frame_table``, ``emulator.prefetch``, ``emulator.write_buffer``);
``rtl_model.sim`` builds and runs them, ``python -m rtl_model.run`` is the
command line.
"""
