from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC_PEER: _ClassVar[Transport]

class ReadySignal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READY_SIGNAL_UNSPECIFIED: _ClassVar[ReadySignal]
    READY_SIGNAL_PRODUCER_SYNCED: _ClassVar[ReadySignal]
    READY_SIGNAL_CUDA_EVENT: _ClassVar[ReadySignal]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_CUDA_IPC: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_CUDA_IPC_PEER: Transport
READY_SIGNAL_UNSPECIFIED: ReadySignal
READY_SIGNAL_PRODUCER_SYNCED: ReadySignal
READY_SIGNAL_CUDA_EVENT: ReadySignal

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bool
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "min_tokens", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_tokens: int
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "image_tokens", "output_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    image_tokens: int
    output_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("admission_ms", "vision_queue_ms", "preprocess_ms", "vision_ms", "handoff_ms", "llm_queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "total_ms")
    ADMISSION_MS_FIELD_NUMBER: _ClassVar[int]
    VISION_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    VISION_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    LLM_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    admission_ms: float
    vision_queue_ms: float
    preprocess_ms: float
    vision_ms: float
    handoff_ms: float
    llm_queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    total_ms: float
    def __init__(self, admission_ms: _Optional[float] = ..., vision_queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., vision_ms: _Optional[float] = ..., handoff_ms: _Optional[float] = ..., llm_queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "expires_unix_ms", "reader")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    id: int
    expires_unix_ms: int
    reader: int
    def __init__(self, id: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., reader: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("transport", "arena_id", "producer_host_id", "gpu_uuid", "offset", "nbytes", "shape", "dtype", "lease", "ready", "ready_event", "inline_data", "cuda_ipc", "content_key")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    arena_id: str
    producer_host_id: str
    gpu_uuid: str
    offset: int
    nbytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    lease: Lease
    ready: ReadySignal
    ready_event: bytes
    inline_data: bytes
    cuda_ipc: CudaIpcHandle
    content_key: bytes
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., arena_id: _Optional[str] = ..., producer_host_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., ready: _Optional[_Union[ReadySignal, str]] = ..., ready_event: _Optional[bytes] = ..., inline_data: _Optional[bytes] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., content_key: _Optional[bytes] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, mem_handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class ConsumerInfo(_message.Message):
    __slots__ = ("host_id", "gpu_uuid", "accept", "peer_gpu_uuids")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    PEER_GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    gpu_uuid: str
    accept: _containers.RepeatedScalarFieldContainer[Transport]
    peer_gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., accept: _Optional[_Iterable[_Union[Transport, str]]] = ..., peer_gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("service", "model_id", "host_id", "gpu_uuid", "transports", "max_context", "image_tokens", "default_max_tokens", "variant", "reads_cached_images", "peer_gpu_uuids")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    READS_CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PEER_GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    service: str
    model_id: str
    host_id: str
    gpu_uuid: str
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    max_context: int
    image_tokens: int
    default_max_tokens: int
    variant: str
    reads_cached_images: bool
    peer_gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, service: _Optional[str] = ..., model_id: _Optional[str] = ..., host_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., max_context: _Optional[int] = ..., image_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., variant: _Optional[str] = ..., reads_cached_images: _Optional[bool] = ..., peer_gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...
