from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PinRequest(_message.Message):
    __slots__ = ("namespace", "hash_len", "hashes", "hold_ms", "slot_bytes", "shards", "reader_node_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASH_LEN_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    READER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hash_len: int
    hashes: bytes
    hold_ms: int
    slot_bytes: int
    shards: int
    reader_node_id: str
    def __init__(self, namespace: _Optional[bytes] = ..., hash_len: _Optional[int] = ..., hashes: _Optional[bytes] = ..., hold_ms: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., shards: _Optional[int] = ..., reader_node_id: _Optional[str] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin_id", "blocks", "slot_addrs", "checksums", "hold_ms", "slot_bytes", "shards", "incarnation")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ADDRS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    blocks: int
    slot_addrs: bytes
    checksums: bytes
    hold_ms: int
    slot_bytes: int
    shards: int
    incarnation: int
    def __init__(self, pin_id: _Optional[int] = ..., blocks: _Optional[int] = ..., slot_addrs: _Optional[bytes] = ..., checksums: _Optional[bytes] = ..., hold_ms: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., shards: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ChecksumsRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class ChecksumsResponse(_message.Message):
    __slots__ = ("checksums",)
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    checksums: bytes
    def __init__(self, checksums: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...
