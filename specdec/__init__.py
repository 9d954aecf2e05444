"""specdec: distributed speculative decoding.

The client library needs only grpcio and protobuf:

    from specdec import Client
    with Client("localhost:50050") as client:
        for chunk in client.stream("Why is the sky blue?", max_new_tokens=64):
            print(chunk.text, end="", flush=True)
"""

from specdec.client import Client, Result

__all__ = ["Client", "Result"]
