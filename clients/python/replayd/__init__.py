"""Python client for replayd, the CUDA-Graphs inference daemon.

>>> from replayd import Client
>>> client = Client("tcp://127.0.0.1:5555", model="all-MiniLM-L6-v2")
>>> client.encode(["a sentence", "another"]).shape
(2, 384)

See README.md for the API, the failure semantics and the switch from
sentence-transformers.
"""

from ._protocol import SparseEmbeddings
from .aio import AsyncClient
from .client import Client
from .errors import (
    BadRequest,
    ConnectionLost,
    DeadlineExceeded,
    Internal,
    NoHealthyEndpoint,
    Overloaded,
    ProtocolError,
    ReplaydError,
    Timeout,
    TooLong,
    Unavailable,
    UnknownModel,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "AsyncClient",
    "SparseEmbeddings",
    "ReplaydError",
    "BadRequest",
    "UnknownModel",
    "TooLong",
    "Overloaded",
    "DeadlineExceeded",
    "Unavailable",
    "Internal",
    "Timeout",
    "ConnectionLost",
    "NoHealthyEndpoint",
    "ProtocolError",
]
