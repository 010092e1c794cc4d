from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOAD_REASON_UNSPECIFIED: _ClassVar[LoadReason]
    LOAD_REQUESTED: _ClassVar[LoadReason]
    LOAD_RECOVERY: _ClassVar[LoadReason]
    LOAD_PRELOAD: _ClassVar[LoadReason]
    LOAD_REPLICA: _ClassVar[LoadReason]
    LOAD_MOVE: _ClassVar[LoadReason]
LOAD_REASON_UNSPECIFIED: LoadReason
LOAD_REQUESTED: LoadReason
LOAD_RECOVERY: LoadReason
LOAD_PRELOAD: LoadReason
LOAD_REPLICA: LoadReason
LOAD_MOVE: LoadReason

class HandshakeRequest(_message.Message):
    __slots__ = ("coordinator_nonce", "version")
    COORDINATOR_NONCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    coordinator_nonce: bytes
    version: str
    def __init__(self, coordinator_nonce: _Optional[bytes] = ..., version: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("node_id", "version", "node_nonce", "proof", "memory_bytes", "chip", "speed", "rdma_ports", "worker_cache_bytes", "weights_cap_bytes", "disk_gbps", "dequantizes", "layer_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    RDMA_PORTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_GBPS_FIELD_NUMBER: _ClassVar[int]
    DEQUANTIZES_FIELD_NUMBER: _ClassVar[int]
    LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    node_nonce: bytes
    proof: bytes
    memory_bytes: int
    chip: str
    speed: float
    rdma_ports: _containers.RepeatedCompositeFieldContainer[RdmaPort]
    worker_cache_bytes: int
    weights_cap_bytes: int
    disk_gbps: float
    dequantizes: bool
    layer_ms: float
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., node_nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., memory_bytes: _Optional[int] = ..., chip: _Optional[str] = ..., speed: _Optional[float] = ..., rdma_ports: _Optional[_Iterable[_Union[RdmaPort, _Mapping]]] = ..., worker_cache_bytes: _Optional[int] = ..., weights_cap_bytes: _Optional[int] = ..., disk_gbps: _Optional[float] = ..., dequantizes: _Optional[bool] = ..., layer_ms: _Optional[float] = ...) -> None: ...

class RdmaPort(_message.Message):
    __slots__ = ("device", "uuid", "peer_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PEER_UUID_FIELD_NUMBER: _ClassVar[int]
    device: str
    uuid: str
    peer_uuid: str
    def __init__(self, device: _Optional[str] = ..., uuid: _Optional[str] = ..., peer_uuid: _Optional[str] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadShardRequest(_message.Message):
    __slots__ = ("model_path", "model_id", "layer_start", "layer_end", "rank", "world_size", "peers", "backend", "plan_hash", "micro_batches", "rdma_devices_json", "speculative", "streamed_layers", "kind", "tensor", "keep_serving", "keep_serving_seconds", "stage_ranks", "load_reason")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICES_JSON_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    STREAMED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    KEEP_SERVING_FIELD_NUMBER: _ClassVar[int]
    KEEP_SERVING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_RANKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_REASON_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    model_id: str
    layer_start: int
    layer_end: int
    rank: int
    world_size: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    plan_hash: str
    micro_batches: int
    rdma_devices_json: str
    speculative: str
    streamed_layers: int
    kind: str
    tensor: bool
    keep_serving: bool
    keep_serving_seconds: float
    stage_ranks: _containers.RepeatedScalarFieldContainer[int]
    load_reason: LoadReason
    def __init__(self, model_path: _Optional[str] = ..., model_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., plan_hash: _Optional[str] = ..., micro_batches: _Optional[int] = ..., rdma_devices_json: _Optional[str] = ..., speculative: _Optional[str] = ..., streamed_layers: _Optional[int] = ..., kind: _Optional[str] = ..., tensor: _Optional[bool] = ..., keep_serving: _Optional[bool] = ..., keep_serving_seconds: _Optional[float] = ..., stage_ranks: _Optional[_Iterable[int]] = ..., load_reason: _Optional[_Union[LoadReason, str]] = ...) -> None: ...

class LoadShardReply(_message.Message):
    __slots__ = ("model_id", "layer_start", "layer_end", "num_layers", "dtype", "load_seconds", "worker_address", "worker_pid", "load_nice")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    LOAD_NICE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layer_start: int
    layer_end: int
    num_layers: int
    dtype: str
    load_seconds: float
    worker_address: str
    worker_pid: int
    load_nice: int
    def __init__(self, model_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., load_seconds: _Optional[float] = ..., worker_address: _Optional[str] = ..., worker_pid: _Optional[int] = ..., load_nice: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "grammar", "logprobs", "top_logprobs", "resumed_tokens", "prediction_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    grammar: str
    logprobs: bool
    top_logprobs: int
    resumed_tokens: int
    prediction_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., grammar: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., prediction_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("tokens", "finish_reason", "error", "prompt_tokens", "cached_tokens", "logprobs", "accepted_prediction_tokens", "rejected_prediction_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    error: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "cancel")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel: str
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("request_id", "chunk", "status_code", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    status_code: int
    status_details: str
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class EncodeInput(_message.Message):
    __slots__ = ("tokens", "type_ids")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TYPE_IDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    type_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., type_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "inputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EncodeInput]
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EncodeInput, _Mapping]]] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("dim", "values")
    DIM_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    dim: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, dim: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class TranscribeRequest(_message.Message):
    __slots__ = ("request_id", "audio", "filename", "language", "prompt", "has_temperature", "temperature", "word_timestamps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    HAS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    audio: bytes
    filename: str
    language: str
    prompt: str
    has_temperature: bool
    temperature: float
    word_timestamps: bool
    def __init__(self, request_id: _Optional[str] = ..., audio: _Optional[bytes] = ..., filename: _Optional[str] = ..., language: _Optional[str] = ..., prompt: _Optional[str] = ..., has_temperature: _Optional[bool] = ..., temperature: _Optional[float] = ..., word_timestamps: _Optional[bool] = ...) -> None: ...

class TranscriptWord(_message.Message):
    __slots__ = ("word", "start", "end")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    word: str
    start: float
    end: float
    def __init__(self, word: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class TranscriptSegment(_message.Message):
    __slots__ = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob", "words")
    ID_FIELD_NUMBER: _ClassVar[int]
    SEEK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    AVG_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    NO_SPEECH_PROB_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: _containers.RepeatedCompositeFieldContainer[TranscriptWord]
    def __init__(self, id: _Optional[int] = ..., seek: _Optional[int] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., avg_logprob: _Optional[float] = ..., compression_ratio: _Optional[float] = ..., no_speech_prob: _Optional[float] = ..., words: _Optional[_Iterable[_Union[TranscriptWord, _Mapping]]] = ...) -> None: ...

class TranscribeReply(_message.Message):
    __slots__ = ("text", "language", "duration", "segments")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    language: str
    duration: float
    segments: _containers.RepeatedCompositeFieldContainer[TranscriptSegment]
    def __init__(self, text: _Optional[str] = ..., language: _Optional[str] = ..., duration: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[TranscriptSegment, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "model_id", "status", "version", "layer_start", "layer_end", "num_layers", "metrics_port", "pid", "data_port", "worker_pid", "rank", "world_size", "checks", "workers", "memory_total_bytes", "memory_available_bytes", "memory_pressure", "loading")
    READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    model_id: str
    status: str
    version: str
    layer_start: int
    layer_end: int
    num_layers: int
    metrics_port: int
    pid: int
    data_port: int
    worker_pid: int
    rank: int
    world_size: int
    checks: _containers.RepeatedCompositeFieldContainer[NodeCheck]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    memory_total_bytes: int
    memory_available_bytes: int
    memory_pressure: str
    loading: bool
    def __init__(self, ready: _Optional[bool] = ..., model_id: _Optional[str] = ..., status: _Optional[str] = ..., version: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., metrics_port: _Optional[int] = ..., pid: _Optional[int] = ..., data_port: _Optional[int] = ..., worker_pid: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., checks: _Optional[_Iterable[_Union[NodeCheck, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., memory_pressure: _Optional[str] = ..., loading: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("model_id", "ready", "status", "pid", "metrics_port", "worker_address", "layer_start", "layer_end", "num_layers", "rank", "world_size", "plan_hash", "footprint_bytes", "mlx_active_bytes", "speculative_acceptance_rate", "speculative_tokens_per_step")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    ready: bool
    status: str
    pid: int
    metrics_port: int
    worker_address: str
    layer_start: int
    layer_end: int
    num_layers: int
    rank: int
    world_size: int
    plan_hash: str
    footprint_bytes: int
    mlx_active_bytes: int
    speculative_acceptance_rate: float
    speculative_tokens_per_step: float
    def __init__(self, model_id: _Optional[str] = ..., ready: _Optional[bool] = ..., status: _Optional[str] = ..., pid: _Optional[int] = ..., metrics_port: _Optional[int] = ..., worker_address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., plan_hash: _Optional[str] = ..., footprint_bytes: _Optional[int] = ..., mlx_active_bytes: _Optional[int] = ..., speculative_acceptance_rate: _Optional[float] = ..., speculative_tokens_per_step: _Optional[float] = ...) -> None: ...

class UnloadShardRequest(_message.Message):
    __slots__ = ("model_id", "grace_seconds", "worker_pid")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    grace_seconds: float
    worker_pid: int
    def __init__(self, model_id: _Optional[str] = ..., grace_seconds: _Optional[float] = ..., worker_pid: _Optional[int] = ...) -> None: ...

class UnloadShardReply(_message.Message):
    __slots__ = ("was_loaded", "killed", "seconds")
    WAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KILLED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    was_loaded: bool
    killed: bool
    seconds: float
    def __init__(self, was_loaded: _Optional[bool] = ..., killed: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class NodeCheck(_message.Message):
    __slots__ = ("name", "status", "detail", "fix")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FIX_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    detail: str
    fix: str
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., detail: _Optional[str] = ..., fix: _Optional[str] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightFile(_message.Message):
    __slots__ = ("name", "size", "safetensors", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    safetensors: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., safetensors: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("model_id", "fingerprint", "layer_start", "layer_end", "num_layers", "files")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    fingerprint: str
    layer_start: int
    layer_end: int
    num_layers: int
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    def __init__(self, model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ...) -> None: ...

class FileHolding(_message.Message):
    __slots__ = ("name", "have_bytes", "complete")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HAVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    name: str
    have_bytes: int
    complete: bool
    def __init__(self, name: _Optional[str] = ..., have_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class WeightNeeds(_message.Message):
    __slots__ = ("local_path", "full_copy", "files")
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    FULL_COPY_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    local_path: str
    full_copy: bool
    files: _containers.RepeatedCompositeFieldContainer[FileHolding]
    def __init__(self, local_path: _Optional[str] = ..., full_copy: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[FileHolding, _Mapping]]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("fingerprint", "file", "offset", "data", "crc32", "sha256")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    file: str
    offset: int
    data: bytes
    crc32: int
    sha256: bytes
    def __init__(self, fingerprint: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class WeightAck(_message.Message):
    __slots__ = ("file", "bytes_done", "complete")
    FILE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    file: str
    bytes_done: int
    complete: bool
    def __init__(self, file: _Optional[str] = ..., bytes_done: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class LinkProbeRequest(_message.Message):
    __slots__ = ("rank", "peers", "timeout_seconds", "nbytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    nbytes: int
    def __init__(self, rank: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ..., nbytes: _Optional[int] = ...) -> None: ...

class LinkProbeReply(_message.Message):
    __slots__ = ("gb_per_s", "latency_us", "nbytes")
    GB_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    gb_per_s: float
    latency_us: float
    nbytes: int
    def __init__(self, gb_per_s: _Optional[float] = ..., latency_us: _Optional[float] = ..., nbytes: _Optional[int] = ...) -> None: ...
