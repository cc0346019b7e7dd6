"""Generated wire messages: ``from swarm.proto import swarm_pb2, swarm_pb2_grpc`` (see ``generate.py``)."""

PROTOCOL_VERSION = 1
