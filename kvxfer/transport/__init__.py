"""Side-channel transport (layer: transport; only ``kvxfer.transport.zmq`` imports zmq, ``address`` is stdlib only).

``kvxfer.transport.zmq`` is not imported here, so resolving an address never loads zmq.
"""
