"""The ways a request's bytes move, owned by the engine (layer: engine; imports gpu, backend.base, layout, protocol; never nixl, zmq or the agent).

``choose`` picks a path per request; ``kit.PathKit`` holds an agent's path resources (kernel,
staging area and slots, IPC export, stream, pipeline router); ``reading`` builds a read's
engine parts (direct descriptors, a CUDA IPC kernel job, a staged pipeline job); ``packing``
serves staged reads as a producer; ``pipeline`` is the pack -> move -> unpack pipeline (it posts
to the backend: only the engine does); ``pipes`` routes its messages; ``jobs`` are the parts that
move their own bytes.
"""
