from vlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LlmGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "image_features", "sampling", "messages", "max_prompt_tokens", "cached_image_keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    image_features: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorRef]
    sampling: _common_pb2.SamplingParams
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    max_prompt_tokens: int
    cached_image_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., image_features: _Optional[_Iterable[_Union[_common_pb2.TensorRef, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., max_prompt_tokens: _Optional[int] = ..., cached_image_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LlmGenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "timings")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.StageTimings
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ...) -> None: ...
