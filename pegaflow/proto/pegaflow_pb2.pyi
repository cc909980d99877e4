from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_TIER_L1: _ClassVar[BlockTier]
    BLOCK_TIER_SSD: _ClassVar[BlockTier]
    BLOCK_TIER_PEER: _ClassVar[BlockTier]
BLOCK_TIER_L1: BlockTier
BLOCK_TIER_SSD: BlockTier
BLOCK_TIER_PEER: BlockTier

class HostRegion(_message.Message):
    __slots__ = ("pid", "address", "size")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    address: int
    size: int
    def __init__(self, pid: _Optional[int] = ..., address: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class CudaRegion(_message.Message):
    __slots__ = ("ipc_handle", "offset", "size", "device_uuid")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    offset: int
    size: int
    device_uuid: bytes
    def __init__(self, ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("host", "cuda")
    HOST_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    host: HostRegion
    cuda: CudaRegion
    def __init__(self, host: _Optional[_Union[HostRegion, _Mapping]] = ..., cuda: _Optional[_Union[CudaRegion, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("offset", "size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class LayerLayout(_message.Message):
    __slots__ = ("region_index", "offset", "num_blocks", "block_stride", "segments")
    REGION_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    region_index: int
    offset: int
    num_blocks: int
    block_stride: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, region_index: _Optional[int] = ..., offset: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_stride: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "namespace", "tp_rank", "tp_size", "world_size", "device", "regions", "layers", "event_handles", "replicated", "layer_signals", "owner_token")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    LAYER_SIGNALS_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    namespace: str
    tp_rank: int
    tp_size: int
    world_size: int
    device: str
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    layers: _containers.RepeatedCompositeFieldContainer[LayerLayout]
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    replicated: bool
    layer_signals: LayerSignals
    owner_token: bytes
    def __init__(self, instance_id: _Optional[str] = ..., namespace: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[LayerLayout, _Mapping]]] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., replicated: bool = ..., layer_signals: _Optional[_Union[LayerSignals, _Mapping]] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class LayerSignals(_message.Message):
    __slots__ = ("pid", "address")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    address: int
    def __init__(self, pid: _Optional[int] = ..., address: _Optional[int] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("server_pid", "socket_path", "socket_protocol", "server_id")
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_pid: int
    socket_path: str
    socket_protocol: int
    server_id: bytes
    def __init__(self, server_pid: _Optional[int] = ..., socket_path: _Optional[str] = ..., socket_protocol: _Optional[int] = ..., server_id: _Optional[bytes] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("server_pid", "slot_bytes", "query_socket", "owner_token")
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUERY_SOCKET_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    server_pid: int
    slot_bytes: int
    query_socket: str
    owner_token: bytes
    def __init__(self, server_pid: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., query_socket: _Optional[str] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("instance_id", "tp_rank", "block_ids", "block_hashes", "layer_ids", "wait_event", "owner_token", "deadline_ns")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tp_rank: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    wait_event: int
    owner_token: bytes
    deadline_ns: int
    def __init__(self, instance_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layer_ids: _Optional[_Iterable[int]] = ..., wait_event: _Optional[int] = ..., owner_token: _Optional[bytes] = ..., deadline_ns: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("stored", "deduplicated", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    deduplicated: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., deduplicated: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class QueryPrefixRequest(_message.Message):
    __slots__ = ("instance_id", "block_hashes")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, instance_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class QueryPrefixResponse(_message.Message):
    __slots__ = ("ready", "loading")
    class Ready(_message.Message):
        __slots__ = ("num_blocks", "lease_id", "lease_ttl_s", "l1_gbps")
        NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        LEASE_ID_FIELD_NUMBER: _ClassVar[int]
        LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
        L1_GBPS_FIELD_NUMBER: _ClassVar[int]
        num_blocks: int
        lease_id: int
        lease_ttl_s: float
        l1_gbps: float
        def __init__(self, num_blocks: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., l1_gbps: _Optional[float] = ...) -> None: ...
    class Loading(_message.Message):
        __slots__ = ("num_blocks", "ready_blocks", "l1_gbps", "tier_gbps")
        NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        L1_GBPS_FIELD_NUMBER: _ClassVar[int]
        TIER_GBPS_FIELD_NUMBER: _ClassVar[int]
        num_blocks: int
        ready_blocks: int
        l1_gbps: float
        tier_gbps: float
        def __init__(self, num_blocks: _Optional[int] = ..., ready_blocks: _Optional[int] = ..., l1_gbps: _Optional[float] = ..., tier_gbps: _Optional[float] = ...) -> None: ...
    READY_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    ready: QueryPrefixResponse.Ready
    loading: QueryPrefixResponse.Loading
    def __init__(self, ready: _Optional[_Union[QueryPrefixResponse.Ready, _Mapping]] = ..., loading: _Optional[_Union[QueryPrefixResponse.Loading, _Mapping]] = ...) -> None: ...

class LoadItem(_message.Message):
    __slots__ = ("lease_id", "lease_offset", "block_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_offset: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., lease_offset: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("instance_id", "tp_rank", "lease_id", "lease_offset", "block_ids", "items", "layer_seq", "owner_token", "deadline_ns")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SEQ_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tp_rank: int
    lease_id: int
    lease_offset: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[LoadItem]
    layer_seq: int
    owner_token: bytes
    deadline_ns: int
    def __init__(self, instance_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_offset: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[LoadItem, _Mapping]]] = ..., layer_seq: _Optional[int] = ..., owner_token: _Optional[bytes] = ..., deadline_ns: _Optional[int] = ...) -> None: ...

class LoadItemResult(_message.Message):
    __slots__ = ("loaded", "bytes", "error")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    bytes: int
    error: str
    def __init__(self, loaded: _Optional[int] = ..., bytes: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("loaded", "bytes", "items")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    bytes: int
    items: _containers.RepeatedCompositeFieldContainer[LoadItemResult]
    def __init__(self, loaded: _Optional[int] = ..., bytes: _Optional[int] = ..., items: _Optional[_Iterable[_Union[LoadItemResult, _Mapping]]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("instance_id", "tp_rank", "owner_token")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tp_rank: int
    owner_token: bytes
    def __init__(self, instance_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionPing(_message.Message):
    __slots__ = ("instance_id", "tp_rank", "owner_token")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tp_rank: int
    owner_token: bytes
    def __init__(self, instance_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., owner_token: _Optional[bytes] = ...) -> None: ...

class SessionPong(_message.Message):
    __slots__ = ("server_time_ns",)
    SERVER_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    server_time_ns: int
    def __init__(self, server_time_ns: _Optional[int] = ...) -> None: ...

class WatchBlocksRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("kind", "tier", "block_hashes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[BlockEvent.Kind]
        REMOVED: _ClassVar[BlockEvent.Kind]
    STORED: BlockEvent.Kind
    REMOVED: BlockEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEvent.Kind
    tier: BlockTier
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., tier: _Optional[_Union[BlockTier, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("resync", "snapshot_done", "events")
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    snapshot_done: bool
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, resync: bool = ..., snapshot_done: bool = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...
