"""The CXL-HM driver: the wire (``include/chm_wire.h``), the device node and
the device-process server that serves an emulator ``Controller`` to libchm
clients over shared-memory queue pairs."""
