"""Generated wire messages: ``from swarm.proto import swarm_pb2, swarm_pb2_grpc`` (see ``generate.py``)."""

# 2: a commit that finds no gradients held fails (GradientsDropped); the Commit RPC; ReplyMeta.commit_hold_s
# 3: Frame.batch (several frames in one message)
PROTOCOL_VERSION = 3
