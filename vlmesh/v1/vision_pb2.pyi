from vlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "consumer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    consumer: _common_pb2.ConsumerInfo
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., consumer: _Optional[_Union[_common_pb2.ConsumerInfo, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("features", "timings")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorRef]
    timings: _common_pb2.StageTimings
    def __init__(self, features: _Optional[_Iterable[_Union[_common_pb2.TensorRef, _Mapping]]] = ..., timings: _Optional[_Union[_common_pb2.StageTimings, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
