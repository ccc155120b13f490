"""The emulated device as a process (``chm serve``): the device node, the control socket, the clients'
queue pairs and the server loop that hands their commands to the controller. It speaks the wire
contract of ``driver/`` (``chm_wire.h``); its ring helpers (``chm_srv.c``) are its own cffi module."""
