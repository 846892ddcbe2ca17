import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_ADD_TO_CART: _ClassVar[Action]
    ACTION_VIEW_DETAIL: _ClassVar[Action]
    ACTION_APPLY_COUPON: _ClassVar[Action]
    ACTION_SHARE_SOCIAL: _ClassVar[Action]
    ACTION_EXIT: _ClassVar[Action]

class PageType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_TYPE_UNSPECIFIED: _ClassVar[PageType]
    PAGE_TYPE_SEARCH: _ClassVar[PageType]
    PAGE_TYPE_RECOMMEND: _ClassVar[PageType]
    PAGE_TYPE_DETAIL: _ClassVar[PageType]
    PAGE_TYPE_CART: _ClassVar[PageType]

class DecisionSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_SOURCE_UNSPECIFIED: _ClassVar[DecisionSource]
    DECISION_SOURCE_POLICY: _ClassVar[DecisionSource]
    DECISION_SOURCE_FALLBACK_LOW_CONSENSUS: _ClassVar[DecisionSource]
    DECISION_SOURCE_FALLBACK_GUARD: _ClassVar[DecisionSource]
    DECISION_SOURCE_FALLBACK_NO_MODEL: _ClassVar[DecisionSource]
    DECISION_SOURCE_FALLBACK_DEGRADED: _ClassVar[DecisionSource]
    DECISION_SOURCE_EXPLORATION: _ClassVar[DecisionSource]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_ADD_TO_CART: _ClassVar[Outcome]
    OUTCOME_ORDER: _ClassVar[Outcome]
    OUTCOME_COUPON_USED: _ClassVar[Outcome]
    OUTCOME_SHARE: _ClassVar[Outcome]
    OUTCOME_EXIT: _ClassVar[Outcome]
    OUTCOME_COMPLAINT: _ClassVar[Outcome]
ACTION_UNSPECIFIED: Action
ACTION_ADD_TO_CART: Action
ACTION_VIEW_DETAIL: Action
ACTION_APPLY_COUPON: Action
ACTION_SHARE_SOCIAL: Action
ACTION_EXIT: Action
PAGE_TYPE_UNSPECIFIED: PageType
PAGE_TYPE_SEARCH: PageType
PAGE_TYPE_RECOMMEND: PageType
PAGE_TYPE_DETAIL: PageType
PAGE_TYPE_CART: PageType
DECISION_SOURCE_UNSPECIFIED: DecisionSource
DECISION_SOURCE_POLICY: DecisionSource
DECISION_SOURCE_FALLBACK_LOW_CONSENSUS: DecisionSource
DECISION_SOURCE_FALLBACK_GUARD: DecisionSource
DECISION_SOURCE_FALLBACK_NO_MODEL: DecisionSource
DECISION_SOURCE_FALLBACK_DEGRADED: DecisionSource
DECISION_SOURCE_EXPLORATION: DecisionSource
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_ADD_TO_CART: Outcome
OUTCOME_ORDER: Outcome
OUTCOME_COUPON_USED: Outcome
OUTCOME_SHARE: Outcome
OUTCOME_EXIT: Outcome
OUTCOME_COMPLAINT: Outcome

class RecommendActionRequest(_message.Message):
    __slots__ = ("request_id", "user_id", "session_id", "item_id", "item_embedding", "recent_behavior_ids", "page_type", "event_time", "cart_item_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    RECENT_BEHAVIOR_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    CART_ITEM_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    user_id: str
    session_id: str
    item_id: str
    item_embedding: _containers.RepeatedScalarFieldContainer[float]
    recent_behavior_ids: _containers.RepeatedScalarFieldContainer[str]
    page_type: PageType
    event_time: _timestamp_pb2.Timestamp
    cart_item_count: int
    def __init__(self, request_id: _Optional[str] = ..., user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., item_id: _Optional[str] = ..., item_embedding: _Optional[_Iterable[float]] = ..., recent_behavior_ids: _Optional[_Iterable[str]] = ..., page_type: _Optional[_Union[PageType, str]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cart_item_count: _Optional[int] = ...) -> None: ...

class ActionScore(_message.Message):
    __slots__ = ("action", "policy_probability", "guard_allow_probability", "blocked", "served_probability")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    POLICY_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    GUARD_ALLOW_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    SERVED_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    action: Action
    policy_probability: float
    guard_allow_probability: float
    blocked: bool
    served_probability: float
    def __init__(self, action: _Optional[_Union[Action, str]] = ..., policy_probability: _Optional[float] = ..., guard_allow_probability: _Optional[float] = ..., blocked: _Optional[bool] = ..., served_probability: _Optional[float] = ...) -> None: ...

class RecommendActionResponse(_message.Message):
    __slots__ = ("decision_id", "action", "source", "propensity", "votes", "samples", "action_scores", "model_version", "request_id", "rule")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROPENSITY_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ACTION_SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    action: Action
    source: DecisionSource
    propensity: float
    votes: int
    samples: int
    action_scores: _containers.RepeatedCompositeFieldContainer[ActionScore]
    model_version: str
    request_id: str
    rule: str
    def __init__(self, decision_id: _Optional[str] = ..., action: _Optional[_Union[Action, str]] = ..., source: _Optional[_Union[DecisionSource, str]] = ..., propensity: _Optional[float] = ..., votes: _Optional[int] = ..., samples: _Optional[int] = ..., action_scores: _Optional[_Iterable[_Union[ActionScore, _Mapping]]] = ..., model_version: _Optional[str] = ..., request_id: _Optional[str] = ..., rule: _Optional[str] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("decision_id", "session_id", "outcome_id", "outcome", "value", "coupon_discount", "event_time")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    COUPON_DISCOUNT_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    session_id: str
    outcome_id: str
    outcome: Outcome
    value: float
    coupon_discount: float
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, decision_id: _Optional[str] = ..., session_id: _Optional[str] = ..., outcome_id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., value: _Optional[float] = ..., coupon_discount: _Optional[float] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ("outcome_id", "logged")
    OUTCOME_ID_FIELD_NUMBER: _ClassVar[int]
    LOGGED_FIELD_NUMBER: _ClassVar[int]
    outcome_id: str
    logged: bool
    def __init__(self, outcome_id: _Optional[str] = ..., logged: _Optional[bool] = ...) -> None: ...

class ReportEngagementRequest(_message.Message):
    __slots__ = ("decision_id", "session_id", "engagement_id", "dwell_seconds", "scroll_depth", "bounced", "event_time")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGAGEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DWELL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCROLL_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BOUNCED_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    session_id: str
    engagement_id: str
    dwell_seconds: float
    scroll_depth: float
    bounced: bool
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, decision_id: _Optional[str] = ..., session_id: _Optional[str] = ..., engagement_id: _Optional[str] = ..., dwell_seconds: _Optional[float] = ..., scroll_depth: _Optional[float] = ..., bounced: _Optional[bool] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportEngagementResponse(_message.Message):
    __slots__ = ("engagement_id", "logged")
    ENGAGEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LOGGED_FIELD_NUMBER: _ClassVar[int]
    engagement_id: str
    logged: bool
    def __init__(self, engagement_id: _Optional[str] = ..., logged: _Optional[bool] = ...) -> None: ...

class ProductSku(_message.Message):
    __slots__ = ("sku_id", "embedding", "price", "stock", "competitor_price")
    SKU_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    STOCK_FIELD_NUMBER: _ClassVar[int]
    COMPETITOR_PRICE_FIELD_NUMBER: _ClassVar[int]
    sku_id: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    price: float
    stock: int
    competitor_price: float
    def __init__(self, sku_id: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., price: _Optional[float] = ..., stock: _Optional[int] = ..., competitor_price: _Optional[float] = ...) -> None: ...

class ProductCategory(_message.Message):
    __slots__ = ("category_id", "skus")
    CATEGORY_ID_FIELD_NUMBER: _ClassVar[int]
    SKUS_FIELD_NUMBER: _ClassVar[int]
    category_id: str
    skus: _containers.RepeatedCompositeFieldContainer[ProductSku]
    def __init__(self, category_id: _Optional[str] = ..., skus: _Optional[_Iterable[_Union[ProductSku, _Mapping]]] = ...) -> None: ...

class PriceBand(_message.Message):
    __slots__ = ("band_id", "price_multiplier")
    BAND_ID_FIELD_NUMBER: _ClassVar[int]
    PRICE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    band_id: str
    price_multiplier: float
    def __init__(self, band_id: _Optional[str] = ..., price_multiplier: _Optional[float] = ...) -> None: ...

class RecommendProductRequest(_message.Message):
    __slots__ = ("shopper", "categories", "price_bands", "visit_count")
    SHOPPER_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    PRICE_BANDS_FIELD_NUMBER: _ClassVar[int]
    VISIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    shopper: RecommendActionRequest
    categories: _containers.RepeatedCompositeFieldContainer[ProductCategory]
    price_bands: _containers.RepeatedCompositeFieldContainer[PriceBand]
    visit_count: int
    def __init__(self, shopper: _Optional[_Union[RecommendActionRequest, _Mapping]] = ..., categories: _Optional[_Iterable[_Union[ProductCategory, _Mapping]]] = ..., price_bands: _Optional[_Iterable[_Union[PriceBand, _Mapping]]] = ..., visit_count: _Optional[int] = ...) -> None: ...

class LayerChoice(_message.Message):
    __slots__ = ("id", "index", "propensity", "source", "votes", "rule")
    ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROPENSITY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    id: str
    index: int
    propensity: float
    source: DecisionSource
    votes: int
    rule: str
    def __init__(self, id: _Optional[str] = ..., index: _Optional[int] = ..., propensity: _Optional[float] = ..., source: _Optional[_Union[DecisionSource, str]] = ..., votes: _Optional[int] = ..., rule: _Optional[str] = ...) -> None: ...

class RecommendProductResponse(_message.Message):
    __slots__ = ("decision_id", "category", "sku", "price_band", "joint_propensity", "model_version", "request_id")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SKU_FIELD_NUMBER: _ClassVar[int]
    PRICE_BAND_FIELD_NUMBER: _ClassVar[int]
    JOINT_PROPENSITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    category: LayerChoice
    sku: LayerChoice
    price_band: LayerChoice
    joint_propensity: float
    model_version: str
    request_id: str
    def __init__(self, decision_id: _Optional[str] = ..., category: _Optional[_Union[LayerChoice, _Mapping]] = ..., sku: _Optional[_Union[LayerChoice, _Mapping]] = ..., price_band: _Optional[_Union[LayerChoice, _Mapping]] = ..., joint_propensity: _Optional[float] = ..., model_version: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...
