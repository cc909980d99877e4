from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRef(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node", "endpoint")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    endpoint: str
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., endpoint: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "node_stale_ms", "max_batch_hashes", "ttl_s")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_STALE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    node_stale_ms: int
    max_batch_hashes: int
    ttl_s: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., node_stale_ms: _Optional[int] = ..., max_batch_hashes: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    def __init__(self, entries: _Optional[int] = ...) -> None: ...

class Blocks(_message.Message):
    __slots__ = ("namespace", "hash_len", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASH_LEN_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hash_len: int
    hashes: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., hash_len: _Optional[int] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("node", "blocks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    blocks: Blocks
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., blocks: _Optional[_Union[Blocks, _Mapping]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("inserted", "refreshed")
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    REFRESHED_FIELD_NUMBER: _ClassVar[int]
    inserted: int
    refreshed: int
    def __init__(self, inserted: _Optional[int] = ..., refreshed: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("node", "blocks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    blocks: Blocks
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ..., blocks: _Optional[_Union[Blocks, _Mapping]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class QueryPrefixRequest(_message.Message):
    __slots__ = ("blocks", "asker_node_id")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ASKER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    blocks: Blocks
    asker_node_id: str
    def __init__(self, blocks: _Optional[_Union[Blocks, _Mapping]] = ..., asker_node_id: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("node_id", "incarnation", "endpoint", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    endpoint: str
    blocks: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., endpoint: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class QueryPrefixResponse(_message.Message):
    __slots__ = ("segments", "matched")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    matched: int
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., matched: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeRef
    def __init__(self, node: _Optional[_Union[NodeRef, _Mapping]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...
